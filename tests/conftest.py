"""Test policy shared by every test.

Tests that need CRIU, dockerd, the local registry or a C compiler *fail* in CI (CI=true) when
the tool is missing, and skip elsewhere; GPU tests skip cleanly without a GPU.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# torch.compile registers a stand-in for sys.intern when TorchDynamo is first imported, and refuses
# the patch object ansible-core puts in its place once a test imported AnsibleModule: import Dynamo
# first, so the engine tests that compile share one pytest process with the module tests.
try:
    import torch._dynamo  # noqa: F401  # pylint: disable=unused-import
except ImportError:  # environments without torch run no engine test
    pass

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SHARED_EXAMPLES = REPO.parent / "shared" / "examples"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

sys.path.insert(0, str(REPO / "tests"))


@functools.cache
def criu_problem() -> str | None:
    criu = os.environ.get("COLDSNAP_CRIU") or shutil.which("criu")
    if not criu:
        return "criu is not installed (run scripts/install-system.sh as root)"
    out = subprocess.run([criu, "--version"], check=False, capture_output=True, text=True).stdout
    version = next((line.split()[1] for line in out.splitlines() if line.startswith("Version:")), "0")
    if int(version.split(".")[0]) < 4:
        return f"criu {version} is too old (need >= 4)"
    if os.geteuid() != 0:
        return "CRIU tests need root"
    chk = subprocess.run([criu, "check"], check=False, capture_output=True, text=True)
    if chk.returncode != 0:
        return f"criu check failed: {chk.stdout.strip()} {chk.stderr.strip()}"[:300]
    return None


@functools.cache
def docker_problem() -> str | None:
    if not shutil.which("docker"):
        return "docker CLI missing (run scripts/install-system.sh)"
    r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, capture_output=True,
                       text=True)
    if r.returncode != 0:
        return "dockerd is not running (run scripts/install-system.sh)"
    return None


@functools.cache
def registry_problem() -> str | None:
    if not (shutil.which("docker-registry") or Path("/usr/bin/docker-registry").exists()):
        return "Debian's docker-registry is not installed (run scripts/install-system.sh)"
    return None


@functools.cache
def gpu_problem() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return None
    except Exception:
        pass
    return "no NVIDIA GPU"


@functools.cache
def cc_problem() -> str | None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.native_fill import compiler

    if compiler() is None:
        return "no C compiler (run scripts/install-system.sh)"
    return None


def vllm_python() -> str | None:
    """The python of vLLM's engine environment (scripts/engine-env.sh vllm), if it is built."""
    if os.environ.get("COLDSNAP_VLLM_PYTHON"):
        return os.environ["COLDSNAP_VLLM_PYTHON"]
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(["bash", str(repo / "scripts" / "engine-env.sh"), "vllm", "--print-python"],
                         check=False, capture_output=True, text=True).stdout.strip()
    return out if out and Path(out).exists() and (Path(out).parents[1] / "READY").exists() else None


def vllm_problem() -> str | None:
    if vllm_python() is None:
        return "vLLM's engine environment is not built (run scripts/engine-env.sh vllm)"
    return None


@pytest.fixture(scope="session")
def vllm_engine_python() -> str:
    """The python of vLLM's engine environment, linked to this checkout's integrations (the ``vllm``
    marker fails or skips when the environment is not built)."""
    if vllm_python() is None:
        pytest.fail(vllm_problem() or "no vLLM engine environment")
    if os.environ.get("COLDSNAP_VLLM_PYTHON"):
        return os.environ["COLDSNAP_VLLM_PYTHON"]
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(["bash", str(repo / "scripts" / "engine-env.sh"), "vllm"],
                         check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


NEEDS = {"criu": criu_problem, "docker": docker_problem, "registry": registry_problem, "cc": cc_problem,
         "vllm": vllm_problem}


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker, probe in NEEDS.items():
        if item.get_closest_marker(marker):
            problem = probe()
            if problem:
                if IN_CI:
                    pytest.fail(f"CI must provide {marker}: {problem}", pytrace=False)
                pytest.skip(problem)
    if item.get_closest_marker("gpu"):
        problem = gpu_problem()
        if problem:
            pytest.skip(problem)


# Module and package fixtures hold captures, capsules and registries (hundreds of MB each). pytest keeps
# every tmp_path_factory directory until the session ends (tmp_path_retention_policy covers tmp_path
# only), which made a full run need tens of GB at its end: these scratch directories go as soon as
# their module or package is done, unless one of its tests failed (kept for the post-mortem).
_FAILED_FILES: set[str] = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    if outcome.get_result().failed:
        _FAILED_FILES.add(item.nodeid.split("::", 1)[0])


def remove_scratch(path: Path) -> bool:
    """Remove a scratch tree unless something is mounted inside it (removing through a bind mount
    would delete its source). Returns whether it was removed."""
    prefix = str(path).rstrip("/") + "/"
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        mounts = [line.split()[4].replace("\\040", " ") for line in f if len(line.split()) > 4]
    busy = [m for m in mounts if m == str(path) or m.startswith(prefix)]
    if busy:
        print(f"kept {path}: {busy[0]} is mounted inside it", file=sys.stderr)
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _scratch(request: pytest.FixtureRequest, factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    made: list[Path] = []

    def mktemp(name: str) -> Path:
        made.append(factory.mktemp(name))
        return made[-1]

    yield mktemp
    scope = request.node.nodeid.rstrip("/")
    if any(f == scope or f.startswith(scope + "/") for f in _FAILED_FILES):
        return
    for d in made:
        remove_scratch(d)


@pytest.fixture(scope="module")
def module_tmp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Callable[[str], Path]]:
    """``tmp_path_factory.mktemp`` for module-scoped fixtures: removed when the module is done."""
    yield from _scratch(request, tmp_path_factory)


@pytest.fixture(scope="package")
def package_tmp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Callable[[str], Path]]:
    """``tmp_path_factory.mktemp`` for package-scoped fixtures: removed when the package is done."""
    yield from _scratch(request, tmp_path_factory)


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture
def example_request_text() -> str:
    """The reference request: the project's refined copy (shape kept valid against ../shared)."""
    return (FIXTURES / "requests" / "capture-reference.json").read_text()


@pytest.fixture
def world_writable(tmp_path: Path) -> Path:
    """A directory anyone may write to, as /tmp is: for what another user (uid 65534) plants there. Making
    files of another user needs root; CI runs as root."""
    if os.geteuid() != 0:
        pytest.skip("making a directory owned by another user needs root")
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    return shared
