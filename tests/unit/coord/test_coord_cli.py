"""`coldsnap coordinator serve|health|get|set` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.endpoint import read_endpoint

from coldsnap import cli


@pytest.fixture
def served(tmp_path):
    endpoint_file = tmp_path / "endpoint.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "coldsnap.cli", "coordinator", "serve", "--endpoint-file", str(endpoint_file),
         "--scope", "op-cli", "--pid-file", str(tmp_path / "serve.pid")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    yield endpoint_file, json.loads(line), proc
    if proc.poll() is None:
        proc.terminate()
        proc.communicate(timeout=30)


def test_serve_prints_the_public_endpoint_and_stops_cleanly(served, tmp_path) -> None:
    endpoint_file, ready, proc = served
    descriptor = read_endpoint(endpoint_file)
    assert ready == {"address": "127.0.0.1", "port": descriptor.port, "scope": "op-cli",
                     "endpoint_file": str(endpoint_file)}
    assert (tmp_path / "serve.pid").read_text().strip() == str(proc.pid)
    proc.terminate()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert descriptor.token not in out + err
    assert not endpoint_file.exists() and not (tmp_path / "serve.pid").exists()


def test_health_set_get(served, capfdbinary) -> None:
    endpoint_file, _unused, _unused2 = served
    ep = ["--endpoint-file", str(endpoint_file)]
    assert cli.main(["coordinator", "health", *ep]) == 0
    assert json.loads(capfdbinary.readouterr().out)["healthy"] is True
    assert cli.main(["coordinator", "set", *ep, "greeting", "hello"]) == 0
    assert cli.main(["coordinator", "get", *ep, "greeting"]) == 0
    assert capfdbinary.readouterr().out == b"hello"


def test_set_from_stdin_and_get_binary(served, tmp_path) -> None:
    endpoint_file, _unused, _unused2 = served
    ep = ["--endpoint-file", str(endpoint_file)]
    blob = bytes(range(256))
    base = [sys.executable, "-m", "coldsnap.cli", "coordinator"]
    subprocess.run([*base, "set", *ep, "blob"], input=blob, check=True, timeout=60)
    out = subprocess.run([*base, "get", *ep, "blob"], capture_output=True, check=True, timeout=60)
    assert out.stdout == blob


def test_get_missing_and_timeout_exit_2(served, capsys) -> None:
    endpoint_file, _unused, _unused2 = served
    ep = ["--endpoint-file", str(endpoint_file)]
    assert cli.main(["coordinator", "get", *ep, "missing"]) == 2
    assert "not-found" in capsys.readouterr().err
    assert cli.main(["coordinator", "get", *ep, "missing", "--timeout-ms", "50"]) == 2
    assert "timeout" in capsys.readouterr().err


def test_health_without_server_is_a_clear_error(tmp_path, capsys) -> None:
    assert cli.main(["coordinator", "health", "--endpoint-file", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_client_commands_print_no_token(served, capfd) -> None:
    endpoint_file, _unused, _unused2 = served
    token = read_endpoint(endpoint_file).token
    ep = ["--endpoint-file", str(endpoint_file)]
    cli.main(["coordinator", "health", *ep])
    cli.main(["coordinator", "get", *ep, "missing"])
    out, err = capfd.readouterr()
    assert token not in out + err
    assert Path(endpoint_file).exists()
