# One image for the API, the scheduler and the workers; docker-compose.yml picks the
# entry point per service. CPU by default; on a GPU host, torch from PyPI brings CUDA.
#
# BASE is any Debian-like image with (or able to apt-get) Python 3.11: the official
# python:3.11-slim by default; docker-compose.local.yml passes kvfleet-base:bookworm, a
# base image made from the Debian archive (deploy/local/base.sh) where no image registry
# can be reached.
ARG BASE=python:3.11-slim
FROM ${BASE}

# pip trusts the system store, which holds any authority the base image added.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
WORKDIR /app

RUN if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --upgrade pip

# Dependencies first, exactly as locked (versions and hashes), so code edits do not
# re-download torch.
COPY requirements.lock ./
RUN pip install -q --require-hashes -r requirements.lock

COPY pyproject.toml README.md ./
COPY kvfleet ./kvfleet
COPY producer ./producer
COPY scheduler ./scheduler
COPY workers ./workers
COPY kvstore ./kvstore
COPY kernels ./kernels
RUN pip install -q --no-deps . && rm -rf build *.egg-info

RUN useradd --create-home --uid 1000 kvfleet && mkdir -p /models /files && chown kvfleet /models /files
USER kvfleet
CMD ["kvfleet", "--help"]
