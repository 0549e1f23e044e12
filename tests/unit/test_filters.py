"""The collection's filters fail with a message that names what is wrong, never a Python error, and
``state_path`` never leaves its location."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from ansible_collections.coldsnap.fleet.plugins.filter.coldsnap import FilterModule

F = FilterModule().filters()
GOOD = {"launch": {"units": [{"id": "unit-0", "host": "gpu-a"}, {"id": "unit-1", "host": "gpu-b"}]}}


@pytest.mark.parametrize("request_", [
    {"launch": {}}, {"launch": {"units": "abc"}}, {"launch": {"units": [{"id": "u"}]}},
    {"launch": {"units": [{"host": "h"}]}}, {"launch": {"units": None}}, "text",
])
@pytest.mark.parametrize("name", ["unit_hosts", "host_unit_ids", "needs_coordinator"])
def test_a_request_that_is_not_one_is_named_not_a_python_error(name, request_):
    args = (request_, "gpu-a") if name == "host_unit_ids" else (request_,)
    with pytest.raises(AnsibleFilterError, match=name):
        F[name](*args)


def test_the_filters_on_a_request():
    assert F["unit_hosts"](GOOD) == ["gpu-a", "gpu-b"]
    assert F["host_unit_ids"](GOOD, "gpu-b") == ["unit-1"]


@pytest.mark.parametrize("part", ["../../etc", "/etc", "a/../../b", ""])
def test_state_path_stays_below_its_location(part):
    with pytest.raises(AnsibleFilterError, match="state_path"):
        F["state_path"]("/x", "runs", part)
    assert F["state_path"]("/x", "runs", "op-1", "progress") == "/x/runs/op-1/progress"


@pytest.mark.parametrize(("args", "needles"), [
    (("/x", "runs", None), ("part 1", "NoneType", "fix:")),
    (("/x", "runs", "op-1", 5), ("part 2", "int 5", "fix:")),
    (("/x", 5), ("unknown state location 5", "fix: name one of", "runs")),
    (("/x", "nowhere"), ("unknown state location 'nowhere'", "fix:")),
    ((5, "runs"), ("state root must be a string", "int 5", "fix:")),
    (("relative/root", "runs"), ("'relative/root' is not an absolute path", "fix:")),
])
def test_state_path_refuses_bad_arguments_by_name(args, needles):
    with pytest.raises(AnsibleFilterError) as exc:
        F["state_path"](*args)
    message = str(exc.value)
    assert message.startswith("state_path: ")
    for needle in needles:
        assert needle in message


@pytest.mark.parametrize(("value", "needle"), [(5, "must be a string, got int 5"), (["/x"], "got list"),
                                               ("var/lib/coldsnap", "is not an absolute path")])
def test_state_root_refuses_what_is_not_an_absolute_path(value, needle):
    with pytest.raises(AnsibleFilterError, match="^state_root: .*" + needle + ".*fix:"):
        F["state_root"](value)


def test_state_root_defaults_when_unset():
    assert F["state_root"](None) == F["state_root"]("") == F["state_root"]() == "/var/lib/coldsnap"
    assert F["state_root"]("/srv/coldsnap") == "/srv/coldsnap"
    assert F["state_path"](None, "runs", "op-1") == "/var/lib/coldsnap/runs/op-1"


def test_artifact_file_reads_a_descriptor_as_written_and_names_what_is_wrong(tmp_path):
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "artifacts" / "reference-tiny-n610.json"
    good = tmp_path / "artifact.json"
    good.write_bytes(fixture.read_bytes())
    assert F["artifact_file"](str(good)) == __import__("json").loads(fixture.read_bytes())
    cut = tmp_path / "cut.json"
    cut.write_bytes(fixture.read_bytes()[:100])  # truncated by a full disk or a killed copy
    for path, needle in ((cut, f"artifact {cut}"), (tmp_path, "is a directory"),
                         (tmp_path / "gone.json", "does not exist"), (None, "expected the path")):
        with pytest.raises(AnsibleFilterError, match="artifact_file") as err:
            F["artifact_file"](str(path) if path is not None else None)
        assert needle in str(err.value), str(err.value)
