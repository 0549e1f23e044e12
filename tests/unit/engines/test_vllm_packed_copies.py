"""Which of vLLM's packed linear-weight copies the CPU release may drop (``cpu_packed.find``/``release``),
without vLLM: layers built the way vLLM's CPU dispatch leaves them. Packing again needs vLLM's kernels:
tests/integration/vllm/test_vllm_packed_weights.py runs the whole cycle in its engine environment."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


class CPUDNNLGEMMHandler:  # the shape of vLLM's handler (vllm/_custom_ops.py)
    def __init__(self, n: int, k: int) -> None:
        self.n, self.k = n, k
        self.handler_tensor = torch.tensor(1234, dtype=torch.int64)
        self.freed: list[int] = []
        self.dtor = self.freed.append


def _layer(n: int, k: int, *, kind: str, keep_weight: bool = False) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.ones(n, k, dtype=torch.bfloat16) if keep_weight
                                      else torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    if kind == "sgl":
        packed = torch.ones(n * k, dtype=torch.bfloat16)
        layer.cpu_linear = lambda x, weight, bias: (x, packed, n)
    elif kind == "onednn":
        handler = CPUDNNLGEMMHandler(n, k)
        layer.cpu_linear = lambda x, weight, bias: (x, handler)
    else:
        layer.cpu_linear = torch.nn.functional.linear
    return layer


def test_copies_with_a_weight_to_pack_from_are_found_and_freed_in_place():
    from coldsnap_engines.vllm import cpu_packed

    model = torch.nn.Module()
    model.a = _layer(64, 32, kind="sgl")
    model.b = _layer(128, 64, kind="onednn")
    model.head = _layer(256, 64, kind="onednn", keep_weight=True)  # the LM head keeps its weight
    model.plain = _layer(8, 8, kind="fallback")  # torch's linear: no copy
    model.stray = _layer(32, 32, kind="onednn")  # no weight anywhere: cannot be packed again
    entries = {"a.weight": (0, (64, 32), torch.bfloat16), "b.weight": (8192, (128, 64), torch.bfloat16)}
    copies = cpu_packed.find(model, entries)
    assert [(c.name, c.kind) for c in copies] == [("a", "sgl"), ("b", "onednn"), ("head", "onednn")]
    packed = copies[0].holder
    handler = copies[1].holder
    freed = cpu_packed.release(copies)
    assert freed == 64 * 32 * 2 + 128 * 64 * 2 + 256 * 64 * 2
    assert packed.untyped_storage().nbytes() == 0  # the same tensor object, its memory gone
    assert handler.freed == [1234] and int(handler.handler_tensor) == 0
    assert cpu_packed.release(copies) == 0  # a second release frees nothing twice
    assert handler.freed == [1234]
    stray_handler = model.stray.cpu_linear.__closure__[0].cell_contents
    assert stray_handler.freed == [] and int(stray_handler.handler_tensor) == 1234


@pytest.mark.parametrize("env,released", [(None, False), ({}, False), ({"COLDSNAP_VLLM_CPU_PACKED": "keep"}, False),
                                          ({"COLDSNAP_VLLM_CPU_PACKED": " Release "}, True)])
def test_a_snapshot_keeps_the_copies_unless_the_unit_asks(env, released):
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import vllm_cpu_packed_released

    assert vllm_cpu_packed_released(env) is released


def test_an_unknown_value_is_refused_naming_the_field(example_request_text):
    import json

    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import validate_request

    req = json.loads(example_request_text)
    req["launch"]["units"][0].setdefault("environment", {})["COLDSNAP_VLLM_CPU_PACKED"] = "drop"
    with pytest.raises(FormatError) as err:
        validate_request(req)
    assert "$.launch.units[0].environment.COLDSNAP_VLLM_CPU_PACKED" in str(err.value)
    assert "'keep'" in str(err.value) and "'release'" in str(err.value)
    req["launch"]["units"][0]["environment"]["COLDSNAP_VLLM_CPU_PACKED"] = "release"
    validate_request(req)
