"""Receipts are sized for fleets (the opaque-data bound of task arguments is not theirs), and an issue
quotes a bad value without repeating all of it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import (
    MAX_RECEIPT_VALUES,
    RECEIPT_SCHEMA,
    load_receipt,
    validate_receipt,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    MAX_OPAQUE_VALUES,
    MAX_QUOTED,
    AnyJSON,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
RECEIPT = FIXTURES / "receipts" / "restore-reference-tiny.json"  # a real one-host restore


def _values(value) -> int:
    if isinstance(value, dict):
        return 1 + sum(_values(v) for v in value.values())
    if isinstance(value, list):
        return 1 + sum(_values(v) for v in value)
    return 1


def _fleet_receipt(hosts: int) -> dict:
    """The one-host receipt with every span and task repeated for ``hosts`` hosts."""
    one = json.loads(RECEIPT.read_text())
    doc = copy.deepcopy(one)
    spans, tasks = [], []
    for h in range(hosts):
        for span in one["timing"]["spans"]:
            s = copy.deepcopy(span)
            s["span_id"] = f"h{h}/{span['span_id']}"
            if s["parent_id"] is not None:
                s["parent_id"] = f"h{h}/{span['parent_id']}"
            if s["host"] is not None:
                s["host"] = f"gpu-{h}"
            spans.append(s)
        tasks.extend(copy.deepcopy(one["result"]["tasks"]))
    doc["timing"]["spans"] = spans
    doc["result"]["tasks"] = tasks
    return doc


def test_a_receipt_of_200_hosts_validates() -> None:
    doc = _fleet_receipt(200)
    assert _values(doc["timing"]) > MAX_OPAQUE_VALUES, "more than the bound of task arguments"
    assert validate_receipt(doc)["timing"]["spans"][-1]["host"] == "gpu-199"
    assert load_receipt(json.dumps(doc, indent=2))["operation_id"] == doc["operation_id"]


def test_the_receipt_bound_and_its_fix() -> None:
    for name in ("timing", "result"):
        schema = RECEIPT_SCHEMA.fields[name].schema
        found = getattr(schema, "inner", schema)  # result: Nullable(...)
        assert isinstance(found, AnyJSON) and found.max_values == MAX_RECEIPT_VALUES >= 2_000_000
        assert "engine-owned" not in found.too_big_fix and "fewer hosts" in found.too_big_fix
    doc = json.loads(RECEIPT.read_text())
    doc["result"]["custom_stats"] = {"x": [0] * MAX_RECEIPT_VALUES}
    with pytest.raises(FormatError) as err:
        validate_receipt(doc)
    (issue,) = err.value.issues
    assert f"more than {MAX_RECEIPT_VALUES} JSON values" in issue.message and "engine-owned" not in issue.fix


def test_engine_owned_data_in_a_request_keeps_its_bound(example_request_text) -> None:
    req = json.loads(example_request_text)
    req["launch"]["execution"]["adapter"]["payload"] = {"x": [0] * (MAX_OPAQUE_VALUES + 1)}
    with pytest.raises(FormatError) as err:
        validate_request(req)
    assert any(f"more than {MAX_OPAQUE_VALUES} JSON values" in i.message and "engine-owned" in i.fix
               for i in err.value.issues)


@pytest.mark.parametrize("field", ["operation_id", "state"])
def test_an_issue_quotes_a_long_value_cut_short(field) -> None:
    doc = json.loads(RECEIPT.read_text())
    doc[field] = "x" * 100_000
    with pytest.raises(FormatError) as err:
        validate_receipt(doc)
    (issue,) = err.value.issues
    assert len(issue.message) < MAX_QUOTED + 200 and "(100000 characters)" in issue.message
    assert len(str(err.value)) < 1000


def test_an_unknown_long_key_is_cut_short_in_path_and_message() -> None:
    doc = json.loads(RECEIPT.read_text())
    doc["k" * 100_000] = 1
    with pytest.raises(FormatError) as err:
        validate_receipt(doc)
    (issue,) = err.value.issues
    assert len(issue.path) < MAX_QUOTED + 100 and len(issue.message) < MAX_QUOTED + 200
    assert "unknown field" in issue.message


def test_a_short_value_is_quoted_whole() -> None:
    doc = json.loads(RECEIPT.read_text())
    doc["state"] = "weird"
    with pytest.raises(FormatError) as err:
        validate_receipt(doc)
    assert err.value.issues[0].message.startswith("'weird' is not one of")
