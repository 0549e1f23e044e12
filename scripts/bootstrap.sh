#!/usr/bin/env bash
# Prepare a fresh Debian 12/13 machine for ColdSnap, idempotently:
# system tools (CRIU >= 4, dockerd, docker-registry, debootstrap) as root, then the
# project's virtualenv. A second run finds everything in place and is fast.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
if [ "$(id -u)" -eq 0 ]; then
  bash "$here/scripts/install-system.sh"
else
  echo "[bootstrap] not root: skipping system packages (run 'sudo scripts/install-system.sh' once)" >&2
fi
bash "$here/scripts/setup-venv.sh"
