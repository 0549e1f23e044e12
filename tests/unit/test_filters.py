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
