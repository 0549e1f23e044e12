"""The collection as users get it: `ansible-galaxy collection build`, `install`, then use the installed copy.

Everything runs against the installed copy only: ``ANSIBLE_COLLECTIONS_PATH`` names the
temporary install and ``ANSIBLE_COLLECTIONS_SCAN_SYS_PATH=false`` keeps Ansible from finding
the development checkout that the virtualenv puts on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent
# Never shipped (galaxy.yml build_ignore): caches, virtualenvs, ansible-test's and ansible-lint's copies.
NEVER_SHIPPED = (".venv/", ".ansible/", ".cache/", "tests/output/", ".git/", "__pycache__/", ".pytest_cache/",
                 ".ruff_cache/")


def _ansible(tool: str, *args: str, collections: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_COLLECTIONS_PATH": str(collections), "ANSIBLE_COLLECTIONS_SCAN_SYS_PATH": "false",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "false", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false",
           "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"}
    return subprocess.run([str(VENV_BIN / tool), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def installed(module_tmp) -> tuple[Path, Path]:
    """(tarball, collections path holding the installed coldsnap.fleet)."""
    work = module_tmp("collection")
    build = _ansible("ansible-galaxy", "collection", "build", "--output-path", str(work / "dist"),
                     collections=work / "none", cwd=REPO)
    assert build.returncode == 0, build.stderr
    version = yaml.safe_load((REPO / "galaxy.yml").read_text())["version"]
    tarball = work / "dist" / f"coldsnap-fleet-{version}.tar.gz"
    assert tarball.is_file(), build.stdout
    inst = _ansible("ansible-galaxy", "collection", "install", "--offline", "-p", str(work / "collections"),
                    str(tarball), collections=work / "collections", cwd=work)
    assert inst.returncode == 0, inst.stderr
    return tarball, work / "collections"


def test_tarball_ships_the_collection_and_nothing_else(installed: tuple[Path, Path]) -> None:
    tarball, _collections = installed
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
        manifest = json.load(tar.extractfile("MANIFEST.json"))  # type: ignore[arg-type]
    leaked = sorted(n for n in names for bad in NEVER_SHIPPED if f"/{bad}" in f"/{n}/")
    assert not leaked, f"build_ignore misses: {leaked[:10]}"
    modules = sorted(p.stem for p in (REPO / "plugins" / "modules").glob("*.py") if p.stem != "__init__")
    for needed in ["meta/runtime.yml", "plugins/doc_fragments/state.py", "playbooks/capture.yml",
                   "playbooks/restore.yml", "roles/coldsnap_host/tasks/main.yml", "changelogs/changelog.yaml",
                   # the host role stages the activation runtime from <playbooks>/../runtime_image/activation
                   "runtime_image/activation/coldsnap_activation/__main__.py",
                   # ansible-builder's view of the collection's dependencies
                   "meta/execution-environment.yml", "requirements.txt", "bindep.txt",
                   *(f"roles/{r.name}/README.md" for r in (REPO / "roles").iterdir()),
                   *(f"plugins/modules/{m}.py" for m in modules)]:
        assert needed in names, needed
    info = manifest["collection_info"]
    assert (info["namespace"], info["name"]) == ("coldsnap", "fleet")
    assert set(info["license"]) == {"Apache-2.0", "GPL-3.0-or-later"}


def test_ansible_doc_reads_the_installed_copy(installed: tuple[Path, Path]) -> None:
    _tarball, collections = installed
    p = _ansible("ansible-doc", "-j", "coldsnap.fleet.host_facts", collections=collections, cwd=collections)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)["coldsnap.fleet.host_facts"]["doc"]
    assert Path(doc["filename"]).is_relative_to(collections), doc["filename"]
    assert "check_criu" in doc["options"] and doc["author"]
    listed = _ansible("ansible-doc", "-l", "-j", "coldsnap.fleet", collections=collections, cwd=collections)
    assert listed.returncode == 0, listed.stderr
    modules = {p.stem for p in (REPO / "plugins" / "modules").glob("*.py") if p.stem != "__init__"}
    assert set(json.loads(listed.stdout)) == {f"coldsnap.fleet.{m}" for m in modules}


def test_installed_module_runs_on_a_bare_python(installed: tuple[Path, Path]) -> None:
    """The installed module and its module_utils run under the system Python (standard library only)."""
    _tarball, collections = installed
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    p = _ansible("ansible", "localhost", "-m", "coldsnap.fleet.host_facts", "-a", "check_criu=false",
                 "-e", f"ansible_python_interpreter={python}", "-o", collections=collections, cwd=collections)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout and '"coldsnap_host"' in p.stdout, p.stdout


@pytest.mark.parametrize("playbook", sorted(p.name for p in (REPO / "playbooks").glob("*.yml")))
def test_every_playbook_passes_syntax_check_as_installed(installed: tuple[Path, Path], playbook: str) -> None:
    """``ansible-playbook --syntax-check coldsnap.fleet.<name>`` works without a request (AWX runs it on sync)."""
    _tarball, collections = installed
    p = _ansible("ansible-playbook", "--syntax-check", "-i", "localhost,", f"coldsnap.fleet.{playbook[:-4]}",
                 collections=collections, cwd=collections)
    assert p.returncode == 0, p.stdout + p.stderr


def test_sanity_ignore_files_stay_empty() -> None:
    """ansible-test findings are fixed, never ignored (scripts/ansible-sanity.sh runs the tests)."""
    ignores = sorted((REPO / "tests" / "sanity").glob("ignore-*.txt")) if (REPO / "tests" / "sanity").is_dir() else []
    assert all(not p.read_text().strip() for p in ignores), [p.name for p in ignores if p.read_text().strip()]


@pytest.mark.parametrize(("args", "needle"), [
    ({"retention": 0, "promote": True}, "retention of 0 generations keeps nothing"),
    ({"retention": 2}, "retention takes effect only when the descriptor is promoted"),
])
def test_artifact_commit_refuses_a_retention_it_cannot_apply_before_writing(installed, tmp_path, args, needle) -> None:
    """A bad retention is refused by name before the descriptor is committed (nothing left behind)."""
    _tarball, collections = installed
    out = tmp_path / "out"
    request = {"output": {"artifact_dir": str(out)}}  # refused before the request is even looked at
    module_args = {"request": request, "evidence": [], "facts": {}, "capsules": [], "activation_digest": "sha256:" + "0" * 64,
                   "state_root": str(tmp_path / "state"), **args}
    p = _ansible("ansible", "localhost", "-m", "coldsnap.fleet.artifact_commit", "-a", json.dumps(module_args),
                 "-e", f"ansible_python_interpreter={sys.executable}", "-o", collections=collections, cwd=collections)
    assert p.returncode != 0 and needle in p.stdout, p.stdout + p.stderr
    assert not out.exists() and not (tmp_path / "state").exists()
