# The `gpu-sglang` pool's worker and flow-run image: SGLang on NVIDIA GPUs, draftline, and a Prefect process worker.
# Built on the SGLang project's own image (its torch/CUDA/sglang-kernel builds), which cannot share an environment
# with vLLM: hence a pool and an image per engine. NOT BUILT on the project's machines (no Docker engine, no GPU).
#   docker build -f infra/images/worker-sglang.Dockerfile -t draftline/worker-sglang:latest .
# SGLang 0.5.14 is the version SpecForge 0.2.0 pins; pick the tag that matches your GPUs' CUDA.
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.14
FROM ${SGLANG_IMAGE}

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
# --no-deps for draftline itself: torch, transformers and sglang come from the base image with SGLang's pins.
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
RUN python3 -c "import sglang, prefect, draftline, flows.evaluate"

ENTRYPOINT []
# Through infra/prefect_worker.py: a missing or refused PREFECT_API_AUTH_STRING is one sentence, not a traceback.
CMD ["python3", "infra/prefect_worker.py", "--pool", "gpu-sglang", "--type", "process"]
