#!/usr/bin/env bash
# pytest and ansible-test sanity in two lanes at once (what `make test` runs after `make lint`).
#
# Lane A holds every test that drives dockerd, the local registry, network namespaces or vLLM
# (tests/integration, less the packages named below); lane B holds ansible-test sanity, then the
# integration packages that use none of those (their engines run as host processes on ports drawn at
# random), then the unit tests. pytest itself is one process on one core, and most of lane A waits on
# engines, CRIU and dockerd, so the second core does lane B meanwhile. Every test runs in exactly one
# lane: lane A is "tests/ less lane B's paths", so a new package lands in lane A unless it is added here.
#
# Each lane has its own --basetemp and pytest cache. Lane B's output is printed when both are done.
# COLDSNAP_TEST_LANES=1 runs the same tests one after the other (pytest, then sanity); PYTEST_ARGS
# goes to both pytest runs, PYTEST_ADDOPTS as pytest reads it.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 2
py=${PY:-$here/.venv/bin/python}
scratch=${COLDSNAP_TEST_TMP:-/tmp/coldsnap-tests}
read -r -a extra <<< "${PYTEST_ARGS:-}"

# In the order one run of all tests takes them: the integration packages before the unit tests.
lane_b_paths=(tests/integration/collection tests/integration/controller tests/integration/lifecycle
              tests/integration/payload tests/integration/snapshot tests/gpu tests/unit)
lane_a_ignores=()
for p in "${lane_b_paths[@]}"; do
  [ -e "$p" ] || { echo "[test-lanes] $p is gone: update lane_b_paths in $0" >&2; exit 2; }
  lane_a_ignores+=("--ignore=$p")
done

unmounted() {  # no mount point at or under $1 (removing through a bind mount would delete its source)
  ! awk '{print $5}' /proc/self/mountinfo | grep -qE "^$1(/|$)"
}

lane_pytest() {  # lane-name, pytest arguments...
  local name=$1; shift
  "$py" -m pytest -q -ra --basetemp="$scratch/$name" -o cache_dir="$here/.pytest_cache/$name" \
    ${extra[@]+"${extra[@]}"} "$@"
}

# The host runtime restores an engine under its captured pid (a pid in use refuses the restore: FAULTS.md
# 18). With the kernel's old default pid_max of 32768, the thousands of processes a full run starts wrap
# the pids within minutes, and another lane's long-lived process (a container's shim) can hold a pid a
# later restore needs. As root, raise it to 4194304 (systemd's default) for the rest of the boot.
pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 0)
if [ "$(id -u)" -eq 0 ] && [ "$pid_max" -lt 4194304 ]; then
  if echo 4194304 > /proc/sys/kernel/pid_max 2>/dev/null; then
    echo "[test-lanes] kernel.pid_max raised from $pid_max to 4194304 (restores need their captured pids free)"
  else
    echo "[test-lanes] kernel.pid_max is $pid_max and cannot be raised here: a restore may find its" \
         "captured pid taken by another test's process" >&2
  fi
fi

case "${COLDSNAP_TEST_LANES:-2}" in
  1|2) ;;
  *) echo "[test-lanes] COLDSNAP_TEST_LANES=${COLDSNAP_TEST_LANES} is not 1 or 2: 1 runs pytest then sanity," \
          "one after the other; 2 (the default) runs them in two lanes at once" >&2; exit 2 ;;
esac
if [ "${COLDSNAP_TEST_LANES:-2}" = 1 ]; then
  "$py" -m pytest -q -ra ${extra[@]+"${extra[@]}"} && bash scripts/ansible-sanity.sh
  exit
fi

mkdir -p "$scratch"
log_b="$scratch/lane-b.log"
start=$(date +%s)
(
  # Sanity first: it copies the working tree at its start, before any test has written beside it.
  bash scripts/ansible-sanity.sh
  rc_sanity=$?
  echo "[test-lanes] lane B: sanity exit $rc_sanity after $(( $(date +%s) - start )) s; pytest next"
  lane_pytest lane-b "${lane_b_paths[@]}"
  rc_pytest=$?
  echo "[test-lanes] lane B: pytest exit $rc_pytest after $(( $(date +%s) - start )) s"
  [ "$rc_pytest" -eq 0 ] && [ "$rc_sanity" -eq 0 ]
) > "$log_b" 2>&1 &
lane_b=$!
trap 'pkill -TERM -P "$lane_b"; kill "$lane_b" 2>/dev/null; exit 130' INT TERM
echo "[test-lanes] lane B (sanity, then ${lane_b_paths[*]}) runs beside this one; its output: $log_b"

lane_pytest lane-a tests "${lane_a_ignores[@]}"
rc_a=$?
echo "[test-lanes] lane A: pytest exit $rc_a after $(( $(date +%s) - start )) s"
wait "$lane_b"
rc_b=$?
echo "======================== lane B: $log_b ========================"
cat "$log_b"
echo "[test-lanes] both lanes done after $(( $(date +%s) - start )) s: lane A exit $rc_a, lane B exit $rc_b"
# A green lane's scratch goes (pytest keeps a --basetemp tree); a red one's stays for the post-mortem.
[ "$rc_a" -eq 0 ] && unmounted "$scratch/lane-a" && rm -rf "${scratch:?}/lane-a"
[ "$rc_b" -eq 0 ] && unmounted "$scratch/lane-b" && rm -rf "${scratch:?}/lane-b"
[ "$rc_a" -eq 0 ] && [ "$rc_b" -eq 0 ]
