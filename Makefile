# ColdSnap developer entry points. `make bootstrap` once (as root on a fresh Debian 12/13), then `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
export ANSIBLE_COLLECTIONS_PATH := $(abspath $(VENV))/collections

.PHONY: bootstrap venv test pytest lint sanity schemas demo bench build clean

bootstrap:
	bash scripts/bootstrap.sh

venv:
	bash scripts/setup-venv.sh

## The full test suite: static checks, unit + integration tests (real CRIU, dockerd, registry).
test: lint pytest sanity

pytest:
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

lint:
	$(BIN)/ruff check .
	$(PY) scripts/gen_schemas.py --check
	cd $(ANSIBLE_COLLECTIONS_PATH)/ansible_collections/coldsnap/fleet && $(BIN)/ansible-lint --profile production -q

sanity:
	bash scripts/ansible-sanity.sh

schemas:
	$(PY) scripts/gen_schemas.py

demo:
	bash scripts/demo.sh

bench:
	$(PY) -m bench.run_all

build:
	$(BIN)/ansible-galaxy collection build --force --output-path build/

clean:
	rm -rf build dist .pytest_cache .ruff_cache
