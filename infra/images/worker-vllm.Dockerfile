# The `gpu-vllm` pool's worker and flow-run image: vLLM on NVIDIA GPUs, draftline, and a Prefect process worker.
# Built on the vLLM project's own image so that vLLM, its torch build and CUDA are exactly what it ships.
# NOT BUILT on the project's machines (no Docker engine, no GPU there); the install steps mirror the CPU image.
#   docker build -f infra/images/worker-vllm.Dockerfile -t draftline/worker-vllm:latest .
# One environment: draftline starts the engine with its own Python (python -m vllm.entrypoints.openai.api_server),
# so draftline, Prefect's client and vLLM share the image's Python; Prefect goes in without touching vLLM's pins.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.25.0
FROM ${VLLM_IMAGE}

ARG PREFECT_VERSION=3.9.1
ENV DRAFTLINE_HOME=/opt/draftline \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
# What an engine start compiles (FlashInfer's JIT kernels, vLLM's and torch's compile caches, Triton's kernels) and
# Hugging Face downloads go under /var/cache/draftline, a volume kept between flow runs (compose's model-cache, the
# Kubernetes templates' engine_cache_path): with them a later vLLM start skips the first start's 74-s kernel build.
# FlashInfer keeps its kernels under FLASHINFER_WORKSPACE_BASE/.cache, not under XDG_CACHE_HOME.
ENV XDG_CACHE_HOME=/var/cache/draftline \
    FLASHINFER_WORKSPACE_BASE=/var/cache/draftline \
    TRITON_CACHE_DIR=/var/cache/draftline/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/draftline/inductor
WORKDIR /opt/draftline
COPY pyproject.toml README.md ./
COPY draftline/__init__.py draftline/__init__.py
# --no-deps for draftline itself: torch and vLLM come from the base image and must not be re-resolved.
RUN python3 -m pip install --no-deps -e . \
    && python3 -m pip install "safetensors>=0.4" "tokenizers>=0.21" "boto3>=1.34" "pydantic>=2.7,<3" "pyyaml>=6" \
       "matplotlib>=3.8" "rich>=13" "httpx>=0.27"
COPY infra/images/install-prefect.sh /usr/local/bin/install-prefect.sh
RUN install-prefect.sh python3 "$PREFECT_VERSION"
COPY draftline draftline
COPY tasks tasks
COPY flows flows
COPY configs configs
COPY deployments deployments
COPY infra/prefect_worker.py infra/prefect_worker.py
RUN python3 -c "import vllm, prefect, draftline, flows.evaluate"

# The vLLM image's entrypoint starts a server; this image's job is the Prefect worker (or a Kubernetes flow run).
ENTRYPOINT []
# Through infra/prefect_worker.py: a missing or refused PREFECT_API_AUTH_STRING is one sentence, not a traceback.
CMD ["python3", "infra/prefect_worker.py", "--pool", "gpu-vllm", "--type", "process"]
