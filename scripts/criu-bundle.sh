#!/usr/bin/env bash
# Bundle ColdSnap's CRIU build with every shared library it links (and the dynamic loader)
# into one relocatable folder, for hosts that have no CRIU package (e.g. a GPU host that
# only receives files). Usage: scripts/criu-bundle.sh OUTDIR
# Run OUTDIR/criu ... exactly like criu; it starts the bundled loader with the bundled libs.
set -euo pipefail
out=${1:?usage: criu-bundle.sh OUTDIR}
src=$(command -v criu || true)
[ -n "$src" ] || { echo "criu not installed; run scripts/install-system.sh first" >&2; exit 1; }
src=$(readlink -f "$src")
rm -rf "$out"; mkdir -p "$out/bin" "$out/lib"
cp "$src" "$out/bin/criu"
loader=""
while read -r line; do
  lib=$(echo "$line" | awk '/=>/ {print $3} !/=>/ && /^\// {print $1}')
  if [ -z "$lib" ] || [ ! -f "$lib" ]; then continue; fi
  cp -L "$lib" "$out/lib/"
  case "$lib" in */ld-linux*) loader=$(basename "$lib");; esac
done < <(ldd "$src" | sed 's/^\s*//')
[ -n "$loader" ] || { echo "could not find the dynamic loader of $src" >&2; exit 1; }
cat > "$out/criu" <<WRAP
#!/bin/sh
d=\$(dirname "\$(readlink -f "\$0")")
exec "\$d/lib/$loader" --library-path "\$d/lib" "\$d/bin/criu" "\$@"
WRAP
chmod +x "$out/criu"
"$out/criu" --version >/dev/null
echo "$out/criu ($(du -sh "$out" | cut -f1))"
