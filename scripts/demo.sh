#!/usr/bin/env bash
# The main job on a fresh machine: install what is needed, then capture the reference
# engine on localhost, restore it, validate the reply, print the receipt and the timings.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
# The main job runs the reference engine: no vLLM environment needed (the tests build it).
COLDSNAP_SKIP_ENGINES=${COLDSNAP_SKIP_ENGINES:-1} bash "$here/scripts/bootstrap.sh"
exec "$here/.venv/bin/coldsnap" demo "$@"
