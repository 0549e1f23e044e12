#!/usr/bin/env bash
# Galaxy's import checks on the collection as it is published: build the tarball, then run
# galaxy-importer on it (in its own virtualenv, .cache/galaxy-importer, created on first use).
# Offline once installed: ansible-test and ansible-lint are off (scripts/galaxy-importer.cfg says
# why), ansible-doc runs on every plugin. Any ERROR or WARNING line of the importer fails, not only a
# refused import (a plugin whose documentation does not parse is only logged).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${GALAXY_IMPORTER_VENV:-$here/.cache/galaxy-importer}
version=${GALAXY_IMPORTER_VERSION:-0.4.44}
python=${PYTHON:-python3}

if [ "$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("galaxy-importer"))' \
      2>/dev/null)" != "$version" ]; then
  echo "[galaxy-import] installing galaxy-importer $version into $venv" >&2
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -c "$here/scripts/constraints/galaxy-importer.txt" "galaxy-importer==$version"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

(cd "$here" && "$venv/bin/ansible-galaxy" collection build --force --output-path "$work/dist" >/dev/null)
tarball=$(ls "$work"/dist/*.tar.gz)
# The importer writes importer_result.json into the current directory; ansible-doc must be on PATH.
(cd "$work" && PATH="$venv/bin:$PATH" GALAXY_IMPORTER_CONFIG="$here/scripts/galaxy-importer.cfg" \
   "$venv/bin/python" -m galaxy_importer.main "$tarball") > "$work/log" 2>&1 || {
  grep -v '^Loading ' "$work/log" >&2
  echo "[galaxy-import] $(basename "$tarball") was refused" >&2
  exit 1
}
if grep -qE '^(ERROR|WARNING)' "$work/log"; then
  grep -v '^Loading ' "$work/log" >&2
  echo "[galaxy-import] the importer reported problems with $(basename "$tarball")" >&2
  exit 1
fi
echo "[galaxy-import] ok: $(basename "$tarball") imports ($(grep -c '^Loading ' "$work/log") items checked)" >&2
