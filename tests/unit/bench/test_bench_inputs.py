"""The GPU benchmarks refuse bad options before they touch a GPU, with an error that shows
the expected form (they run here too: the checks come before any CUDA call)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _run(tmp: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    # TMPDIR: the benchmarks' own scratch (the collection link setup_paths makes) stays in the test's
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "TMPDIR": str(tmp)})


@pytest.mark.parametrize(("script", "args", "message"), [
    ("gpu_snapshot.py", ["--env", "NOEQUALS"], "--env 'NOEQUALS': write it as NAME=VALUE"),
    ("gpu_snapshot.py", ["--env", "=1"], "write it as NAME=VALUE"),
    ("gpu_snapshot.py", ["--preset", "3g"], "--preset '3g' is not a reference model preset; choose from"),
    ("gpu_footprint.py", ["--env", "X"], "write it as NAME=VALUE"),
    ("gpu_footprint.py", ["--preset", "huge"], "choose from"),
    ("gpu_tp2.py", ["--preset", "huge"], "choose from"),
    ("gpu_copy_bound.py", ["--sink", "16"], "--sink takes THREADSxCHUNK_MIB values"),
    ("gpu_copy_bound.py", ["--sink", "16x0"], "--sink takes THREADSxCHUNK_MIB values"),
    ("gpu_copy_bound.py", ["--gib", "0"], "must be positive"),
    ("gpu_hydration.py", ["--threads", "8,x"], "--threads '8,x': give positive whole numbers"),
    ("gpu_hydration.py", ["--restore-threads", "0"], "--restore-threads '0': give positive whole numbers"),
    ("gpu_hydration.py", ["--strategies", "native,dma"], "choose from native, pread, register, auto"),
    ("gpu_hydration.py", ["--repeat", "0"], "--gib and --repeat must be positive"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_option_is_a_usage_error_that_names_the_fix(tmp_path, script, args, message):
    r = _run(tmp_path, script, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_good_options_pass_the_checks():
    """The control case: the same checks accept well-formed values."""
    import argparse

    sys.path.insert(0, str(BENCH))
    try:
        from gpu_snapshot import counts_arg, env_arg, preset_arg
    finally:
        sys.path.remove(str(BENCH))
    from coldsnap_engines.reference.config import PRESETS

    ap = argparse.ArgumentParser()
    assert env_arg(ap, ["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    assert preset_arg(ap, "tiny") is PRESETS["tiny"]
    assert counts_arg(ap, "--threads", "8,12,") == [8, 12]
