# The `gpu-train` pool's worker and flow-run image: draftline's training (torchrun, one process per GPU), its export
# and the reference decoder, with a Prefect process worker. No engine runs here; the base is the vLLM image only for
# its torch build, CUDA, NCCL and transformers, so every GPU stage of a run uses one torch.
# NOT BUILT on the project's machines (no Docker engine, no GPU there); the install steps mirror the vLLM image.
#   docker build -f infra/images/worker-train.Dockerfile -t draftline/worker-train:latest .
ARG TORCH_IMAGE=vllm/vllm-openai:v0.25.0
FROM ${TORCH_IMAGE}

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
# --no-deps for draftline itself: torch comes from the base image and must not be re-resolved.
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
# torchrun is the module torch.distributed.run of the image's torch; the training task starts it with this Python.
RUN python3 -c "import torch.distributed.run, prefect, transformers, draftline, flows.stages, flows.evaluate"

ENTRYPOINT []
# Through infra/prefect_worker.py: a missing or refused PREFECT_API_AUTH_STRING is one sentence, not a traceback.
CMD ["python3", "infra/prefect_worker.py", "--pool", "gpu-train", "--type", "process"]
