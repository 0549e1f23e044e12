"""Engine integrations by name: what each engine supports, as data.

The formats only know the names; engine-specific rules (load formats, writers,
sleep support) live here so the coordinator and the artifact code stay neutral.
"""

from __future__ import annotations

from dataclasses import dataclass

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatIssue


@dataclass(frozen=True)
class EngineSpec:
    """One inference engine integration."""

    name: str
    adapter_schema: str
    canonical_writer: bool
    default_materialize: str
    sleep_wake: bool
    warm_restore: bool
    integration: str
    required_args: tuple[str, ...] = ()
    qualified: str = ""

    def as_capability(self) -> dict:
        return {
            "name": self.name,
            "adapter_schema": self.adapter_schema,
            "canonical_writer": self.canonical_writer,
            "default_materialize": self.default_materialize,
            "sleep_wake": self.sleep_wake,
            "warm_restore": self.warm_restore,
            "qualified": self.qualified,
        }


ENGINES: dict[str, EngineSpec] = {
    "reference": EngineSpec(
        name="reference", adapter_schema="reference-v1", canonical_writer=True, default_materialize="async",
        sleep_wake=True, warm_restore=True, integration="coldsnap_engines.reference",
        qualified="CPU (CRIU 4.1.1) and NVIDIA H200",
    ),
    "vllm": EngineSpec(
        name="vllm", adapter_schema="vllm-v1", canonical_writer=True, default_materialize="async",
        sleep_wake=True, warm_restore=True, integration="coldsnap_engines.vllm",
        required_args=("--enable-sleep-mode",),
        qualified="written to vLLM's plugin API; not qualified on these machines",
    ),
    "sglang": EngineSpec(
        name="sglang", adapter_schema="sglang-v1", canonical_writer=False, default_materialize="off",
        sleep_wake=True, warm_restore=True, integration="coldsnap_engines.sglang",
        qualified="written to SGLang's API; not qualified on these machines",
    ),
}


def engine_issues(request: dict) -> list[FormatIssue]:
    """Engine rules for a request that already passed the format check."""
    launch = request["launch"]
    spec = ENGINES[launch["engine"]]
    issues: list[FormatIssue] = []
    native = request["policy"]["weights"]["native"]
    if native.get("materialize") in ("async", "required") and not spec.canonical_writer:
        issues.append(FormatIssue(
            "$.policy.weights.native.materialize",
            f"engine {spec.name!r} has no canonical model-payload writer, so materialize={native['materialize']!r} "
            "cannot be honoured",
            "set materialize to 'off' (an already published native payload can still be restored)",
        ))
    adapter = launch["execution"]["adapter"]
    if adapter["schema"] != spec.adapter_schema:
        issues.append(FormatIssue(
            "$.launch.execution.adapter.schema",
            f"{adapter['schema']!r} does not belong to engine {spec.name!r}",
            f"use {spec.adapter_schema!r}",
        ))
    if request["operation"] == "capture":
        for i, unit in enumerate(launch["units"]):
            for arg in spec.required_args:
                if arg not in unit["command"]:
                    issues.append(FormatIssue(
                        f"$.launch.units[{i}].command",
                        f"engine {spec.name!r} capture needs {arg} in the serve command",
                        f"add {arg} to the command",
                    ))
    return issues
