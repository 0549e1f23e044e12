"""On a GPU, the acceptance's log-probabilities notice one wrong 4 KiB extent of one weight (the
lowest bit of each value flipped, as a misplaced or torn hydration copy would leave it), and come
back bit for bit when the extent is put right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu]

REPO = Path(__file__).resolve().parents[2]


def test_one_wrong_extent_changes_the_logprobs_digest_on_the_gpu(tmp_path):
    import torch
    from coldsnap_engines.reference.config import PRESETS
    from coldsnap_engines.reference.engine import Engine
    from coldsnap_engines.reference.transport import Transport
    from coldsnap_engines.reference.weights import make_model

    sys.path.insert(0, str(REPO / "runtime_image" / "activation"))
    from coldsnap_activation import probes

    make_model(tmp_path / "model", PRESETS["small"], model_id="coldsnap/reference-small")
    engine = Engine(tmp_path / "model", device="cuda:0", rank=0, world=1, served_model_name="small")
    engine.start(Transport(rank=0, world=1, device="cuda:0", endpoint_file=None, scope="local"))

    def run() -> tuple[str, str]:
        tokens: list[dict] = []

        def emit(piece, lp):
            tokens.append({"token": piece, "logprob": lp.logprob, "top": sorted([t, v] for t, v in lp.top)})
            return False

        text = engine.generate("ColdSnap says:", 8, emit=emit, logprobs=5)
        return text, probes.logprobs_digest(tokens)

    before = run()
    assert run() == before, "the same request twice must give the same values on the same GPU"
    name, weight = max(engine.loaded.weights.items(), key=lambda nt: nt[1].numel())
    as_int = {2: torch.int16, 4: torch.int32}[weight.element_size()]
    extent = weight.view(-1)[: 4096 // weight.element_size()].view(as_int)
    extent ^= 1
    torch.cuda.synchronize()
    after = run()
    print(f"{name}: reply {'unchanged' if after[0] == before[0] else 'changed'} by the wrong extent")
    assert after[1] != before[1], name
    extent ^= 1
    torch.cuda.synchronize()
    assert run() == before
