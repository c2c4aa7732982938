# Tandem: make setup | protos | run | test | bench
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTOS := $(shell find protos -name '*.proto')
GEN_STAMP := tandem/v1/.stamp

.PHONY: setup protos run test test-slow bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed protos

$(GEN_STAMP): $(PROTOS) $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $@

protos: $(GEN_STAMP)

run: setup
	$(PY) -m tandem.launch

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) -m bench.e2e

clean:
	rm -rf tandem/v1 fmaas .pytest_cache
