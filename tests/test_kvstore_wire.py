"""kvstore.wire.ParallelGet on the real Redis: the cold tier's reader of large values."""

from __future__ import annotations

import os

import pytest
import redis as redis_lib

from kvstore.wire import ParallelGet


@pytest.mark.parametrize("protocol", [2, 3])
def test_values_of_every_size_in_order_with_missing_ones_over_several_connections(cache_redis_url, prefix, protocol):
    client = redis_lib.Redis.from_url(cache_redis_url, protocol=protocol)
    values = {f"{prefix}:v{i}": os.urandom(n) for i, n in enumerate([0, 1, 17, 65_534, 65_536, 3 * 2**20, 100])}
    client.mset(values)
    keys = list(values)[:3] + [f"{prefix}:missing"] + list(values)[3:]
    reader = ParallelGet(client, connections=3)
    try:
        got = reader.get_many(keys, lambda i, raw: (i, None if raw is None else bytes(raw)))
        assert [i for i, _ in got] == list(range(len(keys)))
        assert [raw for _, raw in got] == [values.get(k) for k in keys]
        assert reader.get_many(keys[:1], lambda i, raw: raw) == [bytearray(values[keys[0]])]  # connections reusable
        assert client.ping()
    finally:
        reader.close()


def test_an_error_reply_raises_and_the_connection_is_not_reused_half_read(cache_redis_url, prefix):
    client = redis_lib.Redis.from_url(cache_redis_url)
    client.rpush(f"{prefix}:list", b"x")
    client.set(f"{prefix}:big", os.urandom(2**20))
    reader = ParallelGet(client, connections=1)
    try:
        with pytest.raises(redis_lib.ResponseError, match="WRONGTYPE"):
            reader.get_many([f"{prefix}:list", f"{prefix}:big"], lambda i, raw: raw)
        assert reader.get_many([f"{prefix}:big"], lambda i, raw: len(raw)) == [2**20]  # a fresh connection
    finally:
        reader.close()
