"""JSON Schemas under docs/schemas come from the same declarations, and accept the golden fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_json
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capabilities import capabilities
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import replay_semantics
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import request_json_schema

import coldsnap  # noqa: F401  # pylint: disable=unused-import

REPO = Path(__file__).resolve().parents[3]


def test_committed_schemas_are_current():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_schemas.py"), "--check"], check=False,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_schema_accepts_the_reference_request(example_request_text):
    jsonschema.Draft202012Validator(request_json_schema()).validate(json.loads(example_request_text))


def test_schema_rejects_unknown_fields(example_request_text):
    doc = json.loads(example_request_text)
    doc["launch"]["units"][0]["bogus"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(request_json_schema()).validate(doc)


def test_capabilities_lists_formats_engines_drivers():
    caps = capabilities()
    assert caps["formats"] == {"request": 4, "artifact": 9, "receipt": 2, "timing": 1, "cskv": 1,
                               "activation_runtime": 1, "native_manifest": 1, "validation_record": 1}
    assert {e["name"] for e in caps["engines"]} >= {"reference", "vllm", "sglang"}
    drivers = {d["id"]: d for d in caps["snapshot_drivers"]}
    assert drivers["n610"]["min_nvidia_driver"] == 610 and drivers["n610"]["exceptions"][0]["min_nvidia_driver"] == 580
    assert caps["runtimes"] == ["host", "docker"]


@pytest.mark.parametrize(("op", "prepare", "want"), [
    ("capture", False, "conflict-on-existing-output"), ("restore", True, "safe-repeat"),
    ("restore", False, "reconcile-replace"), ("warm", False, "reconcile-replace"),
    ("publish", False, "content-idempotent"), ("publish-native", False, "content-idempotent"),
    ("sleep", False, "convergent"), ("delete", False, "convergent"), ("native-status", False, "convergent")])
def test_replay_semantics(op, prepare, want):
    assert replay_semantics(op, prepare_only=prepare) == want


def test_rfc8785_canonical_json():
    assert canonical_json({"b": 1, "a": [True, None, "é\n"], "\u20ac": 2, "\U0001f600": 3}) == \
        '{"a":[true,null,"é\\n"],"b":1,"€":2,"😀":3}'.encode()
    assert canonical_json([1.0, 1e21, 1e-7, 0.1, -0.0, 123456789012345.67]) == \
        b"[1,1e+21,1e-7,0.1,0,123456789012345.67]"


def test_cli_capabilities_validate_and_errors(tmp_path, example_request_text):
    coldsnap_bin = [sys.executable, "-m", "coldsnap.cli"]
    caps = json.loads(subprocess.run([*coldsnap_bin, "capabilities"], capture_output=True, text=True,
                                     check=True).stdout)
    assert caps["kind"] == "coldsnap-capabilities"
    good = tmp_path / "r.json"
    good.write_text(example_request_text)
    out = subprocess.run([*coldsnap_bin, "validate", "--request-json", str(good)], check=False, capture_output=True,
                         text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["policy"]["retention"]["generations"] == 3
    bad = json.loads(example_request_text)
    bad["launch"]["units"][0]["image"] = "runtime:latest"
    r = subprocess.run([*coldsnap_bin, "validate", "--request-json", "-", "--json-errors"], input=json.dumps(bad),
                       check=False, capture_output=True, text=True)
    assert r.returncode == 2
    errs = json.loads(r.stdout)["errors"]
    assert any(e["path"] == "$.launch.units[0].image" and "digest" in e["fix"] for e in errs)
    v = subprocess.run([*coldsnap_bin, "--version"], check=False, capture_output=True, text=True)
    assert v.stdout.startswith("coldsnap ")


@pytest.mark.parametrize("json_errors", [False, True])
def test_validate_checks_a_top_level_string_as_the_document_not_as_a_path(tmp_path, capsys, example_request_text,
                                                                          json_errors):
    """A request file whose JSON is a string naming a valid request is refused at "$", as capture refuses it."""
    from coldsnap.cli import main

    (tmp_path / "good.json").write_text(example_request_text)
    (tmp_path / "r.json").write_text(json.dumps(str(tmp_path / "good.json")))
    argv = ["validate", "--request-json", str(tmp_path / "r.json")] + (["--json-errors"] if json_errors else [])
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2
    if json_errors:
        assert json.loads(out)["errors"] == [{"path": "$", "message": "expected an object, got string",
                                              "fix": "give an object here"}]
    else:
        assert "$: expected an object, got string" in err and "Traceback" not in err
    assert main(["validate", "--request-json", str(tmp_path / "good.json")]) == 0


def test_golden_artifact_and_receipt(fixtures_dir):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
        artifact_json_schema,
        load_artifact,
    )
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.receipt import (
        load_receipt,
        receipt_json_schema,
    )

    art_text = (fixtures_dir / "artifacts" / "reference-tiny-n610.json").read_text()
    art = load_artifact(art_text)
    jsonschema.Draft202012Validator(artifact_json_schema()).validate(json.loads(art_text))
    assert art["weights"]["workers"][0]["payload"]["path"].startswith("model-payloads/sha256/")
    rec_text = (fixtures_dir / "receipts" / "restore-reference-tiny.json").read_text()
    rec = load_receipt(rec_text)
    jsonschema.Draft202012Validator(receipt_json_schema()).validate(json.loads(rec_text))
    assert rec["replay_semantics"] == "reconcile-replace"


def test_artifact_payload_path_must_match_digest(fixtures_dir):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact

    art = json.loads((fixtures_dir / "artifacts" / "reference-tiny-n610.json").read_text())
    art["weights"]["workers"][0]["payload"]["path"] = "model-payloads/sha256/" + "0" * 64 + ".pack"
    with pytest.raises(FormatError, match="does not match digest"):
        load_artifact(json.dumps(art))
