#!/usr/bin/env bash
# Report the free space of the file systems a test run writes to (temporary directory, Docker's
# data root, ColdSnap's state and caches); warn, naming what to clean, when one has less than
# the given number of GiB. Usage: scripts/disk-check.sh [MIN_GIB]
set -euo pipefail
min_gib=${1:-20}
tmp=${TMPDIR:-/tmp}
short=0
for dir in "$tmp" /var/lib/docker /var/lib/coldsnap /var/cache/coldsnap; do
  probe=$dir
  while [ ! -e "$probe" ]; do probe=$(dirname "$probe"); done
  avail_kib=$(df -Pk "$probe" | awk 'NR == 2 {print $4}')
  avail_gib=$((avail_kib / 1024 / 1024))
  echo "[disk] $dir: ${avail_gib} GiB free"
  if [ "$avail_gib" -lt "$min_gib" ]; then
    short=1
  fi
done
if [ "$short" = 1 ]; then
  echo "[disk] WARNING: less than ${min_gib} GiB free; a full test run may fail writing captures." >&2
  echo "[disk] Old runs' trees are under $tmp/pytest-of-$(id -un); 'docker image prune' drops unused images." >&2
fi
