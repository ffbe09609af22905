"""Celery's Redis transport (kombu's), with one redis-py client per channel instead of one
per operation.

kombu's Redis channel builds a new `redis.Redis` over its connection pool for every
operation that is not a BRPOP: each publish batch, each delivery's unacked bookkeeping,
each ack (`Channel._create_client`, kombu 5.7). A `redis.Redis` is cheap to keep and
dear to build: its constructor fills a table of ~170 response callbacks. Kept instead,
a one-job send costs 0.50 CPU ms instead of 0.67 and a delivery with its ack 0.36
instead of 0.57 (`python scripts/broker_client_cost.py`, issue 16). The client holds no
state of its own beside its pool (redis-py clients are safe to share between threads; a
pipeline takes a connection of its own), so one client per channel and pool does the
same work.

The channel drops its pools when it closes; the cached client is rebuilt with the new
pool then. BRPOP and pub/sub keep kombu's own clients (the asynchronous pool).
"""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlparse

import redis
from kombu.transport import redis as kombu_redis

#: What `make_celery` names as the broker transport for a redis:// or rediss:// broker.
TRANSPORT = "kvfleet.broker:Transport"


class Channel(kombu_redis.Channel):
    _shared_client: Optional[redis.Redis] = None

    def _create_client(self, asynchronous: bool = False) -> redis.Redis:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        client = self._shared_client
        if client is None or client.connection_pool is not pool:
            # Two threads may both build one the first time; either serves.
            client = self._shared_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


def transport_for(broker_url: str) -> Optional[str]:
    """The transport to name for `broker_url`: this one for plain and TLS Redis URLs,
    None (kombu's choice by scheme) for anything else, e.g. sentinel://."""
    return TRANSPORT if urlparse(broker_url).scheme in ("redis", "rediss") else None
