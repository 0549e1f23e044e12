"""The environment digest that pins a runtime-``host`` unit's userspace.

A restored process keeps running the code it had in memory, but it still maps
shared libraries and may import more: the destination's Python environment must
be the captured one. The digest covers the interpreter (version, implementation,
architecture), every installed distribution (name, version and its RECORD file,
which lists each installed file's hash) and the ColdSnap code that runs inside
units (engine integrations and the collection's module_utils).

Run as ``python -m ansible_collections.coldsnap.fleet.plugins.module_utils.units.environment``
with the unit's interpreter to print it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec


def _tree(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        if "__pycache__" in f.parts:
            continue
        rel = f.relative_to(root).as_posix().encode()
        h.update(len(rel).to_bytes(4, "big") + rel + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def describe() -> dict:
    """What the digest covers, for this interpreter."""
    from importlib import metadata

    dists = []
    for d in metadata.distributions():
        name = (d.metadata["Name"] or "").lower()
        if not name:
            continue
        record = d.read_text("RECORD") or ""
        dists.append([name, d.version, hashlib.sha256(record.encode()).hexdigest() if record else "-"])
    dists.sort()
    code = {}
    here = Path(__file__).resolve().parents[1]  # plugins/module_utils
    code["module_utils"] = _tree(here)
    try:
        import coldsnap_engines

        code["engines"] = _tree(Path(next(iter(coldsnap_engines.__path__))))
    except ImportError:
        code["engines"] = None
    return {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "machine": platform.machine()},
        "distributions": dists,
        "code": code,
    }


def compute() -> str:
    """``sha256:<hex>`` of :func:`describe` (canonical JSON)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256

    return canonical_sha256(describe())


# How long another interpreter may take to answer (it hashes every installed distribution's RECORD).
OF_PYTHON_TIMEOUT_S = 120
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_DESCRIPTION_KEYS = {"python": dict, "distributions": list, "code": dict}
_NOT_COLDSNAP_FIX = ("give the interpreter of an environment with ColdSnap's runtime installed "
                     "(scripts/setup-venv.sh, scripts/engine-env.sh)")


def of_python(python: str, *, describe_it: bool = False) -> str:
    """The environment digest (or, with ``describe_it``, the description JSON) of another interpreter.

    Its answer is checked: a ``sha256:<64 hex>`` digest, or a JSON object with what :func:`describe` gives;
    anything else (a program that is no Python with ColdSnap, one that hangs) is a ColdSnapError."""
    if not python:
        raise ColdSnapError("the unit's Python is empty", fix="give the path of the unit environment's interpreter")
    try:
        # -P: never put the current directory first on sys.path (it must not change the answer).
        r = subprocess.run([python, "-P", "-m", __name__, *(["--describe"] if describe_it else [])],
                           check=False, capture_output=True, text=True, errors="replace",
                           timeout=OF_PYTHON_TIMEOUT_S, cwd="/")
    except OSError as exc:
        raise AdmissionError(f"cannot run the unit's Python {python}: {exc.strerror}",
                             fix="install the unit's engine environment on this host (scripts/engine-env.sh for "
                                 "vLLM, scripts/setup-venv.sh for the reference engine) at the captured path, or "
                                 "set coldsnap_python to the runtime environment's interpreter") from None
    except subprocess.TimeoutExpired:
        raise ColdSnapError(f"{python} did not compute its environment digest within {OF_PYTHON_TIMEOUT_S} s "
                            "(it was stopped)", fix=_NOT_COLDSNAP_FIX + "; if it is that interpreter, find out "
                            "what it waits for (a hung file system, a lock)") from None
    if r.returncode != 0:
        why = r.stderr.strip()[-300:] or f"it exited with status {r.returncode} and said nothing"
        raise ColdSnapError(f"{python} cannot compute its environment digest: {why}", fix=_NOT_COLDSNAP_FIX)
    out = r.stdout.strip()
    if describe_it:
        try:
            doc = json.loads(out)
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or any(not isinstance(doc.get(k), t) for k, t in _DESCRIPTION_KEYS.items()):
            raise ColdSnapError(f"{python} answered no environment description: {_excerpt(out)}",
                                fix=_NOT_COLDSNAP_FIX)
    elif not _DIGEST.fullmatch(out):
        raise ColdSnapError(f"{python} answered no environment digest (sha256:<64 hex>): {_excerpt(out)}",
                            fix=_NOT_COLDSNAP_FIX)
    return out


