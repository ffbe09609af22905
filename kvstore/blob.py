"""The cold tier's stored format for one KV block: an 80-byte header, then raw tensor bytes.

    offset  size  field
    0       4     magic b"KVB1"
    4       1     version (2: crc32c; 1 was zlib's crc32)
    5       1     dtype of the pool: 1 float32, 2 float16, 3 bfloat16
    6       1     quantization: 0 none, 1 int8 with one float32 scale per row of D
    7       1     reserved, zero
    8       2×4   num_layers, block_size, num_kv_heads, head_dim (uint16 each)
    16      16    blake2b-128 of the model fingerprint
    32      16    blake2b-128 of the block hash (catches a blob written under a wrong key)
    48      8     payload length in bytes (uint64)
    56      4     crc32c (Castagnoli) of bytes 0..55 and of the payload
    60      4     reserved, zero
    64      8     expires_at: logical expiry, float64 time.time() seconds
    72      8     reserved, zero (pads the payload to a 16-byte boundary)
    80      n     payload

Payload, all layers of one block, layer-major with K before V:
    none: (L, 2, BS, Hkv, D) in the pool's dtype
    int8: (L, 2, BS, Hkv, D) int8, then (L, 2, BS, Hkv) float32 scales

`expires_at` sits outside the checksum on purpose: a reader that uses a stale block
extends it in place (SETRANGE of 8 bytes) without rewriting the blob. A flipped bit
there can only move the logical expiry; the physical TTL still bounds the key's life.

A blob that fails any check raises BlobError and must be treated as a miss: nothing
of it is copied into a tensor before every check, the checksum last, has passed.
"""

from __future__ import annotations

import hashlib
import struct
import warnings

import crc32c
from dataclasses import dataclass
from enum import Enum
from typing import Sequence, Union

import torch

from kernels.ops import Kernels
from kvstore.errors import BlobError

# Blobs read from Redis are immutable `bytes`; torch.frombuffer warns that it cannot
# make them writable. We only ever read through these views (copy_ out of them).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

MAGIC = b"KVB1"
#: 2: the checksum is crc32c, in hardware (SSE4.2 / ARMv8 CRC), about 5x zlib's crc32 on
#: a 2 MiB block here, which had been a third of a load's time. The version is part of
#: the cold tier's key namespace too, so workers of both versions never meet.
VERSION = 2
HEADER = struct.Struct("<4sBBBx4H16s16sQI4xd8x")
_CHECKED = 56  # bytes 0..55 are covered by the checksum
EXPIRES_AT_OFFSET = 64
EXPIRES_AT = struct.Struct("<d")

_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}

Buffer = Union[bytes, bytearray, memoryview]


class Quant(str, Enum):
    NONE = "none"
    INT8 = "int8"  # about half the bytes of fp16 (1 byte + 4/D bytes of scale per value)


_QUANT_CODES = {Quant.NONE: 0, Quant.INT8: 1}
_QUANTS = {code: quant for quant, code in _QUANT_CODES.items()}


def digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _checksum(view: memoryview) -> int:
    """crc32c of the header up to the checksum field, then of the payload."""
    return crc32c.crc32c(view[HEADER.size:], value=crc32c.crc32c(view[:_CHECKED]))


