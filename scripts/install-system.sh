#!/usr/bin/env bash
# Install the host-level tools ColdSnap needs on a Debian 12 or 13 machine, as root:
# CRIU >= 4 (package on Debian 13, built from Debian's trixie source on Debian 12),
# Docker's engine from Debian's docker.io (dockerd started when not running),
# Debian's docker-registry and debootstrap (local registry, base images).
# Idempotent: a second run finds everything in place and returns at once.
set -euo pipefail

CRIU_VERSION=4.1.1
CACHE_DIR=${COLDSNAP_CACHE_DIR:-/var/cache/coldsnap}
here=$(cd "$(dirname "$0")/.." && pwd)
log() { printf '[install-system] %s\n' "$*" >&2; }
# The patched CRIU goes to /usr/local/sbin: make sure this script (and its probes) find it.
export PATH="/usr/local/sbin${PATH:+:$PATH}:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

if [ "$(id -u)" -ne 0 ]; then
  echo "install-system.sh must run as root (it installs Debian packages and starts dockerd)" >&2
  exit 2
fi
. /etc/os-release
case "${VERSION_CODENAME:-}" in
  bookworm|trixie|forky|sid) ;;
  *) log "warning: untested distribution '${PRETTY_NAME:-unknown}'; continuing as Debian" ;;
esac

need_apt=()
# Debian 13 split the docker client out of docker.io (a Recommends we do not install).
docker_cli=()
[ "${VERSION_CODENAME:-}" = bookworm ] || docker_cli=(docker-cli)
# The shellcheck package: without it the ansible-test sanity test "shellcheck" is skipped.
# g++ and python3-dev: TorchInductor's CPU code generation (the reference engine's --compile
# compiles C++ that includes Python.h).
for pkg in docker.io docker-registry debootstrap iproute2 procps xz-utils ca-certificates openssh-server openssh-client util-linux \
           python3 python3-venv python3-dev g++ \
           shellcheck "${docker_cli[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || need_apt+=("$pkg")
done

apt_updated=0
apt_update() { [ "$apt_updated" = 1 ] || { apt-get update -qq; apt_updated=1; }; }

