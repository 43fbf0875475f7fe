# One command each: `make test` (lint, types, tests) and `make demo` (the main job).
# Both create .venv and install everything on a fresh machine with nothing but Python.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where the CPU build of torch comes from. Empty: pip's configured index (which must serve a CPU
# build; plain PyPI serves the CUDA one). E.g. TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)

.PHONY: setup engines test lint demo clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# A bare `torch` requirement pulls a multi-GB CUDA build: pin the CPU build first when none is importable.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_INDEX) torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev,tools]"
	touch $@

setup: $(VENV)/.installed

# vLLM and SGLang for the adapter tests (tests/adapters): --no-deps, so torch, numpy and triton stay as
# installed; requirements-engines.txt says why each entry is there. First install ~1.5 min, ~1.5 GB.
$(VENV)/.engines: requirements-engines.txt $(VENV)/.installed
	$(PY) -m pip install -q --no-deps -r requirements-engines.txt
	touch $@

engines: $(VENV)/.engines

# mypy checks the installed layout (aiokv.kernels lives in kernels/, aiokv.storage in storage/):
# a tree of links under build/ gives it the import names without installing anything.
TYPECHECK := build/typecheck
lint: setup
	$(VENV)/bin/ruff check aiokv kernels storage tests tools
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/aiokv
	ln -s $(CURDIR)/aiokv/*.py $(CURDIR)/aiokv/py.typed $(TYPECHECK)/aiokv/
	ln -s $(CURDIR)/aiokv/tp $(TYPECHECK)/aiokv/tp
	ln -s $(CURDIR)/aiokv/adapters $(TYPECHECK)/aiokv/adapters
	ln -s $(CURDIR)/kernels $(TYPECHECK)/aiokv/kernels
	ln -s $(CURDIR)/storage $(TYPECHECK)/aiokv/storage
	cd $(TYPECHECK) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p aiokv

# The suite runs in two passes: first on one pytest-xdist worker per CPU (at most TEST_WORKERS_MAX:
# each worker imports vLLM and SGLang and opens its own pools), every test but those marked
# `timing`; then those alone, which assert wall-clock bounds (loop stalls, GIL holds) that other
# workers' load would break. TEST_WORKERS=0 runs the first pass in one process.
TEST_WORKERS ?= logical
TEST_WORKERS_MAX ?= 8
test: lint engines
	$(VENV)/bin/pytest -q --durations=30 -n $(TEST_WORKERS) --maxprocesses $(TEST_WORKERS_MAX) --dist worksteal -m "not timing"
	$(VENV)/bin/pytest -q --durations=10 -m timing

demo: setup
	$(PY) tools/demo.py

clean:
	rm -rf $(VENV) build *.egg-info
