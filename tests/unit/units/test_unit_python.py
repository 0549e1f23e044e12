"""Which interpreter a runtime-host unit's engine runs (its environment digest is that interpreter's):
the command's first word is found as the engine will find it, and a command that is not installed is
refused before anything runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.environment import unit_python


def _exe(path: Path, text: str = "#!/bin/sh\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_a_console_script_not_installed_is_refused_naming_it_and_where_it_was_looked_for(tmp_path):
    runtime = _exe(tmp_path / "runtime" / "bin" / "python")
    with pytest.raises(AdmissionError) as exc:
        unit_python(["vllm-not-installed-here", "serve", "/models/m"], str(runtime))
    msg = str(exc.value)
    assert "'vllm-not-installed-here'" in msg and str(runtime.parent) in msg
    assert "engine environment" in exc.value.fix and "absolute path" in exc.value.fix


def test_a_console_script_runs_the_python_beside_it_found_on_the_units_path(tmp_path):
    engine = _exe(tmp_path / "engine" / "bin" / "vllm")
    python = _exe(tmp_path / "engine" / "bin" / "python")
    runtime = _exe(tmp_path / "runtime" / "bin" / "python")
    assert unit_python(["vllm", "serve"], str(runtime), {"PATH": str(engine.parent)}) == str(python)
    # Without the unit's PATH the engine searches the runtime's directory first, then the system's.
    with pytest.raises(AdmissionError):
        unit_python(["vllm-not-installed-here"], str(runtime))
    mine = _exe(tmp_path / "runtime" / "bin" / "my-engine")
    assert unit_python([mine.name], str(runtime)) == str(runtime)
    assert ec.engine_search_path(str(runtime)).startswith(f"{runtime.parent}:")


def test_a_console_script_without_a_python_beside_it_runs_the_one_its_shebang_names(tmp_path):
    script = _exe(tmp_path / "bin" / "engine", "#!/opt/env/bin/python3.11\nimport sys\n")
    assert unit_python([str(script)], "/default/python") == "/opt/env/bin/python3.11"
    shell = _exe(tmp_path / "bin" / "wrapper", "#!/bin/sh\nexec python \"$@\"\n")
    assert unit_python([str(shell)], "/default/python") == "/default/python"


def test_a_bare_python_is_the_runtimes_and_a_relative_path_is_taken_from_the_root(tmp_path):
    runtime = _exe(tmp_path / "runtime" / "bin" / "python")
    python3 = _exe(tmp_path / "runtime" / "bin" / "python3")
    assert unit_python(["python3", "-m", "x"], str(runtime)) == str(python3)
    rel = os.path.relpath(python3, "/")
    assert unit_python([rel, "-m", "x"], "/default/python") == str(python3)
    assert unit_python([], "/default/python") == "/default/python"


def test_a_command_path_to_nothing_is_refused_naming_it_not_taken_for_the_runtimes_python(tmp_path):
    """``/opt/venv/bin/vllm serve ...`` after the environment was removed (or its program is a link to
    nothing): refused naming the program, never checked as the runtime's own interpreter."""
    runtime = _exe(tmp_path / "runtime" / "bin" / "python")
    gone = tmp_path / "removed-venv" / "bin" / "vllm"
    dangling = tmp_path / "venv" / "bin" / "vllm"
    dangling.parent.mkdir(parents=True)
    dangling.symlink_to(tmp_path / "nothing")
    for program in (gone, dangling, Path(os.path.relpath(gone, "/"))):
        with pytest.raises(AdmissionError) as exc:
            unit_python([str(program), "serve", "/models/m"], str(runtime))
        assert repr(str(program)) in str(exc.value) and "does not exist" in str(exc.value)
        assert "engine environment" in exc.value.fix
