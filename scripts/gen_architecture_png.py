"""Draw docs/architecture.png: the layers of the code and the capture / restore data flow.

Run: ``.venv/bin/python scripts/gen_architecture_png.py`` (needs matplotlib).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

OUT = Path(__file__).resolve().parents[1] / "docs" / "architecture.png"

LAYERS = [  # (label, files, colour); top calls down
    ("controller", "src/coldsnap/  (cli, runner/driver.py, receipts, timeline)", "#dbe9f6"),
    ("orchestration", "playbooks/, roles/, plugins/filter/coldsnap.py", "#dbe9f6"),
    ("modules", "plugins/modules/  (thin: argument_spec + one call)", "#e2f0d9"),
    ("units", "module_utils/units/  capture · restore · lifecycle · runtimes (host, docker)", "#e2f0d9"),
    ("artifacts", "module_utils/artifacts/  commit · store · overlay · publication · leftovers", "#e2f0d9"),
    ("payload  coord  process  capsule", "pack/cache/verifier · CSKV · CRIU, CUDA checkpoint, ports · OCI", "#fff2cc"),
    ("formats", "module_utils/formats/  request, artifact, receipt, timing, unit spec, engine control", "#fce4d6"),
    ("common", "module_utils/common/  errors, fsutil, state_layout", "#fce4d6"),
]
IN_UNIT = [
    ("activation runtime", "runtime_image/activation/\n(rank controller, keeper)", "#ead1f5"),
    ("engine integrations", "runtime_image/integrations/\nLifecycle + control server;\nreference, vllm, sglang", "#ead1f5"),
]
CAPTURE = ["validate request", "host facts, stage runtime", "coordinator", "start engine, exact reply",
           "quiesce (transport, KV)", "export pack + residual", "release weights", "CUDA checkpoint, CRIU dump",
           "capsule build", "artifact commit"]
RESTORE = ["validate request", "prepare: admission, payload,\ncapture state, pids, ports", "(prepare-only stops)",
           "evict", "coordinator", "CRIU restore, CUDA restore", "/resume: arenas, transport",
           "hydrate, zero KV", "exact reply", "receipt"]


def box(ax, xy, wh, title, body, *, colour):
    (x, y), (w, h) = xy, wh
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01,rounding_size=0.015", fc=colour,
                                ec="#555", lw=0.8))
    ax.text(x + 0.012, y + h - 0.02, title, fontsize=9, fontweight="bold", va="top")
    ax.text(x + 0.012, y + 0.012, body, fontsize=7.2, va="bottom", family="monospace")


def flow(ax, xy, title, steps, colour):
    x, y0 = xy
    ax.text(x, y0 + 0.035, title, fontsize=10, fontweight="bold")
    h = 0.062
    for i, step in enumerate(steps):
        y = y0 - i * (h + 0.018)
        ax.add_patch(FancyBboxPatch((x, y - h), 0.25, h, boxstyle="round,pad=0.004", fc=colour, ec="#666", lw=0.7))
        ax.text(x + 0.01, y - h / 2, f"{i + 1}. {step}", fontsize=7.5, va="center")
        if i:
            ax.add_patch(FancyArrowPatch((x + 0.125, y + 0.018), (x + 0.125, y), arrowstyle="-|>", mutation_scale=8,
                                         color="#444", lw=0.7))


def main() -> int:
    fig = plt.figure(figsize=(15, 9))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 1.5)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.text(0.02, 0.965, "ColdSnap: layers (each imports only those below it)", fontsize=12, fontweight="bold")
    h, gap, y = 0.072, 0.018, 0.90
    for title, body, colour in LAYERS:
        y -= h
        box(ax, (0.02, y), (0.56, h), title, body, colour=colour)
        y -= gap
    ax.text(0.61, 0.92, "inside each launch unit", fontsize=10, fontweight="bold")
    uy = 0.82
    for title, body, colour in IN_UNIT:
        box(ax, (0.61, uy), (0.29, 0.09), title, body, colour=colour)
        uy -= 0.11
    ax.text(0.61, 0.58, "they import formats, common,\npayload, process, coord\n(tests/unit/test_layers.py)",
            fontsize=7.5)
    flow(ax, (0.93, 0.90), "capture", CAPTURE, "#e2f0d9")
    flow(ax, (1.22, 0.90), "restore", RESTORE, "#dbe9f6")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
