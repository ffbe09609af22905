"""kvstore.blob: the KV block format, its validation, INT8 size and error."""

from __future__ import annotations

import struct
import time

import pytest
import torch

from kernels import ops
from kvstore.blob import EXPIRES_AT, EXPIRES_AT_OFFSET, HEADER, BlobCodec, KVLayout, Quant
from kvstore.errors import BlobError

# kvstore.blob silences this at import; pytest resets warning filters per test.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
KERNELS = ops.select("auto", "paged")


def make_codec(layout: KVLayout, model: str, quant: Quant = Quant.NONE) -> BlobCodec:
    return BlobCodec(layout, model, quant=quant, kernels=KERNELS)


def sealed(codec: BlobCodec, block: str = "b1", seed: int = 0) -> tuple[bytes, torch.Tensor]:
    buf = bytearray(codec.raw_nbytes)
    kv = codec.payload(buf)
    kv.copy_(torch.randn(codec.layout.shape, generator=torch.Generator().manual_seed(seed)))  # (L, 2, BS, Hkv, D)
    original = kv.clone()
    return bytes(codec.seal(buf, block, time.time() + 60)), original


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_roundtrip_is_exact(dtype):
    codec = make_codec(KVLayout(3, 4, 2, 64, dtype), "model-a")
    raw, original = sealed(codec)
    assert len(raw) == HEADER.size + original.numel() * dtype.itemsize
    assert torch.equal(codec.open(raw, "b1").tensor(), original)


def test_header_is_80_bytes_and_keeps_the_payload_aligned():
    assert HEADER.size == 80 and HEADER.size % 16 == 0


def test_int8_halves_the_bytes_within_half_a_step():
    fp16, int8 = make_codec(LAYOUT, "m"), make_codec(LAYOUT, "m", Quant.INT8)
    raw16, original = sealed(fp16)
    buf = bytearray(int8.raw_nbytes)
    kv = int8.payload(buf)
    kv.copy_(original)
    raw8 = bytes(int8.seal(buf, "b1", time.time() + 60))
    assert len(raw8) < 0.55 * len(raw16)  # (1 + 4/D) / 2 = 0.53 at D = 64
    restored = int8.open(raw8, "b1").tensor().float()
    x = original.float()
    # Stated tolerance: half a quantization step (row absmax / 254), plus fp16 rounding.
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert ((restored - x).abs() <= step / 2 + x.abs() * 2**-10 + 1e-6).all()


def test_expiry_can_be_rewritten_in_place_without_breaking_the_checksum():
    codec = make_codec(LAYOUT, "m")
    raw, _ = sealed(codec)
    touched = bytearray(raw)
    touched[EXPIRES_AT_OFFSET:EXPIRES_AT_OFFSET + 8] = EXPIRES_AT.pack(123.0)
    assert codec.open(bytes(touched), "b1").expires_at == 123.0


def corrupt(raw: bytes) -> bytes:
    out = bytearray(raw)
    out[HEADER.size + 100] ^= 0x01  # one bit of one value
    return bytes(out)


def patch_header(raw: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(raw)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize(
    "mangle, reason",
    [
        (lambda raw: raw[:40], "truncated"),
        (lambda raw: raw[:-1], "truncated"),
        (lambda raw: raw + b"\0", "truncated"),
        (corrupt, "checksum"),
        (lambda raw: patch_header(raw, 0, "<4s", b"XXXX"), "magic"),
        (lambda raw: patch_header(raw, 4, "<B", 1), "version"),
        (lambda raw: patch_header(raw, 6, "<B", 7), "quantization"),
        (lambda raw: patch_header(raw, 7, "<B", 1), "checksum"),  # the checksum covers the header too
        (lambda raw: sealed(make_codec(LAYOUT, "model-b"))[0], "model"),
        (lambda raw: sealed(make_codec(LAYOUT, "m"), block="b2")[0], "block"),
        (lambda raw: sealed(make_codec(KVLayout(3, 4, 2, 64, torch.bfloat16), "m"))[0], "dtype"),
        (lambda raw: sealed(make_codec(KVLayout(3, 4, 4, 32, torch.float16), "m"))[0], "shape"),
        (lambda raw: sealed(make_codec(KVLayout(2, 4, 2, 64, torch.float16), "m"))[0], "shape"),
    ],
)
def test_invalid_blobs_are_rejected_with_a_reason(mangle, reason):
    codec = make_codec(LAYOUT, "m")
    raw, _ = sealed(codec)
    with pytest.raises(BlobError) as err:
        codec.open(mangle(raw), "b1")
    assert err.value.reason == reason


def test_a_layout_with_an_unsupported_dtype_fails_fast():
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 4, 2, 8, torch.int32)
