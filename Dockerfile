# One image for the API, the scheduler and the workers; docker-compose.yml picks the
# entry point per service. CPU by default; on a GPU host, torch from PyPI brings CUDA.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

# Dependencies first, so code edits do not re-download torch.
COPY pyproject.toml README.md ./
RUN mkdir -p kvfleet producer scheduler workers kvstore kernels \
 && touch kvfleet/__init__.py producer/__init__.py scheduler/__init__.py workers/__init__.py \
          kvstore/__init__.py kernels/__init__.py \
 && pip install . && pip uninstall -y kvfleet

COPY kvfleet ./kvfleet
COPY producer ./producer
COPY scheduler ./scheduler
COPY workers ./workers
COPY kvstore ./kvstore
COPY kernels ./kernels
RUN pip install --no-deps .

RUN useradd --create-home --uid 1000 kvfleet && mkdir -p /models && chown kvfleet /models
USER kvfleet
CMD ["kvfleet", "--help"]
