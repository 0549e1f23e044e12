"""Entry-point metadata for images that carry ``coldsnap_engines`` as plain files.

vLLM and SGLang discover plugins through ``importlib.metadata`` entry points, so a
runtime image that copies the package onto ``sys.path`` (``/opt/coldsnap/site``)
must also carry a ``*.dist-info`` naming them. ``write_dist_info`` writes that
minimal record; the groups and values equal ``pyproject.toml``'s (a unit test
keeps them in step).
"""

from __future__ import annotations

from pathlib import Path

DIST_NAME = "coldsnap_engines"
ENTRY_POINTS: dict[str, dict[str, str]] = {
    "vllm.general_plugins": {"coldsnap": "coldsnap_engines.vllm.plugin:register"},
    "vllm.endpoint_plugins": {"coldsnap": "coldsnap_engines.vllm.endpoint:make_plugin"},
    "sglang.srt.plugins": {"coldsnap": "coldsnap_engines.sglang.plugin:register"},
}


def entry_points_txt() -> str:
    out = []
    for group, items in ENTRY_POINTS.items():
        out.append(f"[{group}]")
        out += [f"{name} = {value}" for name, value in items.items()]
        out.append("")
    return "\n".join(out)


def write_dist_info(site_dir: Path, version: str) -> Path:
    """Write ``<site_dir>/coldsnap_engines-<version>.dist-info`` (METADATA + entry_points.txt)."""
    d = Path(site_dir) / f"{DIST_NAME}-{version}.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {version}\n")
    (d / "entry_points.txt").write_text(entry_points_txt())
    (d / "top_level.txt").write_text(f"{DIST_NAME}\n")
    return d
