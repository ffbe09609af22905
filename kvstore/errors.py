"""The kvstore error tree: one base class, so callers can catch the whole family."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class BlobError(KVStoreError):
    """A cold-tier blob failed validation; it is a miss, never loaded into a tensor.

    `reason` is a short label (also the metric label): magic, version, truncated,
    model, block, dtype, shape, quantization, checksum.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
