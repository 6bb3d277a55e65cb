# kvwarden's image: `docker build -t kvwarden-server .` (the distribution's name, as in pyproject.toml)
#
# CPU torch by default. For a CUDA host, build on a CUDA base with Python 3.11 and the matching
# wheel index, e.g.
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t kvwarden-server:cuda .
# (the base must provide python3.11 as `python`).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch comes from this index (pinned by pyproject.toml), everything else from PyPI
ENV PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    KVWARDEN_HOST=0.0.0.0 \
    KVWARDEN_HTTP_HOST=0.0.0.0 \
    NUMBA_CACHE_DIR=/opt/kvwarden/.numba-cache

RUN useradd --system --uid 10001 --home-dir /opt/kvwarden --shell /usr/sbin/nologin kvwarden
WORKDIR /opt/kvwarden
COPY pyproject.toml README.md ./
COPY dataplane ./dataplane
COPY app ./app
COPY kvbench ./kvbench
# the same install as `make run` / `make install` (the Makefile's install recipe)
RUN python -m pip install -e .
# the blend rotation kernels compiled now, into NUMBA_CACHE_DIR: a server loads them, not compiles
RUN python -c "from dataplane.memory import rope_jit; rope_jit.compile_all()"

# the file tier's directory (KVWARDEN_FS_PATH in compose.yaml and the DaemonSet), the server's own
RUN mkdir -p /var/lib/kvwarden/fs && chown kvwarden:kvwarden /var/lib/kvwarden/fs

USER kvwarden
# 5555: the ZMQ data plane; 8080: the HTTP sidecar (/livez, /health, /status, /metrics)
EXPOSE 5555 8080
# /livez answers while the process serves; the slim image has no HTTP client, so Python asks
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/livez', timeout=2)"]
ENTRYPOINT ["kvwarden"]
CMD ["serve"]
