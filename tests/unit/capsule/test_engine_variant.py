"""runtime_image/build.py --engine: which engine environment goes into the variant, what stays out,
and a clear error (naming the option and the fix) for a python that is not an environment's."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

REPO = Path(__file__).resolve().parents[3]
_SPEC = importlib.util.spec_from_file_location("coldsnap_runtime_image_build", REPO / "runtime_image" / "build.py")
build = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(build)


@pytest.mark.parametrize("python", ["/nonexistent/bin/python", "/bin/false"])
def test_a_python_that_is_not_an_environments_is_refused_with_the_fix(python):
    with pytest.raises(ColdSnapError, match=r"--engine-python .* does not run") as info:
        build.engine_site("vllm", python)
    assert "leave --engine-python out" in info.value.fix


def test_an_environment_is_read_from_its_python():
    site, version, env_id = build.engine_site("vllm", sys.executable)
    assert site.is_dir() and version == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert env_id == Path(sys.executable).parents[1].name


@pytest.mark.parametrize(("rel", "skipped"), [
    ("vllm/__init__.py", False), ("vllm/_C.abi3.so", False), ("torch-2.13.0.dist-info/RECORD", False),
    ("vllm/__pycache__/x.cpython-311.pyc", True), ("__editable___coldsnap_0_1_0_finder.py", True),
    ("coldsnap-0.1.0.dist-info/entry_points.txt", True), ("coldsnap-collections.pth", True)])
def test_the_projects_own_editable_install_and_caches_stay_out(rel, skipped):
    assert build._engine_skip(rel) is skipped  # pylint: disable=protected-access


def test_an_unknown_engine_is_refused_by_the_command_line():
    r = subprocess.run([sys.executable, str(REPO / "runtime_image" / "build.py"), "--engine", "sglang"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "invalid choice: 'sglang'" in r.stderr and "vllm" in r.stderr
