"""Redaction rules of the controller: by name for environments, by value everywhere else."""

from __future__ import annotations

import pytest

from coldsnap.runner.redaction import MIN_SCRUB_LENGTH, REDACTED, Redactor, is_secret_name, redact_env


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "REGISTRY_PASSWORD", "api_key",
                                  "ansible_ssh_pass", "ansible_become_password", "GPG_PASSPHRASE",
                                  "coldsnap_registry_credentials", "DB_PASSWD", "SSH_PRIVATE_KEY_FILE"])
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["PATH", "HOME", "coldsnap_request", "ANSIBLE_COLLECTIONS_PATH", "LANG",
                                  "COMPASS_DIR", "AUTHOR"])
def test_plain_names(name: str) -> None:
    assert not is_secret_name(name)


def test_redact_env_replaces_secret_names_only() -> None:
    env = {"HF_TOKEN": "hf_abcdefgh", "PATH": "/usr/bin", "MY_PASSWORD": "x"}
    out = redact_env(env)
    assert out == {"HF_TOKEN": REDACTED, "PATH": "/usr/bin", "MY_PASSWORD": REDACTED}
    assert env["HF_TOKEN"] == "hf_abcdefgh"  # the input is not modified


def test_scrub_replaces_values_in_nested_data_and_keys() -> None:
    r = Redactor(["tok-1234567", "another-secret-value"])
    data = {"stdout": "got tok-1234567 and tok-1234567", "res": {"list": ["x another-secret-value y", 3]},
            "tok-1234567": True}
    out = r.scrub(data)
    assert out == {"stdout": f"got {REDACTED} and {REDACTED}", "res": {"list": [f"x {REDACTED} y", 3]},
                   REDACTED: True}


def test_scrub_prefers_the_longest_secret() -> None:
    r = Redactor(["secret-abc", "secret-abcdef"])
    assert r.text("v=secret-abcdef") == f"v={REDACTED}"


def test_short_values_are_not_scrubbed_by_value() -> None:
    r = Redactor(["1", "true", "x" * (MIN_SCRUB_LENGTH - 1)])
    assert not r
    assert r.text("true 1") == "true 1"


def test_add_secret_named_walks_nested_mappings() -> None:
    r = Redactor()
    r.add_secret_named({"all": {"hosts": {"h1": {"ansible_password": "hunter2-long", "ansible_host": "10.0.0.1"}}},
                        "api": [{"token": "tok-in-a-list"}]})
    assert r.text("hunter2-long 10.0.0.1 tok-in-a-list") == f"{REDACTED} 10.0.0.1 {REDACTED}"


def test_scrub_in_place_keeps_the_same_dict_object() -> None:
    r = Redactor(["sekret-value"])
    event = {"stdout": "sekret-value", "event_data": {"res": {"msg": "sekret-value!"}}}
    same = event
    r.scrub_in_place(event)
    assert same is event
    assert event == {"stdout": REDACTED, "event_data": {"res": {"msg": f"{REDACTED}!"}}}


@pytest.mark.parametrize("name", ["MYSQL_PWD", "GITHUB_PAT", "PGPASSWORD", "GHTOKEN"])
def test_names_a_unit_may_not_hold_are_redacted_too(name: str) -> None:
    assert is_secret_name(name)


def test_a_url_with_a_password_is_redacted_whatever_its_name() -> None:
    env = {"HTTPS_PROXY": "http://bob:ProxyPassw0rd1@proxy:3128", "NO_PROXY": "localhost,127.0.0.1",
           "MIRROR": "https://mirror.example/debian"}
    assert redact_env(env) == {**env, "HTTPS_PROXY": REDACTED}
    r = Redactor()
    r.add_secret_named(env)
    assert r.text("proxy auth ProxyPassw0rd1 failed") == f"proxy auth {REDACTED} failed"
    assert r.text("https://mirror.example/debian") == "https://mirror.example/debian"


@pytest.mark.parametrize("secret", ['S3cr"et\\pass-XYZ', "tab\ttok-12345", "line\nbreak-1", "ünï\"cødé-1"])
def test_a_secret_is_scrubbed_in_the_escaped_forms_ansible_prints(secret: str) -> None:
    import json

    r = Redactor([secret])
    result = json.dumps({"msg": f"bad {secret}"})
    assert secret not in r.text(result) and REDACTED in r.text(result)
    assert REDACTED in r.text(json.dumps(result))  # JSON in JSON: escaped twice
    assert REDACTED in r.text(json.dumps({"msg": secret}, ensure_ascii=False))
    assert REDACTED in r.text(repr(secret))
