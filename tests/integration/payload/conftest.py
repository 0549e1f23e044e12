"""Payload integration tests share the unit tests' builders (tests/unit/payload/payload_testlib.py)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "unit" / "payload"))
sys.path.insert(0, str(HERE))
