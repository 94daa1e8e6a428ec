#!/bin/bash
# nanoserve and vLLM CPU (see shared peers.md for its install) up at once on 127.0.0.1; the same
# bench/serve_bench.py workload alternated A B A B A B, so machine drift hits both alike.
# Needs the HF export of the embedded model: python bench/export_hf.py
cd "$(dirname "$0")/.."
W="--num-prompts 32 --input-len 256 --output-len 64 --max-concurrency 8"
.venv/bin/python -m nanoserve.server.cli --host 127.0.0.1 --port 8011 --log-level warning > /tmp/nanoserve_ab.log 2>&1 &
NS=$!
VLLM_CPU_KVCACHE_SPACE=1 "${NANOSERVE_VLLM_PYTHON:-/tmp/vllm-cpu/bin/python}" -m vllm.entrypoints.openai.api_server \
  --model $HOME/.cache/nanoserve/smollm2-hf --dtype bfloat16 --max-model-len 4096 --port 8100 --host 127.0.0.1 \
  --served-model-name smollm2 --enable-prompt-tokens-details > /tmp/vllm_ab.log 2>&1 &
VL=$!
for i in $(seq 1 400); do curl -sf http://127.0.0.1:8100/health >/dev/null && curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
sleep 5
for r in 1 2 3; do
  for t in ns:8011 vllm:8100; do
    name=${t%%:*}; port=${t##*:}
    echo "=== $name run $r"
    .venv/bin/python bench/serve_bench.py --base-url http://127.0.0.1:$port/v1 $W | grep -E "Output token|Mean TTFT|Mean TPOT"
  done
done
kill -TERM $NS $VL; wait
