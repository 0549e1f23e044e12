#!/usr/bin/env bash
# Build (once, cached) the environment in which ColdSnap's vLLM and SGLang integrations are
# tested against the REAL engine sources on a CPU machine:
#   <root>/site        pinned pure-Python deps (scripts/engine-contract-requirements.txt)
#   <root>/vllm        vllm==$VLLM_VERSION unpacked from its wheel, Python files only
#   <root>/sglang      sglang==$SGLANG_VERSION unpacked from its wheel, Python files only
#   <root>/tms         torch_memory_saver==$TMS_VERSION unpacked from its wheel
# The project's own torch (CPU) is used; nothing is installed into any virtualenv.
# Prints the root. Usage: scripts/engine-contract-env.sh [--print-root]
# Env: COLDSNAP_ENGINE_ENV (root, default ~/.cache/coldsnap/engine-contract/<key>), PYTHON (pip's python).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.33.0
SGLANG_VERSION=0.5.23
TMS_VERSION=0.0.10
PY=${PYTHON:-.venv/bin/python}
REQ=scripts/engine-contract-requirements.txt
key=$(cat "$0" "$REQ" | sha256sum | cut -c1-16)
root=${COLDSNAP_ENGINE_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/coldsnap/engine-contract/$key}
if [[ "${1:-}" == "--print-root" ]]; then echo "$root"; exit 0; fi
if [[ -f "$root/READY" ]]; then echo "$root"; exit 0; fi

pip_quiet() {  # the machine's pip config lists optional local indexes; their absence is noise
  "$PY" -m pip "$@" 2> >(grep -v "^WARNING: Location .* is ignored" >&2)
}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/coldsnap-engine-env.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/dl" "$tmp/root"
echo "engine-contract-env: downloading vllm==$VLLM_VERSION sglang==$SGLANG_VERSION torch_memory_saver==$TMS_VERSION" >&2
pip_quiet download --quiet --no-deps --only-binary=:all: -d "$tmp/dl" \
  "vllm==$VLLM_VERSION" "sglang==$SGLANG_VERSION" "torch_memory_saver==$TMS_VERSION"
echo "engine-contract-env: installing pinned dependencies into $root/site" >&2
pip_quiet install --quiet --no-deps --only-binary=:all: --target "$tmp/root/site" -r "$REQ"
unpack() {  # wheel, destination, members...
  local whl=$1 dest=$2; shift 2
  mkdir -p "$dest"
  "$PY" - "$whl" "$dest" "$@" <<'PYEOF'
import fnmatch, sys, zipfile
whl, dest, pats = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if any(fnmatch.fnmatch(n, p) for p in pats) and not n.endswith(".so")]
    for n in names:
        if n.startswith("/") or ".." in n.split("/"):
            raise SystemExit(f"unsafe member {n!r} in {whl}")
    z.extractall(dest, members=names)
print(f"{whl}: {len(names)} files", file=sys.stderr)
PYEOF
}
unpack "$tmp"/dl/vllm-"$VLLM_VERSION"-*.whl "$tmp/root/vllm" 'vllm/*.py' 'vllm/*.json' 'vllm-*.dist-info/*'
unpack "$tmp"/dl/sglang-"$SGLANG_VERSION"-*.whl "$tmp/root/sglang" 'sglang/*.py' 'sglang-*.dist-info/*'
unpack "$tmp"/dl/torch_memory_saver-"$TMS_VERSION"-*.whl "$tmp/root/tms" 'torch_memory_saver/*.py' 'torch_memory_saver-*.dist-info/*'
printf 'vllm==%s\nsglang==%s\ntorch_memory_saver==%s\n' "$VLLM_VERSION" "$SGLANG_VERSION" "$TMS_VERSION" > "$tmp/root/VERSIONS"
touch "$tmp/root/READY"
mkdir -p "$(dirname "$root")"
rm -rf "$root"
mv "$tmp/root" "$root"
echo "$root"
