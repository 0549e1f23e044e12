# ColdSnap developer entry points. `make bootstrap` once (as root on a fresh Debian 12/13), then `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
export ANSIBLE_COLLECTIONS_PATH := $(abspath $(VENV))/collections

.PHONY: bootstrap venv test pytest lint sanity schemas awx galaxy-import ee-check changelog demo bench build clean

bootstrap:
	bash scripts/bootstrap.sh

venv:
	bash scripts/setup-venv.sh

## The full test suite: static checks, then unit + integration tests (real CRIU, dockerd, registry) and
## ansible-test sanity in two lanes at once (scripts/test-lanes.sh; COLDSNAP_TEST_LANES=1: one after the other).
test: lint
	PYTEST_ARGS="$(PYTEST_ARGS)" bash scripts/test-lanes.sh

pytest:
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

## Static checks. The first run installs galaxy-importer, ansible-builder and antsibull-changelog into
## their own virtualenvs under .cache/ (from PyPI); later runs are offline.
lint:
	$(BIN)/ruff check .
	$(PY) scripts/gen_schemas.py --check
	$(PY) scripts/gen_awx.py --check
	cd $(ANSIBLE_COLLECTIONS_PATH)/ansible_collections/coldsnap/fleet && $(BIN)/ansible-lint --profile production -q
	bash scripts/changelog.sh lint
	bash scripts/ee-check.sh
	bash scripts/galaxy-import.sh

sanity:
	bash scripts/ansible-sanity.sh

schemas:
	$(PY) scripts/gen_schemas.py

## docs/awx/*.json from the AWX config-as-code in docs/awx/controller/.
awx:
	$(PY) scripts/gen_awx.py

## Galaxy's import checks on the built tarball (galaxy-importer; ansible-doc on every plugin).
galaxy-import:
	bash scripts/galaxy-import.sh

## The execution-environment files (ansible-builder create + introspect; no container runtime).
ee-check:
	bash scripts/ee-check.sh

## CHANGELOG.rst from changelogs/ (antsibull-changelog generate); `bash scripts/changelog.sh release`
## cuts a release (docs/development.md).
changelog:
	bash scripts/changelog.sh generate

demo:
	bash scripts/demo.sh

bench:
	$(PY) -m bench.run_all

build:
	$(BIN)/ansible-galaxy collection build --force --output-path build/

clean:
	rm -rf build dist .pytest_cache .ruff_cache
