"""Keep Python's cyclic garbage collector off what a service builds at startup.

A worker holds about half a million objects from its first minute on: torch and the
model's modules, Celery, kombu, redis-py, their modules' functions and classes. None of
them is garbage, yet every full collection walks them all, and the collector runs under
the GIL, so each such walk stalls every thread of the process. A busy worker keeps
hundreds of jobs' objects (requests, futures, sequences, closures) alive long enough to
reach the oldest generation, so it pays those walks over and over: in one engine with
414,000 objects, a `submit` cost 50 µs of CPU with the collector and 6–8 µs with the
startup heap frozen or no collector at all (docs/benchmarks.md, "The startup heap
out of the collector").

`freeze_startup_heap` collects once, then moves every object alive into the permanent
generation (`gc.freeze`): the collector ignores them from then on, and still collects
what is created later, cycles included. It is what CPython's documentation suggests for
a long-lived heap built at startup, and what large Python services do (Instagram's
Django fleet, vLLM's engine after warm-up). `KVFLEET_GC_FREEZE=0` turns it off.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(service: str) -> int:
    """Collect, then freeze every object alive now; the number frozen in all."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("startup heap frozen", extra={"service": service, "objects": frozen,
                                           "ms": round(1000 * (time.perf_counter() - started), 1)})
    return frozen
