"""Is this scheduler replica doing its share? The idle-with-lag check and `/healthz`.

A replica that owns no partitions is healthy when the group has more members than
partitions, or while a rebalance settles. It is not healthy when it owns none while the
group's jobs wait on Kafka and their number does not go down: then the partitions sit
with a member that does not move them (stalled, or wedged in a rebalance) or with no
member at all, and this replica would idle while jobs wait (issue 13 #8). The check
says so on `/healthz` (503, with the reason) and in `kvfleet_scheduler_idle_with_lag`;
the service rejoins the group once per window while it holds, which moves partitions
off a member that lost them.

`/healthz` is served on the metrics port, beside `/metrics`, so that a supervisor or
docker-compose's healthcheck needs no second port.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from socketserver import ThreadingMixIn
from typing import Callable, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app


class IdleWithLag:
    """Samples of (time, group lag) while this replica owns no partition; unhealthy once
    the lag stayed above zero for `window_s` and is no lower than at the window's start."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, int]] = deque()

    def observe(self, assigned: int, lag: Optional[int]) -> Optional[str]:
        """The reason this replica is unhealthy, or None. `lag`: the group's messages not
        yet decided (None when it was not read: the replica owns partitions)."""
        if assigned > 0 or not lag:
            self._samples.clear()
            return None
        now = self._clock()
        self._samples.append((now, lag))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()  # keep one sample at least window_s old
        first_t, first_lag = self._samples[0]
        if now - first_t < self.window_s or lag < first_lag:
            return None
        return (f"owns no partitions while {lag} jobs wait on Kafka (for {now - first_t:.0f} s, "
                f"not going down): the group's partitions sit with a member that does not move them")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # scrapes every few seconds: no access log
        pass


def serve(port: int, problem: Callable[[], Optional[str]], *, host: str = "0.0.0.0") -> _Server:
    """`/metrics` (Prometheus) and `/healthz` (200, or 503 with `problem()`) on `port`,
    from a daemon thread. Returns the server (its `server_port` when `port` is 0)."""
    metrics = make_wsgi_app()

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/healthz":
            reason = problem()
            body = json.dumps({"status": "ok" if reason is None else "unhealthy", "reason": reason}).encode()
            start_response("200 OK" if reason is None else "503 Service Unavailable",
                           [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return metrics(environ, start_response)

    server = make_server(host, port, app, server_class=_Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
