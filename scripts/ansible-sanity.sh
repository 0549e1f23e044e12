#!/usr/bin/env bash
# ansible-test needs to run from .../ansible_collections/<namespace>/<name> (a real path):
# copy the tracked tree there and run the sanity tests with their own virtualenvs.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
venv=${COLDSNAP_VENV:-$here/.venv}
work=${COLDSNAP_SANITY_DIR:-$here/tests/output/sanity-tree}
dest="$work/ansible_collections/coldsnap/fleet"
rm -rf "$dest"
mkdir -p "$dest"
(cd "$here" && git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$dest/")
# ansible-test bootstraps pip in its virtualenvs with a script it downloads; offline hosts get ours.
pipver=$("$venv/bin/python" - <<'PY'
import re, ansible_test, pathlib
src = (pathlib.Path(ansible_test.__file__).parent / "_internal" / "python_requirements.py").read_text()
print(re.search(r"pip='([0-9.]+)'", src).group(1))
PY
)
cache="$HOME/.ansible/test/cache/get_pip_${pipver//./_}.py"
mkdir -p "$(dirname "$cache")/pip-wheels"
cp "$here/scripts/ansible-test-get-pip.py" "$cache"
ls "$(dirname "$cache")"/pip-wheels/pip-"$pipver"-*.whl >/dev/null 2>&1 \
  || "$venv/bin/python" -m pip download -q --no-deps -d "$(dirname "$cache")/pip-wheels" "pip==$pipver"
cd "$dest"
git init -q . && git add -A >/dev/null 2>&1
python=$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
PATH="$venv/bin:$PATH" "$venv/bin/ansible-test" sanity --venv --python "$python" \
  "${@}"
