"""Moving many large values to and from Redis at close to what the socket moves.

redis-py is built for many small replies, not a few megabyte ones. Its reply parser
reads a 2 MiB bulk string in 64 KiB chunks and joins them (a copy per chunk, in Python,
with the GIL held), and its command packer (hiredis's) copies every value into one
bytes object before sending: measured here, 0.55 GB/s reading and 0.6 GB/s writing
where a raw socket moves 1.5-2.6 GB/s. `Wire` does what the raw socket does, on a few of
the client's own pooled connections in parallel (so AUTH, TLS and the database are
redis-py's business):

- `get_many`: pipelined `GET`s, each value read straight into a buffer of its exact
  size (the caller's, so a pool of them is reused: a fresh 2 MiB bytearray costs about
  0.8 ms of page faults and zeroing with the GIL held), and a `check` (the blob
  validation) run in the same thread on each value as it arrives.
- `set_many`: pipelined `SET key value PX ms`, each sent with one `sendmsg` of the
  command's head, the value as it is and the tail (no copy in user space), after an
  `encode` (the blob's seal: checksum, header) run in the same thread.

While it moves bytes a connection's socket is put in blocking mode with the timeout
set in the kernel (SO_RCVTIMEO/SO_SNDTIMEO): a value then arrives in one
`recv_into(..., MSG_WAITALL)`, one system call with the GIL released for all of it. In
redis-py's timeout mode every few KiB is a `poll` and a `recv`, each taking the GIL
again; beside an engine's step thread, which gives the GIL up at every torch op, those
hand-offs were what stalled decoding during cold loads.

Only `GET` and `SET` replies are parsed (a bulk string, a nil of RESP2 or RESP3, `+OK`,
or an error); anything else fails the connection, which is then dropped rather than
returned to the pool half read.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Iterator, Optional, Sequence, TypeVar, Union

import redis

T = TypeVar("T")
Item = TypeVar("Item")
Buffer = Union[bytes, bytearray, memoryview]
#: `take(i, n)`: where key i's value of n bytes goes: one writable buffer of exactly n
#: bytes, or several whose lengths add up to n, filled in order (a blob's header into a
#: small buffer, its payload straight into the engine's pool blocks).
Take = Callable[[int, int], Union[bytearray, list]]
_HEADER_CHUNK = 1 << 16
_CRLF = b"\r\n"


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


@contextlib.contextmanager
def _blocking(sock: socket.socket) -> Iterator[bool]:
    """Blocking mode with the socket's timeout moved into the kernel, for the duration;
    yields whether MSG_WAITALL and sendmsg may be used (not on TLS sockets)."""
    if isinstance(sock, ssl.SSLSocket):
        yield False
        return
    timeout = sock.gettimeout()
    sock.settimeout(None)
    if timeout:
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            sock.setsockopt(socket.SOL_SOCKET, opt, _timeval(timeout))
    try:
        yield True
    finally:
        if timeout:
            for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
                sock.setsockopt(socket.SOL_SOCKET, opt, _timeval(0))
        sock.settimeout(timeout)


class _Reader:
    """Replies from one socket, in order; bulk values into exact-size buffers."""

    def __init__(self, sock: socket.socket, waitall: bool) -> None:
        self.sock = sock
        self.flags = socket.MSG_WAITALL if waitall else 0
        self.buf = bytearray(_HEADER_CHUNK)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    def expect_drained(self) -> None:
        """Nothing read that was not consumed, or the connection cannot be reused."""
        if self.start != self.end:
            raise redis.ConnectionError("bytes left over after the replies")

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):  # keep the unread tail, make room after it
            tail = self.end - self.start
            self.buf[:tail] = self.buf[self.start:self.end]
            self.start, self.end = 0, tail
        got = self.sock.recv_into(self.view[self.end:])  # whatever is there: headers are small
        if not got:
            raise redis.ConnectionError("Redis closed the connection mid-reply")
        self.end += got

    def _line(self) -> bytes:
        while True:
            nl = self.buf.find(_CRLF, self.start, self.end)
            if nl >= 0:
                line = bytes(self.buf[self.start:nl])
                self.start = nl + 2
                return line
            self._fill()

    def _into(self, view: memoryview) -> None:
        """Fill `view` exactly: first from what is buffered, then from the socket."""
        have = min(self.end - self.start, len(view))
        view[:have] = self.view[self.start:self.start + have]
        self.start += have
        pos = have
        while pos < len(view):
            got = self.sock.recv_into(view[pos:], len(view) - pos, self.flags)
            if not got:
                raise redis.ConnectionError("Redis closed the connection mid-reply")
            pos += got

    def simple(self) -> bytes:
        """A status reply (`+OK`); an error reply raises."""
        line = self._line()
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if line[:1] != b"+":
            raise redis.ConnectionError(f"unexpected reply to SET: {line[:32]!r}")
        return line[1:]

    def bulk(self, take: Take, i: int) -> Union[bytearray, list, None]:
        line = self._line()
        kind = line[:1]
        if kind == b"-":
            raise redis.ResponseError(line[1:].decode(errors="replace"))
        if kind == b"_":  # RESP3's null
            return None
        if kind != b"$":
            raise redis.ConnectionError(f"unexpected reply to GET: {line[:32]!r}")
        length = int(line[1:])
        if length < 0:
            return None
        value = take(i, length)
        for part in value if isinstance(value, list) else [value]:
            with memoryview(part) as view:
                self._into(view.cast("B"))
        crlf = bytearray(2)
        self._into(memoryview(crlf))
        if crlf != _CRLF:
            raise redis.ConnectionError("a bulk reply did not end in CRLF")
        return value


def _send(sock: socket.socket, parts: list[Buffer], vectored: bool) -> None:
    """Send `parts` in order, large ones as they are (one writev when possible)."""
    if not vectored:
        for part in parts:
            sock.sendall(part)
        return
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


def _bulk(arg: Buffer) -> bytes:
    return b"$%d\r\n" % len(arg)


class Wire:
    """`get_many(keys, check)` and `set_many(items, encode)` of large values over up to
    `connections` of `client`'s pooled connections at once."""

    def __init__(self, client: redis.Redis, connections: int = 4) -> None:
        self.client = client
        self.connections = max(1, connections)
        self._pool = ThreadPoolExecutor(max_workers=self.connections, thread_name_prefix="kv-wire")

    def get_many(self, keys: Sequence[str], check: Callable[[int, Union[bytearray, list, None]], T], *,
                 take: Take = lambda _i, n: bytearray(n), connections: Optional[int] = None) -> list[T]:
        """`check(i, value)` for each key in order (value None where missing, else what
        `take` gave, filled), run in the thread that read it; `connections` (at most the
        Wire's) for a caller that knows the values are small."""
        def run(first: int, chunk: Sequence[str], sock: socket.socket, fast: bool) -> list[T]:
            _send(sock, [b"".join(b"*2\r\n$3\r\nGET\r\n%s%s\r\n" % (_bulk(k.encode()), k.encode()) for k in chunk)], False)
            reader = _Reader(sock, fast)
            out = [check(first + i, reader.bulk(take, first + i)) for i in range(len(chunk))]
            reader.expect_drained()
            return out

        return self._spread(keys, run, connections)

    def set_many(self, items: Sequence[Item], encode: Callable[[Item], tuple[str, Buffer, int]], *,
                 connections: Optional[int] = None) -> None:
        """`encode(item)` -> (key, value, px), run in the sending thread; each value is
        then `SET key value PX px`. Raises the first error reply or connection error.
        With `connections=1` it all happens in the calling thread."""
        def run(_first: int, chunk: Sequence[Item], sock: socket.socket, fast: bool) -> list[None]:
            for item in chunk:
                key, value, px = encode(item)
                k, ms = key.encode(), str(int(px)).encode()
                parts = value if isinstance(value, list) else [value]
                size = sum(memoryview(p).nbytes for p in parts)
                head = b"*5\r\n$3\r\nSET\r\n%s%s\r\n$%d\r\n" % (_bulk(k), k, size)
                _send(sock, [head, *parts, b"\r\n$2\r\nPX\r\n%s%s\r\n" % (_bulk(ms), ms)], fast)
            reader = _Reader(sock, fast)
            for _ in chunk:
                reader.simple()
            reader.expect_drained()
            return [None] * len(chunk)

        self._spread(items, run, connections)

    def _spread(self, items: Sequence, run: Callable[[int, Sequence, socket.socket, bool], list],
                connections: Optional[int] = None) -> list:
        if not items:
            return []
        n = max(1, min(self.connections, connections or self.connections, len(items)))
        bounds = [len(items) * i // n for i in range(n + 1)]
        chunks = [(bounds[i], items[bounds[i]:bounds[i + 1]]) for i in range(n)]
        if n == 1:
            return self._on_connection(*chunks[0], run)
        futures = [self._pool.submit(self._on_connection, *c, run) for c in chunks]
        wait(futures)  # all of them, even after a failure: the caller reuses the buffers sent
        return [v for f in futures for v in f.result()]

    def _on_connection(self, first: int, chunk: Sequence, run: Callable) -> list:
        pool = self.client.connection_pool
        conn = pool.get_connection()
        ok = False
        try:
            conn.connect()  # a no-op when connected; the pool may hand out a fresh one
            with _blocking(conn._sock) as fast:  # redis-py's own parser holds nothing: it read every earlier reply
                out = run(first, chunk, conn._sock, fast)
            ok = True
            return out
        except OSError as exc:  # a socket timeout or reset: what redis-py would raise
            raise redis.ConnectionError(f"cold-tier transfer failed: {exc}") from exc
        finally:
            if not ok:
                conn.disconnect()  # half read, or an error: never hand it back as is
            pool.release(conn)

    def close(self) -> None:
        self._pool.shutdown(wait=False)

