#!/usr/bin/env bash
# Create (or refresh) the project's virtualenv: the controller installed editable with
# the reference engine and the test tools, and this checkout linked as the collection
# coldsnap.fleet so pytest, the CLI, ansible-playbook and ansible-test see one copy.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${COLDSNAP_VENV:-$here/.venv}
python=${PYTHON:-python3}
log() { printf '[setup-venv] %s\n' "$*" >&2; }

"$python" - <<'PY' || { echo "Python >= 3.11 is required (found $("$python" --version 2>&1))" >&2; exit 2; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

[ -x "$venv/bin/python" ] || { log "creating $venv"; "$python" -m venv "$venv"; }
stamp="$venv/.coldsnap-deps"
# The releases CI last ran green with (scripts/freeze-constraints.sh writes them).
constraints="$here/scripts/constraints/venv.txt"
want=$(cat "$here/pyproject.toml" "$0" "$constraints" | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing the project and its test tools (first run takes a few minutes)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # torch 2.13.0 is the CPU build these machines carry; a newer range would pull a CUDA build.
  "$venv/bin/python" -m pip install -q -c "$constraints" "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -c "$constraints" -e "${here}[engine,timeline,test]"
  echo "$want" > "$stamp"
else
  log "dependencies up to date"
fi

# The collection: <venv>/collections/ansible_collections/coldsnap/fleet -> this checkout.
coll="$venv/collections/ansible_collections/coldsnap"
mkdir -p "$coll"
if [ "$(readlink "$coll/fleet" 2>/dev/null)" != "$here" ]; then
  rm -rf "$coll/fleet"
  ln -s "$here" "$coll/fleet"
fi
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$venv/collections" > "$site/coldsnap-collections.pth"

# The native fill (native/fill.c): GPU hydration at ~0.9 of the pinned host->device rate instead of
# ~0.6 (BENCHMARKS.md). Optional: without a C compiler hydration takes the Python path.
if lib=$("$venv/bin/python" -c '
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import native_fill
print(native_fill.ensure_built())' 2>&1); then
  log "native fill: $lib"
else
  log "native fill not built (GPU hydration will use the Python path): ${lib##*$'\n'}"
fi
log "ready: $venv (activate with '. $venv/bin/activate')"
