"""What status, sleep, wake and their check mode touch of the node's payloads, and the refusal of workers
caught in different states. The units' runtime is replaced by a recorder (no engine runs here); the
weight planning is the real one, over a real node cache."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError, UnitError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import lifecycle as lifecycle_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.host_units import HostUnits
from lifecycle_helpers import make_artifact, make_request, put_pack

ACTIVATION = "sha256:" + "0" * 64


@pytest.fixture
def running(monkeypatch):
    """Every unit runs; its workers report the states in ``states`` (one list per unit, in order)."""
    seen: dict[str, list] = {"specs": []}
    states: list[list[str]] = [["ready"]]

    def lifecycle(self, specs):
        seen["specs"].extend(specs)
        return [{"unit": s.unit["id"], "ok": True, "changed": False, "state": ws[0],
                 "workers": [{"worker": f"w{i}", "state": w} for i, w in enumerate(ws)]}
                for s, ws in zip(specs, states, strict=False)]

    monkeypatch.setattr(HostUnits, "presence", lambda self, unit_id: "running")
    monkeypatch.setattr(HostUnits, "lifecycle", lifecycle)
    return seen, states


def pack_without_record(state_root: Path) -> tuple[dict, dict, Path]:
    req = make_request(operation="restore")
    digest, size = put_pack(state_root, b"weights" * 4096)
    art = make_artifact(req, capture_id="cap-1", pack=(digest, size))
    pack = next(state_root.rglob(f"{digest.split(':', 1)[1]}.pack"))
    for record in pack.parent.glob("*.coldsnap-validation.json"):
        record.unlink()  # a validation record would be rewritten by a verification
    return req, art, pack


@pytest.mark.parametrize(("action", "check_mode"), [("status", False), ("sleep", False), ("sleep", True),
                                                    ("wake", True)])
def test_status_sleep_and_check_mode_never_write_to_the_payloads(state_root, running, action, check_mode):
    req, art, pack = pack_without_record(state_root)
    before = sorted(p.relative_to(state_root) for p in state_root.rglob("*"))
    out = lifecycle_mod.lifecycle_units(req, art, host="localhost", action=action, state_root=state_root,
                                        activation_digest=ACTIVATION, python=None, check_mode=check_mode)
    assert out["units"][0]["unit"] == "unit-0"
    # Only a wake plans the weights (its check mode too, read-only: it says what a real wake would map).
    planned = ["provider" in s.weights for s in running[0]["specs"]]
    assert planned == [action == "wake"], planned
    after = sorted(p.relative_to(state_root) for p in state_root.rglob("*") if "locks" not in p.parts
                   and "claims" not in str(p))
    assert [p for p in after if "validation" in p.name or "quarantine" in p.parts] == []
    assert pack.exists() and set(before) >= {p for p in after if "model-payloads" in p.parts}


def test_a_real_wake_plans_the_weights_from_the_verified_pack(state_root, running):
    req, art, pack = pack_without_record(state_root)
    running[1][0] = ["ready"]  # already awake: nothing to do, but the plan is made (and the pack verified)
    lifecycle_mod.lifecycle_units(req, art, host="localhost", action="wake", state_root=state_root,
                                  activation_digest=ACTIVATION, python=None, check_mode=True)
    assert not list(pack.parent.glob("*.coldsnap-validation.json")), "check mode verifies read-only"
    lifecycle_mod.lifecycle_units(req, art, host="localhost", action="wake", state_root=state_root,
                                  activation_digest=ACTIVATION, python=None, check_mode=False)
    assert running[0]["specs"] and "provider" in running[0]["specs"][0].weights, "a wake maps the weights back"
    assert list(pack.parent.glob("*.coldsnap-validation.json")), "verified, with its record"


@pytest.mark.parametrize("action", ["sleep", "wake"])
def test_workers_in_different_states_are_refused_in_check_mode_as_in_a_real_run(state_root, running, action):
    req = make_request(operation="restore")
    running[1][0] = ["ready", "sleeping"]
    with pytest.raises(UnitError) as err:
        lifecycle_mod.lifecycle_units(req, None, host="localhost", action=action, state_root=state_root,
                                      activation_digest=ACTIVATION, python=None, check_mode=True)
    assert "workers are in different states (ready, sleeping)" in err.value.problem
    assert "coldsnap stop" in err.value.fix
    with pytest.raises(UnitError, match="different states"):  # what the activation runtime checks itself
        ec.require_step_states("unit-0", action, ["ready", "sleeping"])


def test_workers_in_one_state_and_a_warm_sleep():
    ec.require_step_states("u", "sleep", ["ready", "ready"])
    ec.require_step_states("u", "wake", ["sleeping", "sleeping"])
    ec.require_step_states("u", "wake", [])
    with pytest.raises(UnitError, match="is warm"):
        ec.require_step_states("u", "sleep", ["warm"])


def test_a_check_mode_wake_over_a_damaged_pack_leaves_it_where_it_is(state_root, running):
    req, art, pack = pack_without_record(state_root)
    running[1][0] = ["sleeping"]
    pack.chmod(0o600)
    with pack.open("r+b") as f:  # one byte flipped, as a failing disk does
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    try:
        out = lifecycle_mod.lifecycle_units(req, art, host="localhost", action="wake", state_root=state_root,
                                            activation_digest=ACTIVATION, python=None, check_mode=True)
        assert out["changed"] is True
    except ColdSnapError as exc:  # a mode without a fallback says the payload is not usable: also honest
        assert "payload" in str(exc)
    assert pack.exists() and not (state_root / "model-payloads" / "quarantine").exists()
