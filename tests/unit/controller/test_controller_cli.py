"""`coldsnap <operation>` argument and request checks that fail before any playbook runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from coldsnap.api import resolve_state_root
from coldsnap.cli import main
from coldsnap.runner import contract, default_state_root


def _write_request(tmp_path: Path, text: str, **changes) -> Path:
    req = json.loads(text)
    req.update(changes)
    path = tmp_path / "request.json"
    path.write_text(json.dumps(req))
    return path


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_prepare_only_is_refused_for_capture(tmp_path, capsys, example_request_text) -> None:
    req = _write_request(tmp_path, example_request_text)
    rc, out, err = _run(capsys, "capture", "--request-json", str(req), "--prepare-only", "--state-root",
                        str(tmp_path / "state"))
    assert rc == 2 and out == ""
    assert "--prepare-only) does not apply to operation 'capture'" in err and "restore or warm" in err
    assert not (tmp_path / "state").exists()  # nothing ran


def test_operation_must_match_the_verb(tmp_path, capsys, example_request_text) -> None:
    req = _write_request(tmp_path, example_request_text)
    rc, _unused, err = _run(capsys, "restore", "--request-json", str(req), "--state-root", str(tmp_path / "state"))
    assert rc == 2
    assert "is for operation 'capture', not 'restore'" in err and "coldsnap capture" in err


def test_invalid_request_fails_before_anything_runs(tmp_path, capsys, example_request_text) -> None:
    req = _write_request(tmp_path, example_request_text, surprise=1)
    rc, _unused, err = _run(capsys, "capture", "--request-json", str(req), "--state-root", str(tmp_path / "state"))
    assert rc == 2 and "surprise" in err
    assert not (tmp_path / "state").exists()


def test_missing_collection_playbook_is_a_clear_error(tmp_path, capsys, example_request_text, monkeypatch) -> None:
    # A collection tree without playbooks/ (as while the playbooks are being written).
    monkeypatch.setattr(contract, "collection_dir", lambda: tmp_path / "collection")
    req = _write_request(tmp_path, example_request_text)
    rc, _unused, err = _run(capsys, "capture", "--request-json", str(req), "--state-root", str(tmp_path / "state"))
    assert rc == 2
    assert "playbooks/capture.yml does not exist" in err and "--playbook" in err


def test_missing_explicit_playbook(tmp_path, capsys, example_request_text) -> None:
    req = _write_request(tmp_path, example_request_text)
    rc, _unused, err = _run(capsys, "capture", "--request-json", str(req), "--playbook", str(tmp_path / "nope.yml"),
                            "--state-root", str(tmp_path / "state"))
    assert rc == 2 and "nope.yml does not exist" in err


@pytest.mark.parametrize(("arg", "message"), [
    ("novalue", "is not KEY=VALUE"),
    ("coldsnap_request=x", "is set by the controller"),
    ("1bad=x", "'1bad' is not a variable name"),
])
def test_bad_extra_vars(tmp_path, capsys, example_request_text, arg, message) -> None:
    req = _write_request(tmp_path, example_request_text)
    rc, _unused, err = _run(capsys, "capture", "--request-json", str(req), "-e", arg, "--state-root",
                            str(tmp_path / "state"))
    assert rc == 2 and message in err


def test_secret_env_must_exist(tmp_path, capsys, example_request_text, monkeypatch) -> None:
    monkeypatch.delenv("COLDSNAP_TEST_UNSET_VAR", raising=False)
    req = _write_request(tmp_path, example_request_text)
    rc, _unused, err = _run(capsys, "capture", "--request-json", str(req), "--secret-env",
                            "registry_password=COLDSNAP_TEST_UNSET_VAR", "--state-root", str(tmp_path / "state"))
    assert rc == 2 and "COLDSNAP_TEST_UNSET_VAR is not set" in err


def test_a_secret_env_variable_leaves_the_controllers_environment_before_ansible_starts(
        tmp_path, capsys, example_request_text, monkeypatch) -> None:
    """ansible-runner copies the controller's environment into ansible-playbook (and, on a local
    connection, every module): a variable named by --secret-env travels only as the secret."""
    from coldsnap import api

    monkeypatch.setenv("COLDSNAP_TEST_SECRET", "s3cr3t-value")
    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_run(operation, request, **kwargs):
        seen.update(secrets=kwargs["secrets"], env=dict(os.environ))
        raise Stop

    monkeypatch.setattr(api, "run", fake_run)
    req = _write_request(tmp_path, example_request_text)
    with pytest.raises(Stop):
        main(["capture", "--request-json", str(req), "--state-root", str(tmp_path / "state"),
              "--secret-env", "registry_password=COLDSNAP_TEST_SECRET",
              "--secret-env", "hf_token=COLDSNAP_TEST_SECRET"])
    assert seen["secrets"] == {"registry_password": "s3cr3t-value", "hf_token": "s3cr3t-value"}
    assert "COLDSNAP_TEST_SECRET" not in seen["env"]
    assert "s3cr3t-value" not in json.dumps(seen["env"])


def test_state_root_precedence(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("COLDSNAP_STATE_ROOT", str(tmp_path / "from-env"))
    assert resolve_state_root(None) == tmp_path / "from-env"
    assert resolve_state_root(str(tmp_path / "flag")) == tmp_path / "flag"
    monkeypatch.delenv("COLDSNAP_STATE_ROOT")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_state_root() == Path("/var/lib/coldsnap")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_root() == tmp_path / "xdg" / "coldsnap"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_root() == tmp_path / "home" / ".local" / "state" / "coldsnap"


def test_every_operation_has_a_verb(capsys) -> None:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import OPERATIONS

    for op in OPERATIONS:
        with pytest.raises(SystemExit) as exc:
            main([op, "--help"])
        assert exc.value.code == 0
        assert f"playbooks/{op.replace('-', '_')}.yml" in capsys.readouterr().out


@pytest.mark.parametrize("verb", ["validate", "restore"])
def test_hostile_nesting_exits_2_with_one_message(tmp_path, capsys, verb) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    argv = [verb, "--request-json", str(path)] + (["--state-root", str(tmp_path / "s")] if verb != "validate" else [])
    rc, _out, err = _run(capsys, *argv)
    assert rc == 2
    assert "levels deep" in err and "Traceback" not in err
    assert not (tmp_path / "s").exists()


def test_no_rollback_reaches_the_run_and_rollback_is_the_default(tmp_path, monkeypatch, example_request_text) -> None:
    from coldsnap import api

    seen: list = []

    class Stop(Exception):
        pass

    def fake_run(operation, request, **kwargs):
        seen.append(kwargs["rollback"])
        raise Stop

    monkeypatch.setattr(api, "run", fake_run)
    req = _write_request(tmp_path, example_request_text)
    for extra in ([], ["--no-rollback"]):
        with pytest.raises(Stop):
            main(["restore", "--request-json", str(req), "--state-root", str(tmp_path / "state"), *extra])
    assert seen == [True, False]
