"""The library's layers (docs/architecture.md, "Rules of the layers"): who may import whom,
imports inside functions included, and no import cycle between its files."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "plugins" / "module_utils"
PREFIX = "ansible_collections.coldsnap.fleet.plugins.module_utils"

# package -> packages it may import (besides itself)
ALLOWED = {
    "common": set(),
    "formats": {"common"},
    "transfer": {"common"},
    "payload": {"common", "formats", "transfer"},
    "coord": {"common", "formats"},
    "process": {"common", "formats"},
    "capsule": {"common", "formats"},
    "artifacts": {"common", "formats", "payload", "capsule"},
    "units": {"common", "formats", "payload", "coord", "process", "capsule"},
}
# Outside the library: which of its packages each consumer may import.
CONSUMERS = {
    REPO / "runtime_image" / "activation": {"common", "formats", "payload", "coord", "process"},
    REPO / "runtime_image" / "integrations": {"common", "formats", "payload", "coord"},
}


def _imports(path: Path) -> set[str]:
    """Every library module ``path`` imports (dotted, relative to module_utils), anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith(PREFIX + "."):
                out.add(name[len(PREFIX) + 1:])
    return out


def _module_of(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _library() -> dict[str, Path]:
    mods = {}
    for f in LIB.rglob("*.py"):
        parts = list(f.relative_to(LIB).with_suffix("").parts)
        if parts[-1] == "__init__":
            continue
        mods[".".join(parts)] = f
    return mods


def test_every_library_file_belongs_to_a_known_layer():
    assert {m.split(".")[0] for m in _library()} <= set(ALLOWED)


def test_packages_import_only_the_layers_below_them():
    mods = _library()
    wrong = []
    for mod, path in mods.items():
        pkg = mod.split(".")[0]
        for target in _imports(path):
            hit = _module_of(target, set(mods))
            if hit is None:
                continue
            tpkg = hit.split(".")[0]
            if tpkg != pkg and tpkg not in ALLOWED[pkg]:
                wrong.append(f"{mod} imports {hit}")
    assert not wrong, "layer violations:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle_between_library_files():
    mods = _library()
    edges = {m: {h for t in _imports(p) if (h := _module_of(t, set(mods))) and h != m} for m, p in mods.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycle.extend([*path[path.index(n):], n] if n in path else [m, n])
                return True
            if n not in state and visit(n, [*path, n]):
                return True
        state[m] = 2
        return False

    for m in sorted(mods):
        if m not in state and visit(m, [m]):
            break
    assert not cycle, " -> ".join(cycle)


def test_runtime_code_imports_only_what_ships_to_units():
    mods = set(_library())
    wrong = []
    for root, allowed in CONSUMERS.items():
        for path in root.rglob("*.py"):
            for target in _imports(path):
                hit = _module_of(target, mods)
                if hit and hit.split(".")[0] not in allowed:
                    wrong.append(f"{path.relative_to(REPO)} imports {hit}")
    assert not wrong, "\n".join(sorted(wrong))
