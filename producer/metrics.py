"""The API's Prometheus metrics, across its processes; and those of no one route.

With several API processes behind one port (`KVFLEET_API_WORKERS`), a scrape reaches
one of them. prometheus_client's multiprocess mode has every process write its samples
to files in one directory, and /metrics adds up all the processes' files:

    share()          in the parent, before the API processes start
    exposition()     what /metrics answers, in any of them

`share` makes the directory and names it in `PROMETHEUS_MULTIPROC_DIR`, the library's
own variable, which each process inherits and the library reads when it creates its
metrics (so it must be set before they are imported). Counters and histograms add up;
the one gauge, `kvfleet_api_streams_open`, is declared `livesum`. One process (the
default) keeps the library's ordinary in-memory registry.

No metric is declared in `producer/api.py`: `python -m producer.api` runs that file as
`__main__` and uvicorn then imports it as `producer.api`, which would declare it twice.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

REFUSED = Counter("kvfleet_api_jobs_refused", "Requests refused, by HTTP status", ["status"])

#: The library's variable (prometheus_client/values.py reads it).
MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


def share() -> None:
    """Make the processes started after this one share their metrics; the directory
    goes when this process exits. An operator's own directory is kept as it is."""
    if os.environ.get(MULTIPROC_DIR):
        return
    path = tempfile.mkdtemp(prefix="kvfleet-api-metrics-")
    os.environ[MULTIPROC_DIR] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


def exposition() -> bytes:
    """The text format of every process's metrics (of this one, in one process)."""
    if not os.environ.get(MULTIPROC_DIR):
        return generate_latest()
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry)
