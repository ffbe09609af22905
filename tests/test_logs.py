"""Structured logs (kvfleet/logs.py): JSON lines written by one writer thread per process."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

from kvfleet.logs import JsonFormatter, LineWriter

ROOT = Path(__file__).resolve().parent.parent


def _writer(stream: io.StringIO) -> tuple[logging.Logger, LineWriter]:
    handler = LineWriter(stream)
    handler.setFormatter(JsonFormatter("test"))
    logger = logging.Logger("kvfleet.test")  # not the root: pytest's own handlers stay out of it
    logger.addHandler(handler)
    return logger, handler


def test_lines_from_many_threads_are_written_whole_each_once():
    stream = io.StringIO()
    logger, handler = _writer(stream)

    def log(t: int) -> None:
        for i in range(200):
            logger.info("done", extra={"job_id": f"{t}-{i}", "at": {"begun": 1.5, "stored": 2.5}})

    threads = [threading.Thread(target=log, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handler.close()  # writes what is still queued
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert sorted(line["job_id"] for line in lines) == sorted(f"{t}-{i}" for t in range(16) for i in range(200))
    assert {line["msg"] for line in lines} == {"done"} and lines[0]["at"] == {"begun": 1.5, "stored": 2.5}
    assert lines[0]["service"] == "test" and lines[0]["level"] == "INFO"


def test_a_line_is_written_while_the_process_runs_and_errors_keep_their_traceback():
    stream = io.StringIO()
    logger, handler = _writer(stream)
    try:
        raise ValueError("bad block")
    except ValueError:
        logger.exception("step failed", extra={"job_id": "j1"})
    deadline = time.monotonic() + 10
    while not stream.getvalue() and time.monotonic() < deadline:  # the writer thread, not close(), wrote it
        time.sleep(0.01)
    line = json.loads(stream.getvalue())
    assert line["job_id"] == "j1" and line["level"] == "ERROR" and "ValueError: bad block" in line["exc"]
    handler.close()


def test_a_process_that_exits_writes_every_queued_line_first():
    code = """
import logging, threading
from kvfleet import logs
logs.setup("worker")
log = logging.getLogger("kvfleet.worker")
def burst(t):
    for i in range(500):
        log.info("done", extra={"job_id": f"{t}-{i}"})
threads = [threading.Thread(target=burst, args=(t,)) for t in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
log.info("last")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert len(lines) == 8 * 500 + 1 and lines[-1]["msg"] == "last"
    assert all(line["service"] == "worker" for line in lines)
