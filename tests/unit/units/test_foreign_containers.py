"""Which container under a canonical name ColdSnap may replace, stop or exec into."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as docker_unit


def _container(labels: dict | None, image_labels: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(name=docker_unit.canonical_container_name("a-b", "c"), labels=labels,
                           image=SimpleNamespace(labels=image_labels))


def test_canonical_names_collide_so_the_labels_decide() -> None:
    assert docker_unit.canonical_container_name("a-b", "c") == docker_unit.canonical_container_name("a", "b-c")
    mine = docker_unit.unit_labels(capture_id="cap", unit="c", operation_id="op", recipe="a-b")
    assert docker_unit.foreign_container(_container(mine), recipe="a-b", unit="c") is None
    theirs = docker_unit.unit_labels(capture_id="cap", unit="b-c", operation_id="op", recipe="a")
    why = docker_unit.foreign_container(_container(theirs), recipe="a-b", unit="c")
    assert why and "belongs to recipe 'a' unit 'b-c'" in why and "'a-b'" in why


@pytest.mark.parametrize("labels", [None, {}, {"org.coldsnap.unit": "c"},  # a capsule image's labels alone
                                    {"org.coldsnap.recipe": "a-b"}])
def test_a_container_without_both_labels_is_not_coldsnaps(labels) -> None:
    why = docker_unit.foreign_container(_container(labels), recipe="a-b", unit="c")
    assert why and "is not a ColdSnap unit container" in why


def test_labels_a_container_only_inherits_from_its_image_do_not_make_it_coldsnaps() -> None:
    capsule = {"org.coldsnap.recipe": "a-b", "org.coldsnap.unit": "c", "org.coldsnap.capture-id": "cap",
               "org.coldsnap.operation-id": "op"}
    why = docker_unit.foreign_container(_container(dict(capsule), capsule), recipe="a-b", unit="c")
    assert why and "was not started by ColdSnap" in why
    mine = docker_unit.unit_labels(capture_id="cap", unit="c", operation_id="op", recipe="a-b")
    assert docker_unit.foreign_container(_container(mine, capsule), recipe="a-b", unit="c") is None
    assert docker_unit.foreign_container(_container(mine, mine), recipe="a-b", unit="c"), \
        "an image that carries ColdSnap's container role proves nothing"
