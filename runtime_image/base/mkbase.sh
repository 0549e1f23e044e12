#!/usr/bin/env bash
# Build the ColdSnap base root filesystem with debootstrap and write it as one tar.
#
#   mkbase.sh SUITE INCLUDE OUT_TAR
#
# SUITE    Debian suite (the build host's own, so a host-built CRIU finds its libraries)
# INCLUDE  comma-separated extra packages (python3 and CRIU's runtime libraries)
# OUT_TAR  the tarball to write; it appears only when complete (temp name -> rename)
#
# No registry can be reached from these machines, so the base image is produced
# locally: a minbase rootfs, slimmed, then `docker import`ed by runtime_image/build.py.
# The Debian mirror is read from this machine's apt sources; none is written here.
set -euo pipefail

if [ "$#" -ne 3 ]; then
  echo "usage: $0 SUITE INCLUDE OUT_TAR" >&2
  exit 2
fi
suite=$1 include=$2 out=$3

if [ "$(id -u)" -ne 0 ]; then
  echo "mkbase.sh must run as root (debootstrap creates device nodes and chroots)" >&2
  exit 2
fi
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install debootstrap" >&2; exit 2; }

debian_uri() {
  # The URI of this machine's own Debian archive, as apt is configured to use it.
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1=="deb" && $0 !~ /security/ {for (i=2;i<=NF;i++) if ($i ~ /^(http|https|ftp|file):/) {print $i; exit}}' /etc/apt/sources.list)
  fi
  [ -n "$uri" ] || { echo "cannot find the Debian archive URI in /etc/apt/sources.list*; configure apt first" >&2; return 1; }
  printf '%s\n' "$uri"
}

uri=$(debian_uri)
outdir=$(dirname "$out")
mkdir -p "$outdir"
work=$(mktemp -d "$outdir/.mkbase.XXXXXX")
trap 'rm -rf "$work"' EXIT
root="$work/rootfs"

debootstrap --variant=minbase --include="$include" "$suite" "$root" "$uri" >"$work/debootstrap.log" 2>&1 || {
  tail -n 30 "$work/debootstrap.log" >&2
  echo "debootstrap of $suite from $uri failed (log above)" >&2
  exit 1
}

# Slim the tree: the image never runs apt, and docs/locales are dead weight in every capsule host.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
       "$root"/var/log/*.log "$root"/var/log/apt/* "$root"/tmp/* "$root"/var/tmp/*
find "$root"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
# The mirror this machine happens to use is not part of the image's identity.
rm -f "$root"/etc/apt/sources.list "$root"/etc/hostname "$root"/etc/resolv.conf
: > "$root"/etc/machine-id

tar --sort=name --numeric-owner --xattrs -C "$root" -cf "$out.tmp" .
mv -f "$out.tmp" "$out"
