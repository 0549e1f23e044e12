#!/usr/bin/env bash
# antsibull-changelog in its own virtualenv (.cache/antsibull-changelog, created on first use):
#   changelog.sh lint       lint every fragment and changelogs/changelog.yaml
#   changelog.sh generate   rewrite CHANGELOG.rst from changelogs/changelog.yaml
#   changelog.sh release    add the release of galaxy.yml's version: the fragments not yet in a
#                           release go into changelogs/changelog.yaml, then CHANGELOG.rst is rewritten
# Extra arguments go to antsibull-changelog. generate and release read the documentation of the
# plugins and roles with the ansible-doc of ansible-core installed beside it (the version CI tests).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${ANTSIBULL_CHANGELOG_VENV:-$here/.cache/antsibull-changelog}
version=${ANTSIBULL_CHANGELOG_VERSION:-0.36.0}
core=${ANSIBLE_CORE_VERSION:-2.19.14}
python=${PYTHON:-python3}
cmd=${1:?usage: changelog.sh lint|generate|release [antsibull-changelog options]}
shift

have=$("$venv/bin/antsibull-changelog" --version 2>/dev/null || true)
have_core=$("$venv/bin/ansible-doc" --version 2>/dev/null || true)
if [ "${have##* }" != "$version" ] || [[ "$have_core" != *"[core $core]"* ]]; then
  echo "[changelog] installing antsibull-changelog $version and ansible-core $core into $venv" >&2
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -c "$here/scripts/constraints/antsibull-changelog.txt" "antsibull-changelog==$version" "ansible-core==$core"
fi
cd "$here"
case "$cmd" in
  lint)
    "$venv/bin/antsibull-changelog" lint "$@"
    "$venv/bin/antsibull-changelog" lint-changelog-yaml changelogs/changelog.yaml
    ;;
  generate|release)
    # ansible-doc must find this checkout as coldsnap.fleet, whatever else is installed.
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/ansible_collections/coldsnap"
    ln -s "$here" "$work/ansible_collections/coldsnap/fleet"
    PATH="$venv/bin:$PATH" ANSIBLE_COLLECTIONS_PATH="$work" ANSIBLE_COLLECTIONS_SCAN_SYS_PATH=false \
      "$venv/bin/antsibull-changelog" "$cmd" --ansible-doc-bin "$venv/bin/ansible-doc" "$@"
    ;;
  *)
    echo "usage: changelog.sh lint|generate|release [antsibull-changelog options]" >&2
    exit 2
    ;;
esac
