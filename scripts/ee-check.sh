#!/usr/bin/env bash
# Check the execution-environment files offline, with ansible-builder in its own virtualenv
# (.cache/ansible-builder, created on first use):
#  - `ansible-builder create` writes the build context of docs/awx/execution-environment.yml
#    (it validates the definition; no container runtime is involved);
#  - `ansible-builder introspect` reads this checkout as an installed collection, as a build does,
#    and must find every line of requirements.txt and bindep.txt through meta/execution-environment.yml.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${ANSIBLE_BUILDER_VENV:-$here/.cache/ansible-builder}
version=${ANSIBLE_BUILDER_VERSION:-3.2.0}
python=${PYTHON:-python3}

if [ "$("$venv/bin/ansible-builder" --version 2>/dev/null)" != "$version" ]; then
  echo "[ee-check] installing ansible-builder $version into $venv" >&2
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -c "$here/scripts/constraints/ansible-builder.txt" "ansible-builder==$version"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$venv/bin/ansible-builder" create -f "$here/docs/awx/execution-environment.yml" --context "$work/context" >/dev/null
grep -q "name: coldsnap.fleet" "$work/context/_build/requirements.yml" \
  || { echo "[ee-check] the execution environment does not install coldsnap.fleet" >&2; exit 1; }

# The collection's metadata as ansible-builder reads it (without the file it would guess the same
# names, so check that the file is there and names them).
"$venv/bin/python" - "$here" <<'PY'
import sys
from ansible_builder._target_scripts.introspect import CollectionDefinition

here = sys.argv[1]
meta = CollectionDefinition(here)
for entry, name in (("python", "requirements.txt"), ("system", "bindep.txt")):
    got = meta.get_dependency(entry)
    if got != name:
        sys.exit(f"[ee-check] meta/execution-environment.yml: dependencies.{entry} is {got!r}, expected {name!r}")
PY
[ -f "$here/meta/execution-environment.yml" ] || { echo "[ee-check] meta/execution-environment.yml is missing" >&2; exit 1; }

mkdir -p "$work/collections/ansible_collections/coldsnap"
ln -s "$here" "$work/collections/ansible_collections/coldsnap/fleet"
"$venv/bin/ansible-builder" introspect "$work/collections" > "$work/introspect.yml"
missing=0
for f in requirements.txt bindep.txt; do
  while IFS= read -r line; do
    line=${line%%#*}
    line=${line%"${line##*[![:space:]]}"}  # trailing blanks
    [ -n "$line" ] || continue
    if ! grep -qF -- "'$line  # from collection coldsnap.fleet'" "$work/introspect.yml"; then
      echo "[ee-check] $f: '$line' does not reach the execution environment" >&2
      missing=1
    fi
  done < "$here/$f"
done
[ "$missing" = 0 ] || { cat "$work/introspect.yml" >&2; exit 1; }
echo "[ee-check] ok: docs/awx/execution-environment.yml builds a context; meta/execution-environment.yml brings requirements.txt and bindep.txt" >&2
