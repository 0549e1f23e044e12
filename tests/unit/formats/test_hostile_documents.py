"""Documents a hostile or careless hand makes: each is refused at the field that is wrong, before any host
is touched (requests), or before a restore trusts it (artifacts, receipts, timing)."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    MAX_OPAQUE_VALUES,
    MAX_SAFE_INT,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.timing import (
    SpanRecorder,
    ndjson_line,
    parse_ndjson,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture
def request_doc(example_request_text) -> dict:
    return json.loads(example_request_text)


@pytest.fixture
def artifact_doc() -> dict:
    return json.loads((FIXTURES / "artifacts" / "reference-tiny-n610.json").read_text())


def refused(validate, doc) -> dict[str, str]:
    with pytest.raises(FormatError) as exc:
        validate(doc)
    return {i.path: f"{i.message} | {i.fix}" for i in exc.value.issues}


@pytest.mark.parametrize(("edit", "field"), [
    (lambda u: u["command"].__setitem__(1, "--mo\x00del"), "$.launch.units[0].command[1]"),
    (lambda u: u["environment"].__setitem__("X", "a\x00b"), "$.launch.units[0].environment.X"),
])
def test_a_nul_byte_in_a_command_or_environment_value_is_refused(request_doc, edit, field):
    edit(request_doc["launch"]["units"][0])
    assert "NUL" in refused(validate_request, request_doc)[field]


@pytest.mark.parametrize("path", ["/health\x00", "/h\u00e9alth", "/health\x7f", "/a b"])
def test_a_health_path_that_cannot_go_on_an_http_request_line_is_refused(request_doc, path):
    request_doc["validation"]["health_path"] = path
    assert "printable ASCII" in refused(validate_request, request_doc)["$.validation.health_path"]
    request_doc["validation"]["health_path"] = "/health?probe=%C3%A9"
    validate_request(request_doc)


@pytest.mark.parametrize(("target", "needle"), [
    ("/", "hide the unit's own /"), ("/etc", "hide the unit's own /etc"), ("/proc/x", "/proc"),
    ("/opt/coldsnap/activation", "activation runtime"), ("/dev", "devices"),
])
def test_a_mount_that_would_hide_what_the_unit_needs_is_refused(request_doc, target, needle):
    request_doc["launch"]["units"][0]["mounts"].append({"source": "/srv/other", "target": target, "read_only": True})
    assert needle in refused(validate_request, request_doc)["$.launch.units[0].mounts[1].target"]


def test_the_same_mount_point_spelled_twice_is_refused(request_doc):
    mounts = request_doc["launch"]["units"][0]["mounts"]
    mounts.append({**mounts[0], "target": mounts[0]["target"] + "/"})
    assert "appears twice" in refused(validate_request, request_doc)["$.launch.units[0].mounts[1].target"]


def test_a_writable_mount_of_the_models_files_is_refused(request_doc):
    request_doc["launch"]["units"][0]["mounts"][0]["read_only"] = False
    assert "read_only true" in refused(validate_request, request_doc)["$.launch.units[0].mounts[0].read_only"]
    request_doc["launch"]["units"][0]["mounts"][0]["read_only"] = True
    request_doc["launch"]["units"][0]["mounts"].append({"source": "/srv/scratch", "target": "/scratch",
                                                        "read_only": False})
    validate_request(request_doc)  # a writable scratch directory is fine
    model = request_doc["launch"]["model"]["source"]["path"]
    request_doc["launch"]["units"][0]["mounts"][1] = {"source": model, "target": "/elsewhere", "read_only": False}
    assert "read_only true" in refused(validate_request, request_doc)["$.launch.units[0].mounts[1].read_only"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 10 ** 400, b"x", {1}, 2 ** 64])
def test_opaque_engine_data_must_be_json(request_doc, value):
    request_doc["launch"]["execution"]["adapter"]["payload"] = {"x": value}
    assert "$.launch.execution.adapter.payload.x" in refused(validate_request, request_doc)


def test_opaque_engine_data_is_bounded(request_doc):
    request_doc["launch"]["execution"]["adapter"]["payload"] = {"x": [{}] * (MAX_OPAQUE_VALUES + 1)}
    problems = refused(validate_request, request_doc)
    assert any(f"more than {MAX_OPAQUE_VALUES}" in p for p in problems.values())


def test_a_document_wrong_everywhere_gives_a_bounded_message_and_every_issue(request_doc):
    request_doc["launch"]["units"][0]["environment"] = {f"X{i}": "a\x00b" for i in range(500)}
    with pytest.raises(FormatError) as exc:
        validate_request(request_doc)
    assert len(exc.value.issues) >= 500
    lines = str(exc.value).splitlines()
    assert len(lines) == FormatError.SHOWN + 2, lines[-1]
    assert lines[-1].endswith(f"and {len(exc.value.issues) - FormatError.SHOWN} more: fix these first, then validate "
                              "again")


def test_integers_beyond_what_json_holds_exactly_are_refused(request_doc):
    """Two requests differing only above 2**53 would share a canonical digest."""
    request_doc["policy"]["weights"]["native"]["staged"] = [{
        "worker": "worker-0", "path": "/var/lib/coldsnap/p.pack", "bytes": MAX_SAFE_INT + 2,
        "sha256": "sha256:" + "a" * 64}]
    assert "exactly" in refused(validate_request, request_doc)["$.policy.weights.native.staged[0].bytes"]


def _artifact_refused(art: dict) -> dict[str, str]:
    return refused(validate_artifact, art)


@pytest.mark.parametrize(("edit", "field"), [
    (lambda a: a["launch"]["execution"]["workers"][0].__setitem__("unit", "ghost"),
     "$.launch.execution.workers[0].unit"),
    (lambda a: a["launch"]["units"][0].__setitem__("index", 5), "$.launch.units[0].index"),
    (lambda a: a["launch"].__setitem__("runtime", "docker"), "$.launch.units[0].image"),
    (lambda a: a["weights"]["workers"][0].__setitem__("unit", "unit-9"), "$.weights.workers[0].unit"),
    (lambda a: a["weights"]["workers"][0].__setitem__("rank", 7), "$.weights.workers[0].rank"),
    (lambda a: a["weights"]["workers"][0]["residual"].__setitem__("path", "../../etc/shadow"),
     "$.weights.workers[0].residual.path"),
    (lambda a: a["weights"]["workers"][0]["manifest"].__setitem__("path", "state/./x"),
     "$.weights.workers[0].manifest.path"),
    (lambda a: a["acceptance"].__setitem__("reply", a["acceptance"]["reply"] + "!"), "$.acceptance.reply_sha256"),
    (lambda a: a.__setitem__("created_at", "yesterday"), "$.created_at"),
    (lambda a: a["acceptance"].__setitem__("validated_at", "2026-02-30T00:00:00Z"), "$.acceptance.validated_at"),
    (lambda a: a["runtime"].__setitem__("kind", "docker"), "$.runtime.kind"),
    (lambda a: a["weights"]["providers"]["recovery"]["model"].__setitem__("revision", "0" * 40),
     "$.weights.providers.recovery.model.revision"),
    (lambda a: a["snapshot_driver"].__setitem__("row", "n580-cpu"), "$.snapshot_driver.row"),
    (lambda a: a.__setitem__("state", "published"), "$.parent"),
])
def test_an_artifact_that_does_not_hold_together_is_refused(artifact_doc, edit, field):
    validate_artifact(copy.deepcopy(artifact_doc))
    edit(artifact_doc)
    assert field in _artifact_refused(artifact_doc)


def test_a_payload_owned_by_no_worker_is_refused(artifact_doc):
    w = artifact_doc["weights"]["workers"][0]
    if w["payload"] is None:
        hexd = hashlib.sha256(b"x").hexdigest()
        w["payload"] = {"owner": w["worker"], "size": 4096, "sha256": f"sha256:{hexd}",
                        "path": f"model-payloads/sha256/{hexd}.pack"}
    w["payload"]["owner"] = "nobody"
    assert "$.weights.workers[0].payload.owner" in _artifact_refused(artifact_doc)


def test_timing_lines_end_at_newline_only_and_are_strict_json():
    event = {"format": 1, "kind": "coldsnap-timing-event", "event": "mark", "span_id": None, "parent_id": None,
             "name": "a\u2028b\u0085c", "host": None, "unit": None, "clock": "controller", "t_ns": 1,
             "wall_unix_ns": 1_795_951_629_041_564_101, "attrs": {"rate": math.nan}}
    line = json.dumps(event, ensure_ascii=False, allow_nan=True).replace("NaN", "null") + "\n"
    assert parse_ndjson(line + line)[1]["name"] == "a\u2028b\u0085c"
    written = ndjson_line(event)
    assert "NaN" not in written and parse_ndjson(written)[0]["attrs"] == {"rate": None}


@pytest.mark.parametrize(("edit", "field"), [
    (lambda r: r["validation"].__setitem__("prompt", "ColdSnap \udcff says:"), "$.validation.prompt"),
    (lambda r: r["launch"]["units"][0]["environment"].__setitem__("X", "\ud800"), "$.launch.units[0].environment.X"),
    (lambda r: r["launch"]["execution"]["adapter"].__setitem__("payload", {"a": ["\udcff"]}),
     "$.launch.execution.adapter.payload.a[0]"),
    (lambda r: r["launch"]["execution"]["adapter"].__setitem__("payload", {"k\udcff": 1}),
     "$.launch.execution.adapter.payload['k\\udcff']"),
])
def test_a_decoded_value_that_is_not_unicode_text_is_refused_at_its_field(request_doc, edit, field):
    """What a module option or an API caller hands over decoded (a file name read with surrogateescape) is
    refused like the escape in a document, never later as a UnicodeEncodeError from the request's digest."""
    edit(request_doc)
    assert "lone UTF-16 surrogate" in refused(validate_request, request_doc)[field]