def _excerpt(text: str) -> str:
    if not text:
        return "it printed nothing"
    return f"it printed {text[:200]!r}" + (f"... ({len(text)} characters)" if len(text) > 200 else "")


def _shebang_python(script: Path) -> str | None:
    """The interpreter a console script's ``#!`` line names, when it is an absolute Python."""
    try:
        with open(script, "rb") as f:
            line = f.readline(512)
    except OSError:
        return None
    if not line.startswith(b"#!"):
        return None
    words = line[2:].decode(errors="replace").split()
    return words[0] if words and words[0].startswith("/") and Path(words[0]).name.startswith("python") else None


def unit_python(command: list[str], default: str, unit_environment: dict | None = None) -> str:
    """The interpreter a unit's engine runs.

    The command's first word is found as the engine will find it: a bare name on the engine's search
    path (the unit's ``PATH``, else the runtime interpreter's directory and the system's), a relative
    path from ``/``. A Python is itself the answer; a console script (``/venv/bin/vllm``) runs the
    ``python`` beside it, else the one its ``#!`` line names; anything else, ``default``. A command
    that is not there (not found on the search path, or a path to nothing) is refused here, before
    anything of the running workload is touched."""
    if not command:
        return default
    word = command[0]
    if "/" in word:
        first = Path("/", word)
    else:
        search = ec.engine_search_path(default, unit_environment)
        found = shutil.which(word, path=search)
        if found is None:
            raise AdmissionError(
                f"the unit's command {word!r} is not installed on this host (searched {search})",
                fix="install the unit's engine environment here (scripts/engine-env.sh for vLLM, "
                    "scripts/setup-venv.sh for the reference engine), or start launch.units[].command with the "
                    "absolute path of the engine environment's program")
        first = Path(found)
    if first.name.startswith("python"):
        return str(first)  # one that is not there is named when it is asked for its digest
    if not first.exists():  # e.g. /opt/venv/bin/vllm once the environment was removed (or a link to nothing)
        raise AdmissionError(
            f"the unit's command {word!r} is not on this host ({first} does not exist)",
            fix="install the unit's engine environment here at the captured path (scripts/engine-env.sh for vLLM, "
                "scripts/setup-venv.sh for the reference engine)")
    sibling = first.with_name("python")
    if sibling.exists():
        return str(sibling)
    return _shebang_python(first) or default


def require(expected: str, python: str, *, unit: str, host: str) -> None:
    """Refuse a host whose runtime environment differs from the one the request/artifact pins."""
    got = of_python(python)
    if got != expected:
        here = json.loads(of_python(python, describe_it=True))
        code = here["code"]
        summary = (f"python {here['python'].get('version')}, {len(here['distributions'])} distributions, "
                   f"code module_utils {str(code.get('module_utils'))[:12]} engines {str(code.get('engines'))[:12]}")
        raise AdmissionError(
            f"unit {unit} on {host}: runtime environment {got} (of {python}) differs from the pinned {expected} "
            f"(this host has {summary})",
            fix="install the exact captured environment on the host (same Python, packages and ColdSnap code; "
                "`coldsnap environment-digest --describe` lists what is covered), or recapture")


if __name__ == "__main__":
    sys.stdout.write((compute() if "--describe" not in sys.argv else json.dumps(describe(), indent=2)) + "\n")
