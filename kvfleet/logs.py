"""Structured logs: one JSON object per line, with the job id when there is one.

    log.info("admitted", extra={"job_id": job.job_id, "priority": "high"})

prints {"ts": ..., "level": "INFO", "service": "scheduler", "msg": "admitted",
"job_id": "...", "priority": "high"} — greppable by job id across every service.

The calling thread formats its line; one writer thread per process writes them, every
line queued since its last write in one `write`. A worker logs two lines per job from
up to 256 task threads at once, and a handler that wrote each line itself, under its
lock, cost a short job about 0.3 ms of CPU in that lock and its syscalls (issue 16,
docs/benchmarks.md). Lines are written within moments of their call; a process that
exits writes what is queued first (`logging.shutdown`, which runs at exit, closes the
handler), and one killed with SIGKILL may lose its last moment's lines.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import Optional, TextIO

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


class LineWriter(logging.Handler):
    """A handler that formats each record on the caller's thread and hands the line to
    one writer thread, which writes every line queued since its last write at once."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream
        self._lines: queue.SimpleQueue[Optional[str]]  # set by _start, with the thread that empties it
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._start()
        # A forked child has the queue but not the thread: it starts its own.
        os.register_at_fork(after_in_child=lambda: None if self._closed else self._start())

    def _start(self) -> None:
        self._lines = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="log-writer", daemon=True)
        self._thread.start()

    def handle(self, record: logging.LogRecord) -> bool:
        # No handler lock: formatting touches only the record, and the queue is thread-safe.
        if not self.filter(record):
            return False
        try:
            self._lines.put(self.format(record))
        except Exception:  # noqa: BLE001 - logging's convention: report, never raise into the caller
            self.handleError(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:  # `handle` does it all
        self.handle(record)

    def _write(self) -> None:
        lines = self._lines
        while True:
            batch = [lines.get()]
            while not lines.empty():
                batch.append(lines.get_nowait())
            done = None in batch
            text = "".join(f"{line}\n" for line in batch if line is not None)
            try:
                if text:
                    self.stream.write(text)
                    self.stream.flush()
            except Exception:  # noqa: BLE001 - the stream is closed or broken: the lines are lost, the thread lives
                pass
            if done:
                return

    def close(self) -> None:
        """Write what is queued, then stop the writer (logging.shutdown calls it at exit)."""
        self._closed = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._lines.put(None)
            thread.join(timeout=5)
        super().close()


def setup(service: str, level: str = "INFO") -> None:
    # A line carries none of what a record collects by default beyond its message and
    # extras (JsonFormatter): not its caller's file and line, which cost a walk up the
    # stack for every record, nor its thread or process. The logging docs' own
    # "Optimization" switches; about 0.1 ms a line a worker logs per job (issue 16).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = LineWriter(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, LineWriter):
            old.close()  # set up again (the API's app factory runs in the process that set it up)
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Library chatter at INFO (kafka-python's every connection) drowns the job lines.
    # Celery's "received" and "succeeded" lines (strategy, app.trace) repeat per task what
    # the runner's own lines say with the job id, at a cost per job.
    for noisy in ("kafka", "celery.worker.strategy", "celery.app.trace", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def now() -> float:
    return time.time()