if [ "${#need_apt[@]}" -gt 0 ]; then
  log "installing ${need_apt[*]}"
  apt_update
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# ---------------------------------------------------------------- CRIU >= 4
# CRIU 4.1.1 (Debian 13's package and Debian 12's trixie source) cannot dump a process
# that holds a TCP socket on Linux >= 6.16 (getsockopt SO_PASSCRED/SO_PASSSEC now fails
# on inet sockets). We build 4.1.1 from Debian's source with our patches under
# scripts/criu/ whenever the installed CRIU fails that probe (the second patch gives a restored
# process its huge-page advice before its memory is read back: faster restores where THP is
# "madvise"; the third leaves all-zero pages out of a dump: smaller images; a distribution CRIU
# that passes the probe dumps and restores correctly, only larger and slower).
criu_major() { "$1" --version 2>/dev/null | sed -n 's/^Version: \([0-9]*\).*/\1/p'; }
patch_id() { cat "$here"/scripts/criu/*.patch | sha256sum | cut -c1-12; }
# Our build says which patches it carries: `criu --version` prints "GitID: coldsnap-<patch id>".
criu_gitid() { "$1" --version 2>/dev/null | sed -n 's/^GitID: //p'; }

mkdir -p "$CACHE_DIR"
criu_from_cache=0
PROBE_LOG="$CACHE_DIR/criu-probe.log"
: >"$PROBE_LOG"

criu_socket_probe() {
  # Dump (leave running) a process that listens on TCP: the case inference servers hit.
  # It runs as ColdSnap runs an engine: stdio on /dev/null (this script's own stdio may be a
  # socket to a job runner, which CRIU rightly refuses to dump as an external unix socket)
  # and in a session of its own (a job runner may start us in a session whose leader is
  # outside this pid namespace, which CRIU cannot dump either).
  # A shell with job control starts it as a process-group leader, which setsid() refuses: it forks
  # first then, and says which pid listens.
  local bin=$1 dir pid="" rc=0
  dir=$(mktemp -d)
  python3 -c 'import os,socket,sys,time
if os.getpgid(0) == os.getpid() and os.fork():
    os._exit(0)
os.setsid(); s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen()
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid())); os.rename(sys.argv[1] + ".tmp", sys.argv[1]); time.sleep(60)' \
    "$dir/pid" </dev/null >/dev/null 2>&1 &
  for _ in $(seq 1 50); do [ -s "$dir/pid" ] && break; sleep 0.1; done
  pid=$(cat "$dir/pid" 2>/dev/null || true)
  if [ -z "$pid" ]; then
    echo "== the probe's listener did not start" >>"$PROBE_LOG"
    rm -rf "$dir"
    return 1
  fi
  "$bin" dump -t "$pid" -D "$dir" --leave-running -o dump.log </dev/null >/dev/null 2>&1 || rc=$?
  kill "$pid" 2>/dev/null || true
  wait 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    { echo "== criu dump of a TCP listener failed (rc $rc) with $bin"; grep -E 'Error|Warn' "$dir/dump.log" 2>/dev/null | tail -20; } >>"$PROBE_LOG"
  fi
  rm -rf "$dir"
  return "$rc"
}

have_good_criu() {
  local bin out
  bin=$(command -v criu 2>/dev/null) || { echo "== no criu on PATH" >>"$PROBE_LOG"; return 1; }
  if ! [ "$(criu_major "$bin")" -ge 4 ] 2>/dev/null; then
    echo "== $bin is not CRIU >= 4: $("$bin" --version 2>&1 | head -2 | tr '\n' ' ')" >>"$PROBE_LOG"
    return 1
  fi
  if ! out=$("$bin" check 2>&1 </dev/null); then
    { echo "== $bin check failed"; printf '%s\n' "$out" | tail -20; } >>"$PROBE_LOG"
    return 1
  fi
  criu_socket_probe "$bin"
}

debian_uri() {
  # The URI of this machine's own Debian archive, read from its apt sources.
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1=="deb" && $0 !~ /security/ {for (i=2;i<=NF;i++) if ($i ~ /^(http|https|ftp|file):/) {print $i; exit}}' /etc/apt/sources.list)
  fi
  [ -n "$uri" ] || { echo "cannot find the Debian archive URI in /etc/apt/sources*" >&2; return 1; }
  printf '%s\n' "$uri"
}

build_criu_from_trixie_source() {
  # $1 = "fresh": ignore a cached build (one that failed the probes on this machine).
  local prefix
  prefix="$CACHE_DIR/criu-$CRIU_VERSION-$(patch_id)"
  # The build dependencies also bring the libraries a cached binary links against
  # (the cache may outlive the machine's packages).
  apt_update
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev \
    protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libaio-dev \
    libbsd-dev libgnutls28-dev libnftables-dev uuid-dev dpkg-dev patch >/dev/null
  if [ "${1:-}" != fresh ] && [ -x "$prefix/criu" ] && [ "$(criu_gitid "$prefix/criu")" = "coldsnap-$(patch_id)" ]; then
    log "using cached CRIU build $prefix/criu"
    criu_from_cache=1
  else
    log "building CRIU $CRIU_VERSION from Debian's trixie source with ColdSnap's patches"
    local uri list=/etc/apt/sources.list.d/coldsnap-trixie-src.list
    uri=$(debian_uri)
    echo "deb-src $uri trixie main" > "$list"
    apt-get update -qq -o Dir::Etc::sourcelist="$list" -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0
    mkdir -p "$CACHE_DIR"
    local work
    work=$(mktemp -d "$CACHE_DIR/criu-build.XXXXXX")
    (cd "$work" && apt-get source -qq --tar-only "criu/trixie" >/dev/null 2>&1)
    tar -C "$work" -xf "$work"/criu_"$CRIU_VERSION".orig.tar.*
    for p in "$here"/scripts/criu/*.patch; do
      patch -s -d "$work/criu-$CRIU_VERSION" -p1 < "$p"
    done
    make -s -C "$work/criu-$CRIU_VERSION" -j"$(nproc)" GITID="coldsnap-$(patch_id)" criu >/dev/null 2>&1 \
      || { make -C "$work/criu-$CRIU_VERSION" GITID="coldsnap-$(patch_id)" criu 2>&1 | tail -30 >&2; exit 1; }
    rm -rf "$prefix.tmp"; mkdir -p "$prefix.tmp"
    cp "$work/criu-$CRIU_VERSION/criu/criu" "$prefix.tmp/criu"
    rm -rf "$prefix"; mv "$prefix.tmp" "$prefix"
    rm -rf "$work"
  fi
  install -m 0755 "$prefix/criu" /usr/local/sbin/criu
}

stale_coldsnap_criu() {
  # The criu on PATH is ColdSnap's own build, but from another set of patches than scripts/criu/
  # has now (a machine bootstrapped by an older checkout): build the current one.
  local bin
  bin=$(command -v criu 2>/dev/null) || return 1
  [ "$(readlink -f "$bin")" = /usr/local/sbin/criu ] || return 1
  [ "$(criu_gitid "$bin")" != "coldsnap-$(patch_id)" ]
}

if have_good_criu && ! stale_coldsnap_criu; then
  log "CRIU $(criu --version | sed -n 's/^Version: //p') already installed and dumps TCP sockets"
elif stale_coldsnap_criu; then
  log "the installed CRIU is ColdSnap's build with other patches than scripts/criu/ has"
  build_criu_from_trixie_source; hash -r
  have_good_criu || {
    echo "the rebuilt CRIU failed its probes ($PROBE_LOG):" >&2
    cat "$PROBE_LOG" >&2
    exit 1
  }
else
  # The distribution's runtime libraries (and its criu on Debian 13) come from the package
  # when it is new enough; the patched build then takes precedence in /usr/local/sbin.
  if apt-cache policy criu 2>/dev/null | awk '/Candidate:/ {print $2}' | grep -q '^[4-9]'; then
    apt_update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends criu >/dev/null
    hash -r
  fi
  have_good_criu || { build_criu_from_trixie_source; hash -r; }
  if [ "$criu_from_cache" = 1 ] && ! have_good_criu; then
    log "the cached CRIU build failed the probes; rebuilding it"
    build_criu_from_trixie_source fresh; hash -r
  fi
  have_good_criu || {
    echo "CRIU >= 4 that can dump TCP sockets could not be installed; what the probes saw ($PROBE_LOG):" >&2
    cat "$PROBE_LOG" >&2
    exit 1
  }
fi

# ---------------------------------------------------------------- dockerd
if docker info >/dev/null 2>&1; then
  log "dockerd is running"
else
  log "starting dockerd"
  mkdir -p /var/log/coldsnap
  # A dockerd killed without its shutdown (a machine or pid namespace torn down, /run kept)
  # leaves pid files behind: a new dockerd refuses to start while its own exists, and waits
  # forever on a managed containerd whose recorded pid now belongs to another process.
  if ! pgrep -x dockerd >/dev/null; then
    [ -f /var/run/docker.pid ] && { log "removing the stale /var/run/docker.pid"; rm -f /var/run/docker.pid; }
    cpid_file=/var/run/docker/containerd/containerd.pid
    if [ -f "$cpid_file" ] && [ "$(cat "/proc/$(cat "$cpid_file")/comm" 2>/dev/null)" != containerd ]; then
      log "removing the stale $cpid_file"
      rm -f "$cpid_file"
    fi
  fi
  nohup dockerd >/var/log/coldsnap/dockerd.log 2>&1 &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start; see /var/log/coldsnap/dockerd.log" >&2; tail -20 /var/log/coldsnap/dockerd.log >&2; exit 1; }
fi
log "system ready: $(criu --version | head -1), docker $(docker version --format '{{.Server.Version}}')"