def test_an_artifact_reply_that_is_not_unicode_text_is_refused_not_a_crash(artifact_doc):
    artifact_doc["acceptance"]["reply"] = "\udcff"
    assert "lone UTF-16 surrogate" in _artifact_refused(artifact_doc)["$.acceptance.reply"]


def test_what_a_span_recorder_streams_and_envelopes_its_own_loaders_take():
    """Span attributes are whatever the code recorded: the stream, the envelope and its digest survive a NaN,
    text that is not UTF-8 (an exception quoting such a file name), a 2**70 counter and a non-JSON object."""
    events: list[dict] = []
    rec = SpanRecorder("unit:unit-0", host="h1", unit="unit-0", sink=events.append)
    with pytest.raises(OSError), rec.span("unit.read", rate=math.inf):
        raise OSError("no such file: /models/\udcff")
    rec.mark("unit.counted", total=2 ** 70, rate=math.nan, path=Path("/models"), pair=(1, 2))
    envelope = rec.finish("op-1")  # digests the envelope: raised on NaN or a lone surrogate before
    events = parse_ndjson("".join(ndjson_line(e) for e in events))
    assert [e["event"] for e in events] == ["span-start", "span-end", "mark", "envelope"]
    assert events[1]["attrs"]["error"] == "no such file: /models/\ufffd"
    assert events[2]["attrs"] == {"total": float(2 ** 70), "rate": None, "path": "/models", "pair": [1, 2]}
    assert events[3]["attrs"]["sha256"] == canonical_sha256(envelope)
    assert envelope["spans"][0]["attrs"]["rate"] is None
