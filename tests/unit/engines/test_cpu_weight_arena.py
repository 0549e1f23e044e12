"""The CPU weight arena (vLLM's CPU integration, without vLLM): parameters of a page or more start on a
page boundary, the table offers the arena to the mapping sink, release gives anonymous memory back."""

from __future__ import annotations

import mmap

import pytest

torch = pytest.importorskip("torch")


def test_relocated_parameters_page_align_and_offer_a_private_mapping():
    from coldsnap_engines.vllm.cpu import ARENA_ID, relocate_parameters

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 1024))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wa = relocate_parameters(model)
    arena = wa.arena
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name])
        off = p.data_ptr() - arena.address
        assert 0 <= off < arena.size
        if p.numel() * p.element_size() >= mmap.PAGESIZE:
            assert off % mmap.PAGESIZE == 0, name
    [alloc] = wa.table().allocations
    assert alloc.id == ARENA_ID and alloc.private_mapping and alloc.address % mmap.PAGESIZE == 0
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.hydrate import MappingSink

    assert isinstance(wa.table().sink(), MappingSink)
    weight = model[0].weight
    assert wa.release() == arena.size
    assert arena.current_address() == alloc.address
    assert float(weight.detach().abs().sum()) == 0.0  # anonymous zeros where the weights were, same tensors
