"""Bad input to the controller: one clear message and a non-zero exit, never a traceback; the strict
formats refuse what the real run would refuse (or could not hash), and nothing else."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_json

from coldsnap.cli import main

RECEIPT = Path(__file__).resolve().parents[2] / "fixtures" / "receipts" / "restore-reference-tiny.json"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _request(tmp_path: Path, text: str, name: str = "r.json") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_path_that_is_not_a_readable_document(tmp_path, capsys) -> None:
    (tmp_path / "d").mkdir()
    rc, _out, err = _run(capsys, "validate", "--request-json", str(tmp_path / "d"))
    assert rc == 2 and "is a directory" in err and "Traceback" not in err
    rc, out, _err = _run(capsys, "validate", "--json-errors", "--request-json", str(tmp_path / "none.json"))
    assert rc == 2 and json.loads(out)["errors"][0]["message"].endswith("no such file")
    rc, _out, err = _run(capsys, "runs", "list", "--state-root", str(RECEIPT))
    assert rc == 2 and "is not a directory" in err and "Traceback" not in err
    for mode in (0o700, 0o1777):  # a directory is no endpoint file, whatever its mode (never "chmod 600 /tmp")
        (tmp_path / "d").chmod(mode)
        rc, _out, err = _run(capsys, "coordinator", "health", "--endpoint-file", str(tmp_path / "d"))
        assert rc == 2 and "is not a regular file" in err and "chmod" not in err and "Traceback" not in err


@pytest.mark.parametrize("option", ["--request-json", "--artifact-json", "--receipt-json"])
def test_an_empty_path_is_refused_with_its_fix_not_a_traceback(capsys, option) -> None:
    # '' is what an unset shell variable gives ("--artifact-json $A"): the option is given, its path is empty
    rc, _out, err = _run(capsys, "validate", option, "")
    assert rc == 2 and "the path is empty" in err and "'-' for stdin" in err, err
    rc, out, _err = _run(capsys, "validate", "--json-errors", option, "")
    assert rc == 2 and json.loads(out)["errors"][0]["message"] == "the path is empty"
    rc, _out, err = _run(capsys, "timeline", "")
    assert rc == 2 and "the path is empty" in err


@pytest.mark.parametrize("text", ["", " \n"])
def test_an_empty_document_is_called_empty(tmp_path, capsys, text) -> None:
    rc, _out, err = _run(capsys, "validate", "--request-json", str(_request(tmp_path, text)))
    assert rc == 2 and "$: is empty" in err and "Expecting value" not in err, err


def test_an_invalid_artifact_is_named_by_its_path(tmp_path, capsys) -> None:
    path = _request(tmp_path, "[]", "artifact.json")
    rc, _out, err = _run(capsys, "validate", "--artifact-json", str(path))
    assert rc == 2 and f"artifact {path} is invalid" in err, err


@pytest.mark.parametrize("text", ["[]", "null", "7"])
def test_a_document_that_is_not_an_object(capsys, monkeypatch, text) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    rc, _out, err = _run(capsys, "validate", "--request-json", "-")
    assert rc == 2 and "$: expected an object" in err and "Traceback" not in err


@pytest.mark.parametrize("driver", [True, False])
def test_duplicate_keys_are_refused_by_validate_as_by_the_run(tmp_path, capsys, example_request_text, driver) -> None:
    req = json.loads(example_request_text)
    if not driver:
        req.pop("snapshot_driver", None)
    text = json.dumps(req).replace('"format": 4,', '"format": 5, "format": 4,', 1)
    rc, _out, err = _run(capsys, "validate", "--request-json", str(_request(tmp_path, text)))
    assert rc == 2 and "$.format: duplicate key 'format'" in err


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace('"format": 4', '"format": 4.0', 1), "$.format: must be 4"),
    (lambda t: t.replace('"prompt": "', '"prompt": "\\ud800', 1), "$.validation.prompt: holds a lone UTF-16 surrogate"),
    (lambda t: t.replace('"format": 4', '"format": 1e400', 1), "beyond the range of a JSON number"),
    (lambda t: t.replace('"format": 4', '"format": 1' + "0" * 5000, 1), "an integer of 5001 digits"),
])
def test_numbers_and_strings_a_hash_could_not_take_are_refused(
        tmp_path, capsys, example_request_text, edit, message) -> None:
    text = edit(example_request_text)
    assert text != example_request_text
    rc, _out, err = _run(capsys, "validate", "--request-json", str(_request(tmp_path, text)))
    assert rc == 2 and message in err and "Traceback" not in err and "set_int_max_str_digits" not in err


def test_a_kind_that_is_not_a_string(capsys, monkeypatch) -> None:
    doc = {"launch": {"model": {"source": {"kind": [1]}}}}
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps(doc).encode())))
    rc, _out, err = _run(capsys, "validate", "--request-json", "-")
    assert rc == 2 and "an array is not one of" in err and "Traceback" not in err


@pytest.mark.parametrize(("weights", "path"), [
    ({"mode": "native", "native": {"export": False}}, "$.policy.weights.mode"),
    ({"native": {"export": False}, "recovery": {"enabled": False}}, "$.policy.weights.native.export"),
    ({"mode": "recovery", "recovery": {"enabled": False}}, "$.policy.weights.mode"),
])
def test_weights_that_no_restore_could_serve_are_refused_up_front(
        tmp_path, capsys, example_request_text, weights, path) -> None:
    req = json.loads(example_request_text)
    req.setdefault("policy", {})["weights"] = weights
    rc, _out, err = _run(capsys, "validate", "--request-json", str(_request(tmp_path, json.dumps(req))))
    assert rc == 2 and path in err


def test_canonical_json_numbers_are_ecmascript_doubles() -> None:
    """RFC 8785: beyond 2**53 an integer is the double it rounds to, printed the shortest way."""
    assert canonical_json([2**53, 2**53 + 1, 295147905179352825856, 10**21, 123456789012345678901]) == \
        b"[9007199254740992,9007199254740992,295147905179352830000,1e+21,123456789012345680000]"
    assert canonical_json([2.9514790517935283e20, 1e21, 1e-7, 0.5, -0.0]) == b"[295147905179352830000,1e+21,1e-7,0.5,0]"


@pytest.mark.parametrize(("field", "value", "message"), [
    ("prepare_only", '"no"', "$.prepare_only: expected true or false"),
    ("started_at", '"yesterday"', "$.started_at"),
    ("started_at", '"2026-02-30T10:00:00Z"', "is not a valid date and time"),
    ("replay_semantics", '"convergent"', "$.replay_semantics"),
    ("duration_seconds", "1e999", "beyond the range"),
])
def test_a_receipt_with_a_field_its_readers_cannot_use_is_refused(tmp_path, capsys, field, value, message) -> None:
    doc = json.loads(RECEIPT.read_text())
    doc[field] = "@@"
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(doc).replace('"@@"', value))
    rc, _out, err = _run(capsys, "validate", "--receipt-json", str(path))
    assert rc == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("timing", [
    {"spans": [5], "marks": []},
    {"spans": [{"start_ns": 1, "end_ns": 2, "clock": ["a"], "attrs": {}}], "marks": ["x"]},
    {"spans": [{"start_ns": 1, "end_ns": 2, "clock": "controller", "attrs": [1]}],
     "marks": [{"t_ns": 1, "clock": ["a"]}]},
])
def test_the_timeline_draws_what_it_can_of_a_hand_edited_receipt(tmp_path, capsys, timing) -> None:
    doc = json.loads(RECEIPT.read_text())
    doc["timing"] = {**{k: doc["timing"][k] for k in ("format", "kind", "operation_id")}, **timing}
    doc["result"] = {"runner": [1]}
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(doc))
    pytest.importorskip("matplotlib")
    rc, _out, err = _run(capsys, "timeline", str(path), "-o", str(tmp_path / "t.png"))
    assert rc == 0 and (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG", err
    rc, _out, err = _run(capsys, "timeline", str(path), "-o", str(tmp_path))
    assert rc == 2 and "cannot write the timeline" in err and "Traceback" not in err


def test_the_timing_stream_is_never_written_through_a_link(tmp_path) -> None:
    """``--timing-ndjson`` on a planted link (a shared /tmp) fails naming it; the target is untouched."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

    from coldsnap.runner.timing_stream import TimingStream

    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "timing.ndjson"
    link.symlink_to(victim)
    with pytest.raises(ColdSnapError, match="symbolic link"):
        TimingStream(str(link))
    assert victim.read_text() == "keep"
    stream = TimingStream(str(tmp_path / "t.ndjson"))
    stream({"kind": "x"})
    stream.close()
    assert (tmp_path / "t.ndjson").stat().st_mode & 0o777 == 0o600


EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "reference"


def test_a_request_given_to_timeline_is_named_as_a_request(tmp_path, capsys) -> None:
    rc, _out, err = _run(capsys, "timeline", str(EXAMPLES / "status.json"), "-o", str(tmp_path / "t.png"))
    assert rc == 2 and "'coldsnap-operation-request' document, not a 'coldsnap-operation-receipt' one" in err
    assert "must be 2" not in err and not (tmp_path / "t.png").exists()


def test_a_state_root_that_is_a_file_is_refused_before_anything_runs(tmp_path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv in (["status", "--request-json", str(EXAMPLES / "status.json")], ["demo", "--preset", "tiny"]):
        rc, _out, err = _run(capsys, *argv, "--state-root", str(afile))
        assert rc == 2 and f"state root {afile} is not a directory" in err and "Traceback" not in err, err
    assert afile.read_text() == ""


def test_an_artifact_that_is_not_there_is_named_before_any_playbook(tmp_path, capsys) -> None:
    """A restore needs its artifact (status and stop act on what runs, and go on without one)."""
    req = json.loads((EXAMPLES / "restore.json").read_text())
    req["artifact"]["path"] = str(tmp_path / "never-captured" / "artifact.json")
    path = _request(tmp_path, json.dumps(req))
    rc, _out, err = _run(capsys, "restore", "--request-json", str(path), "--state-root", str(tmp_path / "state"))
    assert rc == 2 and "$.artifact.path" in err and "does not exist" in err and "capture first" in err
    assert not (tmp_path / "state" / "runs").exists(), "refused before a run directory was made"


@pytest.mark.parametrize("text", ['{"format": 9, "kind": "coldsnap-artifact", "capture_id": "cap', "[]", ""])
def test_a_damaged_artifact_is_named_before_any_playbook(tmp_path, capsys, text) -> None:
    """A truncated (or otherwise non-object) artifact.json is refused naming the file and the fix, not by a Jinja
    filter error in the playbook's first play."""
    artifact = tmp_path / "artifact.json"
    artifact.write_text(text)
    req = json.loads((EXAMPLES / "restore.json").read_text())
    req["artifact"] = {"path": str(artifact)}
    path = _request(tmp_path, json.dumps(req))
    rc, _out, err = _run(capsys, "restore", "--request-json", str(path), "--state-root", str(tmp_path / "state"))
    assert rc == 2 and f"$.artifact.path: {artifact} is not an artifact descriptor" in err, err
    assert "restore another generation" in err and "Traceback" not in err
    assert not (tmp_path / "state" / "runs").exists(), "refused before a run directory was made"


@pytest.mark.parametrize("argv, message", [(["--preset", "huge"], "invalid choice: 'huge'"),
                                           (["--tp", "0"], "--tp: 0 is out of range: give 1 or more"),
                                           (["--port", "99999"], "--port: 99999 is out of range: give 1-65535"),
                                           (["--port", "http"], "--port: 'http' is not a port number")])
def test_demo_arguments_are_checked_by_name(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_state_root_this_user_cannot_read_is_named(tmp_path, capsys, monkeypatch) -> None:
    real_stat = os.stat
    locked = tmp_path / "locked"

    def stat(path, *args, **kwargs):
        if str(path) == str(locked):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    rc, _out, err = _run(capsys, "runs", "list", "--state-root", str(locked))
    assert rc == 2 and f"state root {locked} cannot be read (Permission denied)" in err and "Traceback" not in err


def test_the_demo_preset_from_the_environment_is_checked_too(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLDSNAP_DEMO_PRESET", "huge")
    with pytest.raises(SystemExit) as exc:
        main(["demo"])
    assert exc.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err


def test_a_state_root_on_a_read_only_file_system_is_named_with_the_fix(tmp_path, capsys, monkeypatch) -> None:
    real_mkdir = os.mkdir
    ro = tmp_path / "ro"

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(ro)):
            raise OSError(30, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    req = json.loads((EXAMPLES / "stop.json").read_text())
    req.pop("artifact")  # a stop needs none: nothing is checked before the state root
    path = _request(tmp_path, json.dumps(req))
    rc, _out, err = _run(capsys, "stop", "--request-json", str(path), "--state-root", str(ro))
    assert rc == 2 and f"state root {ro} cannot be written (Read-only file system" in err, err
    assert "--state-root a writable directory" in err and "Traceback" not in err


@pytest.mark.parametrize(("edit", "field"), [
    (lambda d: d.__setitem__("timing", {}), "$.timing"),
    (lambda d: d["timing"].__setitem__("operation_id", "another-run"), "$.timing"),
    (lambda d: d.__setitem__("completed_at", "2020-01-01T00:00:00Z"), "$.completed_at"),
    (lambda d: d.__setitem__("completed_at", None), "$.completed_at"),
    (lambda d: d.__setitem__("started_at", "2026-11-29T11:08:00+05:60"), "$.started_at"),
    (lambda d: (d.__setitem__("state", "failed"), d.__setitem__("error", None)), "$.error"),
    (lambda d: d.__setitem__("error", {"message": "x"}), "$.error"),  # the fixture succeeded
])
def test_a_receipt_whose_fields_contradict_each_other_is_refused(tmp_path, capsys, edit, field) -> None:
    doc = json.loads(RECEIPT.read_text())
    edit(doc)
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(doc))
    rc, _out, err = _run(capsys, "validate", "--receipt-json", str(path))
    assert rc == 2 and field in err and "Traceback" not in err, err


def test_an_empty_state_root_is_refused_not_taken_for_the_default(capsys) -> None:
    """An unset shell variable (--state-root "$SR") must not reach the production state root."""
    rc, _out, err = _run(capsys, "runs", "list", "--state-root", "")
    assert rc == 2 and "--state-root is empty" in err and "Traceback" not in err


def test_a_request_for_another_operation_is_refused_before_any_host_is_asked(capsys, monkeypatch) -> None:
    import coldsnap.api

    def contacted(*_a, **_k):
        raise AssertionError("the snapshot driver's choice ran: hosts would have been asked for facts")

    monkeypatch.setattr(coldsnap.api, "resolve_snapshot_driver", contacted)
    rc, _out, err = _run(capsys, "capture", "--request-json", str(EXAMPLES / "status.json"))
    assert rc == 2 and "is for operation 'status', not 'capture'" in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["dir", "missing-parent"])
def test_an_unwritable_receipt_file_is_refused_before_it_runs(tmp_path, capsys, monkeypatch, where) -> None:
    import coldsnap.api

    def ran(*_a, **_k):
        raise AssertionError("the operation ran")

    monkeypatch.setattr(coldsnap.api, "run", ran)
    target = tmp_path if where == "dir" else tmp_path / "no" / "receipt.json"
    rc, _out, err = _run(capsys, "status", "--request-json", str(EXAMPLES / "status.json"),
                         "--receipt-json", str(target))
    assert rc == 2 and "--receipt-json" in err and "Traceback" not in err, err


def test_environment_digest_describes_the_interpreter_it_is_given(capsys) -> None:
    rc, _out, err = _run(capsys, "environment-digest", "--describe", "--python", "/bin/false")
    assert rc == 2 and "/bin/false cannot compute its environment digest" in err and "said nothing" in err
    rc, _out, err = _run(capsys, "environment-digest", "--describe", "--python", "/nonexistent/python")
    assert rc == 2 and "/nonexistent/python" in err


def test_a_failed_operation_piped_into_head_still_exits_non_zero(capsys, monkeypatch) -> None:
    """stdout closed early (``| head``): the outcome still reaches stderr and the exit status."""
    import coldsnap.api
    from coldsnap.api import Receipt

    doc = json.loads(RECEIPT.read_text())
    doc.update(state="failed", error={"message": "unit u0 did not answer", "host": "h", "task": "t", "phase": None})
    monkeypatch.setattr(coldsnap.api, "run", lambda *_a, **_k: Receipt.from_dict(doc, path=RECEIPT))
    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = open(write_end, "w", encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", broken)
    try:
        rc = main(["status", "--request-json", str(EXAMPLES / "status.json"), "--json"])
    finally:
        monkeypatch.undo()
        try:
            broken.close()
        except BrokenPipeError:
            pass
    err = capsys.readouterr().err
    assert rc == 1 and "unit u0 did not answer" in err, (rc, err)


@pytest.mark.parametrize(("option", "given", "kind"), [
    ("--request-json", "artifacts/reference-tiny-n610.json", "coldsnap-snapshot-artifact"),
    ("--artifact-json", "receipts/restore-reference-tiny.json", "coldsnap-operation-receipt"),
    ("--receipt-json", "artifacts/reference-tiny-n610.json", "coldsnap-snapshot-artifact"),
])
def test_validate_names_a_document_of_another_kind_in_one_line(capsys, option, given, kind) -> None:
    rc, _out, err = _run(capsys, "validate", option, str(RECEIPT.parents[1] / given))
    assert rc == 2 and f"this is a {kind!r} document" in err and len(err.strip().splitlines()) <= 2, err


@pytest.mark.skipif(os.geteuid() != 0, reason="making a character device needs root")
def test_a_receipt_file_that_is_a_device_is_written_to_never_replaced(tmp_path, capsys, monkeypatch) -> None:
    """--receipt-json /dev/null as root used to rename a regular file over the device."""
    import stat

    import coldsnap.api
    from coldsnap.api import Receipt

    doc = json.loads(RECEIPT.read_text())
    monkeypatch.setattr(coldsnap.api, "run", lambda *_a, **_k: Receipt.from_dict(doc, path=RECEIPT))
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    rc, _out, err = _run(capsys, "status", "--request-json", str(EXAMPLES / "status.json"),
                         "--receipt-json", str(null))
    assert rc == 0, err
    assert stat.S_ISCHR(os.lstat(null).st_mode) and os.listdir(tmp_path) == ["null"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's needs root")
def test_output_another_user_made_in_a_shared_directory_is_never_written_into(tmp_path, capsys) -> None:
    """``--receipt-json`` / ``--timing-ndjson`` naming a named pipe (or, for the stream, a file) that another
    user made in a directory anyone may write to (/tmp): refused before anything runs, nothing written
    into it (the other user would read the receipt, or the command would hang on the pipe)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import write_output

    from coldsnap.runner.timing_stream import TimingStream

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    pipe, plain = shared / "receipt.json", shared / "timing.ndjson"
    os.mkfifo(pipe)
    plain.write_text("theirs")
    for f in (pipe, plain):
        os.chown(f, 65534, 65534)
    rc, _out, err = _run(capsys, "status", "--request-json", str(EXAMPLES / "status.json"),
                         "--receipt-json", str(pipe), "--state-root", str(tmp_path / "state"))
    assert rc == 2 and f"{pipe} belongs to uid 65534" in err and "Traceback" not in err, err
    with pytest.raises(ColdSnapError, match="belongs to uid 65534"):
        write_output(pipe, b"{}")  # never opened: opening a pipe without a reader would hang
    with pytest.raises(ColdSnapError, match="belongs to uid 65534"):
        TimingStream(str(plain))
    assert plain.read_text() == "theirs"
    mine = shared / "mine.ndjson"  # this user's own file there is fine
    stream = TimingStream(str(mine))
    stream.close()


def test_outputs_that_would_overwrite_the_request_or_cannot_be_written_are_refused_before_a_run(
        tmp_path, capsys) -> None:
    request = tmp_path / "status.json"
    request.write_text((EXAMPLES / "status.json").read_text())
    before = request.read_text()
    state = tmp_path / "state"
    for flag in ("--receipt-json", "--timing-ndjson"):
        rc, _out, err = _run(capsys, "status", "--request-json", str(request), "--state-root", str(state),
                             flag, str(request))
        assert rc == 2 and f"{flag} {request} is the request file" in err, err
    rc, _out, err = _run(capsys, "status", "--request-json", str(request), "--state-root", str(state),
                         "--timing-ndjson", str(tmp_path))
    assert rc == 2 and f"--timing-ndjson {tmp_path} is a directory" in err, err
    assert request.read_text() == before and not (state / "runs").exists(), "nothing ran, nothing was made"


def test_no_rollback_is_for_the_operations_that_evict(tmp_path, capsys) -> None:
    rc, _out, err = _run(capsys, "status", "--request-json", str(EXAMPLES / "status.json"), "--no-rollback",
                         "--state-root", str(tmp_path / "state"))
    assert rc == 2 and "--no-rollback does not apply to operation 'status'" in err, err
    assert not (tmp_path / "state").exists()


def test_an_empty_demo_state_root_is_refused_not_taken_as_the_current_directory(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc, _out, err = _run(capsys, "demo", "--preset", "tiny", "--state-root", "")
    assert rc == 2 and "--state-root is empty" in err, err
    assert os.listdir(tmp_path) == []


def test_a_bad_receipt_is_named_by_its_path_and_an_empty_payload_state_root_is_refused(tmp_path, capsys) -> None:
    bad = _request(tmp_path, '{"format": 2}', name="afile")
    for argv in (["validate", "--receipt-json", str(bad)], ["timeline", str(bad), "-o", str(tmp_path / "t.png")]):
        rc, _out, err = _run(capsys, *argv)
        assert rc == 2 and f"receipt {bad}" in err and "Traceback" not in err, err
    rc, _out, err = _run(capsys, "payload", "verify", "--sha256", "sha256:" + "0" * 64, "--size", "1",
                         "--state-root", "")
    assert rc == 2 and "--state-root is empty" in err, err
