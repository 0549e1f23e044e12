"""scripts/test-lanes.sh (what `make test` runs after lint): its one setting is checked before anything runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test-lanes.sh"


@pytest.mark.parametrize("value", ["3", "two", " "])
def test_a_lane_count_other_than_1_or_2_is_refused_naming_the_setting(value: str, tmp_path: Path) -> None:
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False,
                       env={**os.environ, "COLDSNAP_TEST_LANES": value, "COLDSNAP_TEST_TMP": str(tmp_path / "t")})
    assert r.returncode == 2 and r.stdout == ""
    assert f"COLDSNAP_TEST_LANES={value} is not 1 or 2" in r.stderr and "two lanes at once" in r.stderr
    assert not (tmp_path / "t").exists(), "nothing ran"
