# A CPU stand-in for docker/Dockerfile's CUDA base, built without any registry but Debian's
# and PyPI: Debian's Python 3.11 in a virtualenv on PATH (as the PyTorch images have their
# own Python) with a CPU torch wheel from the build context. scripts/compose_check.sh builds
# it on a local Debian base image (debootstrap; no Docker Hub needed):
#   docker build -f docker/local/python-torch.Dockerfile --build-arg DEBIAN=IMAGE CONTEXT
# where CONTEXT holds one torch-*.whl (pip download --no-deps torch==VERSION) and
# ca-bundle.crt, the certificates the host's pip trusts (a TLS proxy in front of PyPI has its
# own CA): pip in this image and in images built on it (docker/Dockerfile) trusts them too.
ARG DEBIAN=loader-search-local/debian:bookworm
FROM ${DEBIAN}

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt \
    PATH=/opt/venv/bin:$PATH
COPY ca-bundle.crt /etc/ssl/certs/host-ca-bundle.crt

RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates libgomp1; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -m venv /opt/venv

COPY torch-*.whl /tmp/
RUN set -eux; \
    pip install --no-cache-dir /tmp/torch-*.whl; \
    rm /tmp/torch-*.whl; \
    python -c 'import torch; print("torch", torch.__version__)'
