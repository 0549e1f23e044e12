#!/usr/bin/env bash
# antsibull-changelog in its own virtualenv (.cache/antsibull-changelog, created on first use):
#   changelog.sh lint       lint every fragment and changelogs/changelog.yaml
#   changelog.sh generate   rewrite CHANGELOG.rst from changelogs/changelog.yaml
#   changelog.sh release    add the release of galaxy.yml's version: the fragments not yet in a
#                           release go into changelogs/changelog.yaml, then CHANGELOG.rst is rewritten
# Extra arguments go to antsibull-changelog. generate and release read the plugins' documentation
# with ansible-doc (the one on PATH: the project's virtualenv; or $ANSIBLE_DOC).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${ANTSIBULL_CHANGELOG_VENV:-$here/.cache/antsibull-changelog}
version=${ANTSIBULL_CHANGELOG_VERSION:-0.36.0}
python=${PYTHON:-python3}
cmd=${1:?usage: changelog.sh lint|generate|release [antsibull-changelog options]}
shift

if [ "$("$venv/bin/antsibull-changelog" --version 2>/dev/null | awk '{print $NF}')" != "$version" ]; then
  echo "[changelog] installing antsibull-changelog $version into $venv" >&2
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "antsibull-changelog==$version"
fi
cd "$here"
case "$cmd" in
  lint)
    "$venv/bin/antsibull-changelog" lint "$@"
    "$venv/bin/antsibull-changelog" lint-changelog-yaml changelogs/changelog.yaml
    ;;
  generate|release)
    ansible_doc=${ANSIBLE_DOC:-$(command -v ansible-doc || true)}
    [ -n "$ansible_doc" ] || { echo "[changelog] $cmd needs ansible-doc on PATH (activate the project's virtualenv)" >&2; exit 2; }
    # ansible-doc must find this checkout as coldsnap.fleet, whatever else is installed.
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/ansible_collections/coldsnap"
    ln -s "$here" "$work/ansible_collections/coldsnap/fleet"
    ANSIBLE_COLLECTIONS_PATH="$work" ANSIBLE_COLLECTIONS_SCAN_SYS_PATH=false \
      "$venv/bin/antsibull-changelog" "$cmd" --ansible-doc-bin "$ansible_doc" "$@"
    ;;
  *)
    echo "usage: changelog.sh lint|generate|release [antsibull-changelog options]" >&2
    exit 2
    ;;
esac
