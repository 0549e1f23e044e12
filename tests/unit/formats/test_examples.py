"""Every request under examples/ is valid as shipped (format and engine rules), and the READMEs
name files that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
REQUESTS = sorted(EXAMPLES.rglob("*.json"))


def test_there_are_examples() -> None:
    assert len(REQUESTS) >= 4


@pytest.mark.parametrize("path", REQUESTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_an_example_request_is_valid(path: Path) -> None:
    req = validate_request(json.loads(path.read_text()), document=str(path))
    assert req["operation"] in path.stem or path.stem.startswith(req["operation"])


def test_the_examples_of_one_workload_describe_one_workload() -> None:
    for folder in {p.parent for p in REQUESTS}:
        reqs = [json.loads(p.read_text()) for p in folder.glob("*.json")]
        assert len({json.dumps(r["launch"], sort_keys=True) for r in reqs}) == 1, folder
        captures = [r for r in reqs if r["operation"] == "capture"]
        for r in reqs:
            if "artifact" in r:
                assert r["artifact"]["path"] == captures[0]["output"]["artifact_dir"] + "/artifact.json"


def test_readmes_name_files_that_exist() -> None:
    for readme in EXAMPLES.rglob("README.md"):
        for name in re.findall(r"examples/[\w/.-]+\.\w+", readme.read_text()):
            if "*" not in name:
                assert (EXAMPLES.parent / name).exists(), (readme, name)