@dataclass(frozen=True)
class KVLayout:
    """The shape of one block in the engine's pool, all layers together."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> "KVLayout":
        """From the pool: one (k_cache, v_cache) pair per layer, each (NB, BS, Hkv, D)."""
        _, bs, hkv, d = kv_caches[0][0].shape
        return cls(len(kv_caches), bs, hkv, d, kv_caches[0][0].dtype)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(f"KV dtype {self.dtype} is not one of {list(_DTYPE_CODES)}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)  # (L, 2, BS, Hkv, D)

    @property
    def tag(self) -> str:
        """Every fact of the layout a blob depends on, for cold-tier keys: workers whose
        pools differ (fp32 beside bf16, another block size) keep apart, rather than
        reject and delete each other's blobs."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}-l{self.num_layers}-b{self.block_size}-h{self.num_kv_heads}-d{self.head_dim}"

    @property
    def numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    def payload_nbytes(self, quant: Quant) -> int:
        if quant is Quant.INT8:
            return self.numel + 4 * (self.numel // self.head_dim)  # int8 values + float32 row scales
        return self.numel * self.dtype.itemsize


class KVBlob:
    """A validated blob: views into its buffer, turned into a tensor only when asked."""

    def __init__(self, layout: KVLayout, quant: Quant, buf: Buffer, expires_at: float, kernels: Kernels) -> None:
        self.layout = layout
        self.quant = quant
        self.buf = buf
        self.expires_at = expires_at
        self._kernels = kernels

    @property
    def nbytes(self) -> int:
        return len(self.buf)

    def tensor(self, device: Union[torch.device, str] = "cpu") -> torch.Tensor:  # (L, 2, BS, Hkv, D)
        """The block's K/V in the pool's dtype on `device`; a zero-copy view on CPU when unquantized."""
        lay = self.layout
        if self.quant is Quant.NONE:
            kv = torch.frombuffer(self.buf, dtype=lay.dtype, count=lay.numel, offset=HEADER.size)
            return kv.view(lay.shape).to(device)
        rows = lay.numel // lay.head_dim
        q = torch.frombuffer(self.buf, dtype=torch.int8, count=lay.numel, offset=HEADER.size)
        scale = torch.frombuffer(self.buf, dtype=torch.float32, count=rows, offset=HEADER.size + lay.numel)
        # Dequantize where the pool lives: a GPU pool receives half the bytes over PCIe.
        q = q.view(lay.shape).to(device)  # (L, 2, BS, Hkv, D) int8
        scale = scale.view(lay.shape[:-1]).to(device)  # (L, 2, BS, Hkv) float32
        return self._kernels.dequantize_int8(q, scale, lay.dtype)


class BlobCodec:
    """Writes and validates the blobs of one model and one pool layout."""

    def __init__(self, layout: KVLayout, model_fingerprint: str, *, kernels: Kernels, quant: Quant = Quant.NONE) -> None:
        """`kernels`: the INT8 quantize (on write) and dequantize (on read, whatever `quant`:
        another writer may have quantized)."""
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        self.quant = quant
        self.kernels = kernels
        self._model_digest = digest(model_fingerprint)

    # --- write ----------------------------------------------------------------------
    @property
    def raw_nbytes(self) -> int:
        """Size of a buffer to copy a block into: the header and an unquantized payload."""
        return HEADER.size + self.layout.payload_nbytes(Quant.NONE)

    def payload(self, buf: bytearray) -> torch.Tensor:  # (L, 2, BS, Hkv, D)
        """A tensor over the payload of `buf` (raw_nbytes long), to copy a block into: the
        one copy out of the pool goes straight into the bytes that go on the wire."""
        lay = self.layout
        return torch.frombuffer(buf, dtype=lay.dtype, count=lay.numel, offset=HEADER.size).view(lay.shape)

    def seal(self, buf: bytearray, block_id: str, expires_at: float) -> bytearray:
        """Quantize if configured, then write the header and checksum.

        `buf` holds the block as payload() wrote it. Unquantized, it is sealed in place and
        returned; INT8 returns a new, smaller buffer and leaves `buf` free for reuse.
        """
        lay = self.layout
        if self.quant is Quant.INT8:
            q, scale = self.kernels.quantize_int8(self.payload(buf))  # (L, 2, BS, Hkv, D) int8, (L, 2, BS, Hkv) float32
            rows = lay.numel // lay.head_dim
            buf = bytearray(HEADER.size + lay.payload_nbytes(Quant.INT8))
            torch.frombuffer(buf, dtype=torch.int8, count=lay.numel, offset=HEADER.size).copy_(q.reshape(-1))
            torch.frombuffer(buf, dtype=torch.float32, count=rows, offset=HEADER.size + lay.numel).copy_(scale.reshape(-1))
        payload_len = len(buf) - HEADER.size
        HEADER.pack_into(
            buf, 0, MAGIC, VERSION, _DTYPE_CODES[lay.dtype], _QUANT_CODES[self.quant],
            lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim,
            self._model_digest, digest(block_id), payload_len, 0, expires_at,
        )
        view = memoryview(buf)
        crc = _checksum(view)
        struct.pack_into("<I", buf, _CHECKED, crc)
        return buf

    def seal_parts(self, payload: Sequence[Buffer], block_id: str, expires_at: float) -> bytearray:
        """The header of an unquantized blob whose payload is `payload`, in layout order
        and left where it is (the pool's blocks, sent as they are): header + payload
        is the same blob `seal` makes of a copy."""
        lay = self.layout
        header = bytearray(HEADER.size)
        HEADER.pack_into(
            header, 0, MAGIC, VERSION, _DTYPE_CODES[lay.dtype], _QUANT_CODES[Quant.NONE],
            lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim,
            self._model_digest, digest(block_id), lay.payload_nbytes(Quant.NONE), 0, expires_at,
        )
        value = crc32c.crc32c(memoryview(header)[:_CHECKED])
        for part in payload:
            value = crc32c.crc32c(part, value=value)
        struct.pack_into("<I", header, _CHECKED, value)
        return header

    # --- read -----------------------------------------------------------------------
    def open(self, raw: Buffer, block_id: str) -> KVBlob:
        """Validate `raw` as the blob of `block_id`; raises BlobError naming the first failed check."""
        quant, crc, expires_at = self._check_header(raw, len(raw), block_id)
        if _checksum(memoryview(raw)) != crc:
            raise BlobError("checksum", "crc32c mismatch")
        return KVBlob(self.layout, quant, raw, expires_at, self.kernels)

    def open_parts(self, header: Buffer, payload: Sequence[Buffer], block_id: str) -> float:
        """Validate a blob read in parts (its header, then its payload straight into the
        pool's blocks, in layout order): its logical expiry, or BlobError. The bytes are
        already in place, so a failure means the blocks hold garbage: the caller must
        not use them (they are recomputed)."""
        quant, crc, expires_at = self._check_header(header, len(header) + sum(len(p) for p in payload), block_id)
        if quant is not Quant.NONE:
            raise BlobError("quantization", "an INT8 blob cannot be read in place")
        value = crc32c.crc32c(memoryview(header)[:_CHECKED])
        for part in payload:
            value = crc32c.crc32c(part, value=value)
        if value != crc:
            raise BlobError("checksum", "crc32c mismatch")
        return expires_at

    def _check_header(self, raw: Buffer, total: int, block_id: str) -> tuple[Quant, int, float]:
        """Every check but the checksum, on a blob of `total` bytes whose header is at
        the start of `raw`: its quantization, its stored crc32c and its logical expiry."""
        if len(raw) < HEADER.size:
            raise BlobError("truncated", f"{total} bytes, header alone is {HEADER.size}")
        (magic, version, dtype_code, quant_code, layers, bs, hkv, d,
         model, block, payload_len, crc, expires_at) = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise BlobError("magic", repr(magic))
        if version != VERSION:
            raise BlobError("version", str(version))
        if model != self._model_digest:
            raise BlobError("model", "written by another model fingerprint")
        if block != digest(block_id):
            raise BlobError("block", f"stored under {block_id} but written for another block")
        lay = self.layout
        if _DTYPES.get(dtype_code) != lay.dtype:
            raise BlobError("dtype", f"code {dtype_code}, pool is {lay.dtype}")
        quant = _QUANTS.get(quant_code)
        if quant is None:
            raise BlobError("quantization", f"unknown code {quant_code}")
        if (layers, bs, hkv, d) != (lay.num_layers, lay.block_size, lay.num_kv_heads, lay.head_dim):
            raise BlobError("shape", f"(L, BS, Hkv, D) = {(layers, bs, hkv, d)}, pool has {lay.shape[:1] + lay.shape[2:]}")
        if payload_len != lay.payload_nbytes(quant) or total != HEADER.size + payload_len:
            raise BlobError("truncated", f"{total - HEADER.size} payload bytes, expected {lay.payload_nbytes(quant)}")
        return quant, crc, expires_at
