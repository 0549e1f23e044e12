"""The activation's cross-unit phases are the coordinator's barrier (one implementation, its documented
keys) plus the abort key: units pass together, a unit index that arrives twice is refused, one unit's
failure stops the others while they wait, and a timeout names the units that never came."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.barrier import barrier_key
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import write_endpoint
from cskv_testlib import client_for

ACTIVATION = Path(__file__).resolve().parents[3] / "runtime_image" / "activation"
sys.path.insert(0, str(ACTIVATION))
from coldsnap_activation.sync import Phases  # noqa: E402


@pytest.fixture
def endpoint_file(server, tmp_path) -> str:
    return str(write_endpoint(tmp_path / "endpoint.json", client_for(server).endpoint))


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_units_pass_a_phase_together_on_the_documented_keys(endpoint_file, client) -> None:
    units = [Phases(endpoint_file, rank=r, world=2, unit=f"u{r}") for r in range(2)]
    t, out = in_thread(lambda: units[1].wait("restore/criu", 30))
    units[0].wait("restore/criu", 30)
    t.join(30)
    assert "error" not in out
    assert client.try_get(barrier_key("restore/criu", "release@2")) is not None
    assert int(client.try_get(barrier_key("restore/criu", "arrived/0@2"))) == 2 * 2**32 + 5  # both unit indexes, once


def test_a_unit_index_that_arrives_twice_is_refused(endpoint_file) -> None:
    first, again = (Phases(endpoint_file, rank=0, world=2, unit=name) for name in ("u0", "u0-copy"))
    t, out = in_thread(lambda: first.wait("capture/dumped", 0.5))
    time.sleep(0.1)
    with pytest.raises(UnitError, match=r"unit u0-copy: phase 'capture/dumped': .*rank 0 arrived more than once"):
        again.wait("capture/dumped", 5)
    t.join(30)
    assert isinstance(out.get("error"), UnitError)  # the first one was never released by the copy


def test_an_abort_stops_a_waiting_unit_before_its_timeout(endpoint_file) -> None:
    waiting = Phases(endpoint_file, rank=0, world=2, unit="u0")
    failing = Phases(endpoint_file, rank=1, world=2, unit="u1")
    started = time.monotonic()
    t, out = in_thread(lambda: waiting.wait("restore/resumed", 60))
    time.sleep(0.3)
    failing.abort("CRIU restore failed")
    t.join(30)
    assert isinstance(out.get("error"), UnitError)
    assert "stopped because another unit failed: unit u1: CRIU restore failed" in str(out["error"])
    assert time.monotonic() - started < 10


def test_a_timeout_names_the_missing_unit_index(endpoint_file) -> None:
    lonely = Phases(endpoint_file, rank=2, world=3, unit="u2")
    with pytest.raises(UnitError, match=r"unit u2: phase 'capture/validated' timed out .* unit index\(es\) \[0, 1\]"):
        lonely.wait("capture/validated", 0.3)


def test_a_single_unit_or_no_coordinator_never_waits(endpoint_file, client) -> None:
    Phases(None, rank=0, world=3, unit="u0").wait("anything", 0.001)
    Phases(endpoint_file, rank=0, world=1, unit="u0").wait("anything", 0.001)
    assert client.try_get(barrier_key("anything", "arrived/0@1")) is None
