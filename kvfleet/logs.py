"""Structured logs: one JSON object per line, with the job id when there is one.

    log.info("admitted", extra={"job_id": job.job_id, "priority": "high"})

prints {"ts": ..., "level": "INFO", "service": "scheduler", "msg": "admitted",
"job_id": "...", "priority": "high"} — greppable by job id across every service.
"""

from __future__ import annotations

import logging
import sys
import time

import msgspec

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}
_encoder = msgspec.json.Encoder()


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(line).decode("utf-8", "replace")


def setup(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Library chatter at INFO (kafka-python's every connection) drowns the job lines.
    # Celery's "received" and "succeeded" lines (strategy, app.trace) repeat per task what
    # the runner's own lines say with the job id, at a cost per job.
    for noisy in ("kafka", "celery.worker.strategy", "celery.app.trace", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def now() -> float:
    return time.time()
