#!/usr/bin/env bash
# The main job on a fresh machine: install what is needed, then capture the reference
# engine on localhost, restore it, validate the reply, print the receipt and the timings.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
bash "$here/scripts/bootstrap.sh"
exec "$here/.venv/bin/coldsnap" demo "$@"
