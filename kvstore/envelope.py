"""The value cache's stored format: a 24-byte header, then the encoded value.

    offset  size  field
    0       4     magic b"KVC1"
    4       1     version (1)
    5       3     reserved, zero
    8       8     expires_at: logical expiry, float64 time.time() seconds
    16      8     build_s: seconds the value took to build (XFetch's δ), float64
    24      n     the value, as the cache's encoder wrote it

Logical expiry travels inside the value because Redis only knows the physical TTL,
which is longer (logical + grace) so that a stale value can still be served.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from kvstore.errors import BlobError

MAGIC = b"KVC1"
VERSION = 1
_HEADER = struct.Struct("<4sB3xdd")


class Envelope(NamedTuple):
    expires_at: float
    build_s: float
    payload: memoryview


def pack(payload: bytes, expires_at: float, build_s: float) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, expires_at, build_s) + payload


def unpack(raw: bytes) -> Envelope:
    """Raises BlobError when `raw` is not an envelope this version wrote."""
    if len(raw) < _HEADER.size:
        raise BlobError("truncated", f"{len(raw)} bytes < {_HEADER.size}-byte header")
    magic, version, expires_at, build_s = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise BlobError("magic", repr(magic))
    if version != VERSION:
        raise BlobError("version", str(version))
    return Envelope(expires_at, build_s, memoryview(raw)[_HEADER.size:])
