"""The acceptance check's log-probabilities: how a validation's values are digested, when they are
compared (only where the same numerics computed them), and how a request's validation becomes the
unit's (the accepted reply and log-probabilities from the artifact, the engine's default top)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import validate_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.specs import (
    accepted_validation,
    validation_for_unit,
)

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
from coldsnap_activation import probes  # noqa: E402

TOKENS = [{"token": "a", "logprob": -0.5, "top": [["a", -0.5], ["b", -1.25]]},
          {"token": "b", "logprob": -0.125, "top": [["b", -0.125], ["c", -3.0]]}]


def lp(sha="sha256:" + "1" * 64, numerics="sha256:" + "2" * 64, top=5) -> dict:
    return {"top": top, "sha256": sha, "numerics": numerics}


# ------------------------------------------------------------------ digest
def test_the_digest_changes_with_any_value_token_or_entry_and_only_then():
    base = probes.logprobs_digest(TOKENS)
    assert base == probes.logprobs_digest(json.loads(json.dumps(TOKENS)))  # a JSON round trip keeps it
    nudged = copy.deepcopy(TOKENS)
    nudged[1]["top"][1][1] = -3.0000000000000004  # one ulp
    assert probes.logprobs_digest(nudged) != base
    renamed = copy.deepcopy(TOKENS)
    renamed[0]["top"][1][0] = "B"
    assert probes.logprobs_digest(renamed) != base
    assert probes.logprobs_digest(TOKENS[:1]) != base


def test_engine_logprobs_objects_become_records_with_top_entries_in_text_order():
    obj = {"tokens": ["x"], "token_logprobs": [-0.1], "top_logprobs": [{"z": -2.0, "x": -0.1}], "text_offset": [0]}
    assert probes._token_logprobs(obj) == [{"token": "x", "logprob": -0.1, "top": [["x", -0.1], ["z", -2.0]]}]
    for broken in ({"tokens": ["x"]}, {"tokens": ["x", "y"], "token_logprobs": [-0.1], "top_logprobs": [{}]}):
        with pytest.raises(RuntimeError, match="OpenAI completions shape"):
            probes._token_logprobs(broken)


# ------------------------------------------------------------------ verdicts
@pytest.mark.parametrize("expected, got, verdict", [
    (None, lp(), "recorded"),
    (lp(), lp(), "identical"),
    (lp(), lp(sha="sha256:" + "3" * 64), probes.DIFFERS),
    (lp(), lp(sha="sha256:" + "3" * 64, numerics="sha256:" + "4" * 64), "not compared: other numerics"),
    (lp(top=5), lp(top=3), "not compared: accepted with top 5, validated with top 3"),
])
def test_values_are_compared_exactly_and_only_on_the_same_numerics(expected, got, verdict):
    assert probes.logprobs_verdict(expected, got).startswith(verdict)


def test_numerics_name_the_cpu_and_how_many_cpus_and_digest_stably():
    doc = probes.numerics(gpu=False)
    assert set(doc) == {"arch", "cpu_model", "cpus"} and doc["cpus"] >= 1 and doc["arch"]
    assert probes.numerics_digest(doc) == probes.numerics_digest(dict(reversed(list(doc.items()))))
    assert probes.numerics_digest({**doc, "cpus": doc["cpus"] + 1}) != probes.numerics_digest(doc)


# ------------------------------------------------------------------ request -> unit validation
@pytest.fixture
def request_doc(example_request_text) -> dict:
    return validate_request(json.loads(example_request_text))


def artifact_acceptance(reply="hello", logprobs=None, prompt="ColdSnap says:", max_tokens=16) -> dict:
    return {"acceptance": {"reply": reply, "logprobs": logprobs, "prompt": prompt, "max_tokens": max_tokens}}


@pytest.mark.parametrize("field, value", [("prompt", "Hello there:"), ("max_tokens", 32)])
def test_another_prompt_or_length_than_the_accepted_one_needs_its_own_expected_reply(request_doc, field, value):
    """The accepted reply answers the accepted prompt: judging another prompt by it would fail every restore,
    after the eviction. Refused naming the field, unless the request names the reply to expect."""
    other = copy.deepcopy(request_doc)
    other["validation"][field] = value
    with pytest.raises(FormatError) as err:
        accepted_validation(other, artifact_acceptance())
    assert [i.path for i in err.value.issues] == [f"$.validation.{field}"]
    assert "validation.expected" in err.value.issues[0].fix
    other["validation"]["expected"] = "the reply it gives"
    assert accepted_validation(other, artifact_acceptance())["expected"] == "the reply it gives"


def test_the_accepted_reply_and_logprobs_are_expected_unless_the_request_names_another_reply(request_doc):
    accepted = lp()
    val = accepted_validation(request_doc, artifact_acceptance(logprobs=accepted))
    assert val["expected"] == "hello" and val["expected_logprobs"] == accepted
    other = copy.deepcopy(request_doc)
    other["validation"]["expected"] = "something else"
    val = accepted_validation(other, artifact_acceptance(logprobs=accepted))
    assert val["expected"] == "something else" and "expected_logprobs" not in val
    # an artifact of an engine without logprobs (or from before them): the reply alone
    assert "expected_logprobs" not in accepted_validation(request_doc, artifact_acceptance())
    assert accepted_validation(request_doc, None) == request_doc["validation"]


def test_the_engine_default_top_applies_when_the_request_leaves_it_null(request_doc):
    assert request_doc["validation"]["logprobs"] is None
    assert validation_for_unit(request_doc, request_doc["validation"])["logprobs"] == 5  # reference engine
    off = {**request_doc["validation"], "logprobs": 0}
    assert validation_for_unit(request_doc, off)["logprobs"] == 0
    vllm = copy.deepcopy(request_doc)
    vllm["launch"]["engine"] = "vllm"
    assert validation_for_unit(vllm, request_doc["validation"])["logprobs"] == 5  # shown in CI on CPU
    sglang = copy.deepcopy(request_doc)
    sglang["launch"]["engine"] = "sglang"
    assert validation_for_unit(sglang, request_doc["validation"])["logprobs"] == 0  # not qualified yet


@pytest.mark.parametrize("value", [21, -1, "5", True])
def test_a_bad_logprobs_count_is_refused_naming_the_field(example_request_text, value):
    raw = json.loads(example_request_text)
    raw["validation"]["logprobs"] = value
    with pytest.raises(FormatError, match=r"\$\.validation\.logprobs"):
        validate_request(raw)


def test_artifacts_with_and_without_logprobs_validate_and_a_malformed_one_is_refused():
    doc = json.loads((REPO / "tests" / "fixtures" / "artifacts" / "reference-tiny-n610.json").read_text())
    assert validate_artifact(copy.deepcopy(doc))["acceptance"]["logprobs"] is None
    doc["acceptance"]["logprobs"] = lp()
    assert validate_artifact(copy.deepcopy(doc))["acceptance"]["logprobs"] == lp()
    doc["acceptance"]["logprobs"] = {**lp(), "sha256": "not a digest"}
    with pytest.raises(FormatError, match=r"\$\.acceptance\.logprobs\.sha256"):
        validate_artifact(doc)
