"""kvstore.wire.Wire on the real Redis: the cold tier's reader and writer of large values."""

from __future__ import annotations

import os

import pytest
import redis as redis_lib

from kvstore.wire import Wire


@pytest.mark.parametrize("protocol", [2, 3])
def test_values_of_every_size_in_order_with_missing_ones_over_several_connections(cache_redis_url, prefix, protocol):
    client = redis_lib.Redis.from_url(cache_redis_url, protocol=protocol)
    values = {f"{prefix}:v{i}": os.urandom(n) for i, n in enumerate([0, 1, 17, 65_534, 65_536, 3 * 2**20, 100])}
    client.mset(values)
    keys = list(values)[:3] + [f"{prefix}:missing"] + list(values)[3:]
    reader = Wire(client, connections=3)
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
    reader = Wire(client, connections=1)
    try:
        with pytest.raises(redis_lib.ResponseError, match="WRONGTYPE"):
            reader.get_many([f"{prefix}:list", f"{prefix}:big"], lambda i, raw: raw)
        assert reader.get_many([f"{prefix}:big"], lambda i, raw: len(raw)) == [2**20]  # a fresh connection
    finally:
        reader.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_set_many_writes_every_size_over_several_connections_and_reads_back_into_the_callers_buffers(
        cache_redis_url, prefix, protocol):
    client = redis_lib.Redis.from_url(cache_redis_url, protocol=protocol, socket_timeout=5)
    values = [os.urandom(n) for n in [0, 1, 17, 65_536, 3 * 2**20 + 5, 100]]
    items = [(f"{prefix}:s{i}", v) for i, v in enumerate(values)]
    wire = Wire(client, connections=3)
    encoded_in = []
    try:
        def encode(item):
            encoded_in.append(item[0])
            return item[0], memoryview(item[1]), 60_000

        wire.set_many(items, encode)
        assert sorted(encoded_in) == sorted(k for k, _ in items)
        assert client.mget([k for k, _ in items]) == values
        assert 0 < client.pttl(items[0][0]) <= 60_000
        given = []

        def take(i, n):
            given.append(bytearray(n))
            return given[-1]

        got = wire.get_many([k for k, _ in items], lambda i, raw: raw, take=take)
        assert got == values and {id(v) for v in got} == {id(b) for b in given}  # read in place
        conn = client.connection_pool.get_connection()
        try:
            assert conn._sock.gettimeout() == 5  # back in redis-py's own timeout mode
        finally:
            client.connection_pool.release(conn)
    finally:
        wire.close()


def test_an_error_reply_to_a_set_raises_and_the_connection_is_dropped(cache_redis_url, prefix):
    client = redis_lib.Redis.from_url(cache_redis_url)
    wire = Wire(client, connections=1)
    try:
        with pytest.raises(redis_lib.ResponseError, match="expire"):
            wire.set_many([f"{prefix}:a", f"{prefix}:b"], lambda k: (k, b"x" * 1000, -5 if k.endswith("a") else 1000))
        assert client.get(f"{prefix}:b") == b"x" * 1000  # pipelined: the second was still sent
        wire.set_many([f"{prefix}:c"], lambda k: (k, b"y", 1000))
        assert client.get(f"{prefix}:c") == b"y"
    finally:
        wire.close()


def test_a_server_that_stops_answering_times_out_as_the_clients_socket_timeout_says(cache_redis_url, prefix):
    client = redis_lib.Redis.from_url(cache_redis_url, socket_timeout=0.2)
    client.set(f"{prefix}:big", os.urandom(2**20))
    wire = Wire(client, connections=1)
    admin = redis_lib.Redis.from_url(cache_redis_url)
    try:
        admin.client_pause(3_000)  # in the kernel's timeout, a blocking read would wait forever
        with pytest.raises(redis_lib.ConnectionError, match="transfer failed"):
            wire.get_many([f"{prefix}:big"], lambda i, raw: raw)
    finally:
        admin.client_unpause()
        wire.close()
    assert len(Wire(client, 1).get_many([f"{prefix}:big"], lambda i, raw: raw)[0]) == 2**20


def test_a_value_can_be_read_in_parts_into_several_buffers(cache_redis_url, prefix):
    client = redis_lib.Redis.from_url(cache_redis_url)
    value = os.urandom(3 * 2**20 + 7)
    client.set(f"{prefix}:parts", value)
    client.set(f"{prefix}:whole", b"abc")
    wire = Wire(client, connections=1)
    try:
        def take(i, n):  # the first value in three parts, the second whole
            return [bytearray(80), bytearray(2**20), bytearray(n - 80 - 2**20)] if i == 0 else bytearray(n)

        parts, whole = wire.get_many([f"{prefix}:parts", f"{prefix}:whole"], lambda i, v: v, take=take)
        assert b"".join(parts) == value and [len(p) for p in parts] == [80, 2**20, len(value) - 80 - 2**20]
        assert whole == b"abc"
    finally:
        wire.close()
