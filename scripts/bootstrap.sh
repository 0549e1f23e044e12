#!/usr/bin/env bash
# Prepare a fresh Debian 12/13 machine for ColdSnap, idempotently:
# system tools (CRIU >= 4, dockerd, docker-registry, debootstrap) as root, then the
# project's virtualenv and the engine environment vLLM runs in. A second run finds
# everything in place and is fast.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" -eq 0 ]; then
  bash "$here/scripts/install-system.sh"
else
  echo "[bootstrap] not root: skipping system packages (run 'sudo scripts/install-system.sh' once)" >&2
fi
bash "$here/scripts/setup-venv.sh"
# The real engines the tests capture (vLLM's CPU build): cached, a few minutes the first time.
# COLDSNAP_SKIP_ENGINES=1 skips it (the vLLM tests then skip outside CI and fail in CI).
if [ "${COLDSNAP_SKIP_ENGINES:-0}" != 1 ]; then
  bash "$here/scripts/engine-env.sh" vllm >/dev/null
fi
