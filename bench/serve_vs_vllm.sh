#!/bin/bash
# nanoserve vs vLLM-CPU over HTTP, both up at once, alternated rounds, medians computed and raw JSON
# written by bench/serve_vs_vllm.py (see its docstring). vLLM's venv: shared peers.md, or set
# NANOSERVE_VLLM_PYTHON. Extra arguments go to the script, e.g. --runs 5.
cd "$(dirname "$0")/.." && exec .venv/bin/python bench/serve_vs_vllm.py "$@"
