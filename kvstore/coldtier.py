"""The KV cold tier: full blocks of the engine's paged pool, kept in Redis.

    evict  (engine thread)  spill(hash, block_id): copy the block out of the pool into
                            a wire buffer, queue it; a writer thread seals (quantize,
                            header, crc32) and writes batches in pipelines
    admit  (engine thread)  load(hashes, block_ids): one MGET for the missing prefix,
                            the longest run of valid consecutive hits copied into
                            the blocks the engine allocated for them
    fleet  (task thread)    ensure_prefix(hashes, prefill): when several workers miss
                            the same prefix, one prefills it and writes it, the
                            others wait and then load it

Keys are `Keys.kv_block(model_fingerprint, block_hash)`: a block hash chains all the
tokens before it, so one key names one immutable K/V content for one model.
Because that content never changes, a block past its logical expiry is still
correct: a reader loads it and extends its life (a touch), it is never rebuilt.
Logical expiry + grace and jitter then decide only how long unused blocks occupy
memory, with the instance's `allkeys-lru` as the hard bound.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from enum import Enum
from typing import Callable, Optional, Sequence, Union

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kernels.ops import Kernels
from kvfleet.constants import Keys
from kvstore import metrics
from kvstore.blob import EXPIRES_AT, EXPIRES_AT_OFFSET, BlobCodec, KVBlob, KVLayout, Quant
from kvstore.buffers import BufferPool
from kvstore.errors import BlobError
from kvstore.expiry import DEFAULT_JITTER, jittered, physical_ttl_ms
from kvstore.singleflight import NO_VALUE, Entry, NoValueType, SingleFlight
from kvstore.spill import SpillQueue

log = logging.getLogger(__name__)

BlockHash = Union[int, str, bytes]
KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: (NB, BS, Hkv, D) each

# Extend a stale block's life in place, only if it still exists: SETRANGE on a missing
# key would create a zero-filled key with no TTL.
_TOUCH = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('SETRANGE', KEYS[1], ARGV[1], ARGV[2])
  return redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 0
"""


class PrefixSource(str, Enum):
    COLD = "cold"  # in the cold tier (stored before, or by another worker): load() it
    BUILT = "built"  # this caller ran prefill()


def connect(url: str, *, timeout_s: float = 1.0) -> redis.Redis:
    """A client for the cold tier (settings.redis.cache_url) that fails fast.

    load() runs on the engine's step thread: redis-py's default retries with backoff
    would stall every running sequence for seconds while Redis is down, where a miss
    only costs a recompute. One immediate retry covers a pooled connection that went
    stale across a Redis restart.
    """
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 1))


def hash_id(block_hash: BlockHash) -> str:
    """The block hash as it appears in keys: str as is, bytes in hex, int in hex."""
    if isinstance(block_hash, bytes):
        return block_hash.hex()
    if isinstance(block_hash, int):
        return format(block_hash, "x")
    return block_hash


class ColdTier:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        model_fingerprint: str,
        kv_caches: KVCaches,
        *,
        kernels: Kernels,
        quant: Quant,
        ttl_s: float,
        grace_s: float,
        spill_max_bytes: int,
        jitter: float = DEFAULT_JITTER,
        spill_batch: int = 8,
        lock_client: Optional[redis.Redis] = None,
        lock_ttl_s: float = 10.0,
        wait_timeout_s: float = 60.0,
        poll_s: float = 0.1,
        use_lock: bool = True,
    ) -> None:
        """`client` is the cache instance, from connect(). `kv_caches` is the
        engine's pool, one (k_cache, v_cache) pair per layer; blocks are copied out of
        and into it by block id. `kernels`: the engine's (INT8 quantize and dequantize).

        quant, ttl_s, grace_s, spill_max_bytes: kvfleet.settings.ColdTierSettings, where
        their defaults and reasons are.
        lock_* / wait_timeout_s / poll_s / use_lock: the prefix build, see SingleFlight;
            wait_timeout_s should exceed the longest prefill of a shared prefix.
        """
        self.client = client
        self.keys = keys
        self.model_fingerprint = model_fingerprint
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        self.codec = BlobCodec(self.layout, model_fingerprint, quant=quant, kernels=kernels)
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.jitter = jitter
        self._touch = client.register_script(_TOUCH)
        # Enough free buffers for the batches in flight; more would only hold idle memory.
        self._buffers = BufferPool(self.codec.raw_nbytes, keep=4 * spill_batch)
        self.flight = SingleFlight(
            lock_client or client, name="kv_prefix", lock_ttl_s=lock_ttl_s,
            wait_timeout_s=wait_timeout_s, poll_s=poll_s, early_refresh_beta=0.0, use_lock=use_lock,
        )
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-seal")
        self.spill_queue: SpillQueue[tuple[str, bytearray]] = SpillQueue(
            self._write_batch, max_bytes=spill_max_bytes, max_batch=spill_batch, name="kv-spill"
        )
        metrics.KV_SPILL_QUEUE_BYTES.set_function(lambda: self.spill_queue.pending_bytes)

    def key(self, block_hash: BlockHash) -> str:
        return self.keys.kv_block(self.model_fingerprint, hash_id(block_hash))

    # --- eviction side ---------------------------------------------------------------
    def spill(self, block_hash: BlockHash, block_id: int) -> bool:
        """Copy block `block_id` out of the pool now and write it later; never waits on Redis.

        Must run before the block is reused (the engine's eviction hook). False when the
        spill queue is full: the block is dropped and counted, the engine goes on.
        """
        # What one queued spill holds: a header and the unquantized block (quantization,
        # if any, happens later on the writer's side).
        nbytes = self.codec.raw_nbytes
        if not self.spill_queue.has_room(nbytes):
            metrics.KV_SPILL_DROPPED.labels("queue_full").inc()
            return False
        item = (hash_id(block_hash), self._copy_out(block_id))
        if not self.spill_queue.offer(item, nbytes):  # filled up since has_room: still a drop
            metrics.KV_SPILL_DROPPED.labels("queue_full").inc()
            return False
        return True

    def copy_out(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> list[tuple[str, bytearray]]:
        """The blocks' bytes, copied out of the pool. Must run where the pool is still
        (the engine's step thread); `write` them from any thread afterwards."""
        return [(hash_id(h), self._copy_out(b)) for h, b in zip(block_hashes, block_ids)]

    def write(self, items: list[tuple[str, bytearray]]) -> None:
        """Write copied-out blocks now, in this thread, in one pipeline; raises if Redis
        fails. For a prefill whose waiters load the blocks the moment it returns (see
        ensure_prefix)."""
        self._write_batch(items, raise_errors=True)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for queued spills to be written; False on timeout."""
        return self.spill_queue.flush(timeout_s)

    def close(self) -> None:
        self.spill_queue.close()
        self._sealer.shutdown()

    def _copy_out(self, block_id: int) -> bytearray:
        buf = self._buffers.take()
        kv = self.codec.payload(buf)  # (L, 2, BS, Hkv, D) over buf's payload, on the host
        parts = [cache[block_id] for pair in self.kv_caches for cache in pair]  # 2L × (BS, Hkv, D), K before V
        if parts[0].device.type == "cpu":
            # One op gathers all layers straight into the wire buffer: twice as fast as
            # 2L separate copy_ calls, each of which pays dispatch and the GIL.
            torch.stack(parts, out=kv.view(-1, *kv.shape[2:]))  # (2L, BS, Hkv, D)
        else:
            kv.copy_(torch.stack(parts).view(kv.shape))  # gather on the device, then one device → host copy
        return buf

    def _seal(self, block: str, buf: bytearray) -> tuple[str, bytearray, int]:
        logical_s = jittered(self.ttl_s, self.jitter)
        blob = self.codec.seal(buf, block, time.time() + logical_s)
        return self.keys.kv_block(self.model_fingerprint, block), blob, physical_ttl_ms(logical_s, self.grace_s)

    def _write_batch(self, items: list[tuple[str, bytearray]], *, raise_errors: bool = False) -> None:
        """Seal and SET a batch (the spill thread, or write()).

        Blobs are sealed on the sealer thread while this one sends those already sealed:
        block i+1's crc32 (or quantization) overlaps block i's socket write, and both
        release the GIL. Each send takes every blob ready by then: one pipelined round
        trip for all of them.
        """
        sealing = [self._sealer.submit(self._seal, block, buf) for block, buf in items]
        sent = 0
        try:
            while sent < len(sealing):
                ready = [sealing[sent].result()]
                ready += [f.result() for f in itertools.takewhile(Future.done, sealing[sent + 1:])]
                pipe = self.client.pipeline(transaction=False)
                for key, blob, px in ready:
                    pipe.set(key, memoryview(blob), px=px)  # memoryview: sent as is, not joined into a copy
                pipe.execute()
                sent += len(ready)
                metrics.KV_SPILLED_BLOCKS.inc(len(ready))
                metrics.KV_SPILLED_BYTES.inc(sum(len(blob) for _, blob, _ in ready))
        except redis.RedisError:
            metrics.KV_SPILL_DROPPED.labels("error").inc(len(items) - sent)
            if raise_errors:
                raise
            log.warning("spill batch failed; blocks dropped", extra={"blocks": len(items) - sent}, exc_info=True)
        finally:
            wait(sealing)  # after a failed send some may still be sealing into their buffer
            for _, buf in items:
                self._buffers.give(buf)  # sent (or dropped): safe to overwrite

    # --- admission side --------------------------------------------------------------
    def fetch(self, block_hashes: Sequence[BlockHash]) -> list[KVBlob]:
        """The longest run of valid blobs from the start of `block_hashes`, in one MGET.

        A hole ends the run: block i is only useful if blocks 0..i-1 are loaded too.
        Invalid blobs are deleted (a miss, never loaded); stale ones are touched.
        """
        if not block_hashes:
            return []
        ids = [hash_id(h) for h in block_hashes]
        keys = [self.keys.kv_block(self.model_fingerprint, i) for i in ids]
        raws = self.client.mget(keys)
        blobs: list[KVBlob] = []
        rejected: list[str] = []
        for key, block, raw in zip(keys, ids, raws):
            if raw is None:
                break
            try:
                blobs.append(self.codec.open(raw, block))
            except BlobError as exc:
                metrics.KV_REJECTED.labels(exc.reason).inc()
                log.warning("rejected a cold-tier blob; deleting it", extra={"key": key, "reason": str(exc)})
                rejected.append(key)
                break
        self._repair(rejected, [key for key, blob in zip(keys, blobs) if blob.expires_at <= time.time()])
        metrics.KV_LOOKUP_BLOCKS.labels("hit").inc(len(blobs))
        metrics.KV_LOOKUP_BLOCKS.labels("miss").inc(len(ids) - len(blobs))
        metrics.KV_LOADED_BYTES.inc(sum(blob.nbytes for blob in blobs))
        return blobs

    def copy_in(self, blobs: Sequence[KVBlob], block_ids: Sequence[int]) -> None:
        """Copy each blob into its block of the pool."""
        for blob, block_id in zip(blobs, block_ids, strict=True):
            kv = blob.tensor(self.kv_caches[0][0].device)  # (L, 2, BS, Hkv, D)
            for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
                k_cache[block_id].copy_(kv[layer, 0])
                v_cache[block_id].copy_(kv[layer, 1])

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Callable[[int], Sequence[int]]) -> int:
        """Fill the leading blocks of a prefix from the cold tier; how many were filled.

        `block_ids(n)` is called once, when there are n > 0 hits, and returns the pool
        blocks to copy them into. In the engine these exist already: it allocates a block
        for every missing one before its admission hook asks (kvstore/hooks.py passes
        the first n of them), and recomputes those this call leaves unfilled.
        """
        started = time.perf_counter()
        blobs = self.fetch(block_hashes)
        if blobs:
            self.copy_in(blobs, block_ids(len(blobs)))
        metrics.KV_LOAD_SECONDS.observe(time.perf_counter() - started)
        return len(blobs)

    def _repair(self, rejected: list[str], stale: list[str]) -> None:
        """Delete rejected blobs and extend stale ones, in one round trip (none if neither).

        Race: a writer may replace a rejected blob between our GET and DEL, and we
        delete a good one. That costs one recompute; loading a bad blob is never risked.
        """
        if not rejected and not stale:
            return
        pipe = self.client.pipeline(transaction=False)
        if rejected:
            pipe.delete(*rejected)
        for key in stale:
            logical_s = jittered(self.ttl_s, self.jitter)
            self._touch(keys=[key], client=pipe,
                        args=[EXPIRES_AT_OFFSET, EXPIRES_AT.pack(time.time() + logical_s),
                              physical_ttl_ms(logical_s, self.grace_s)])
        try:
            pipe.execute()
        except redis.RedisError:
            log.warning("could not repair cold-tier blobs", exc_info=True)  # the next reader retries

    # --- one prefill per prefix across the fleet -------------------------------------
    def ensure_prefix(self, block_hashes: Sequence[BlockHash], prefill: Callable[[], None]) -> PrefixSource:
        """Make sure a prefix's blocks are in the cold tier, prefilling it at most once fleet-wide.

        `prefill()` must compute the blocks and `write()` them before it returns. COLD:
        the blocks are in Redis, `load()` them (a load that still comes up short, e.g.
        after an eviction, means prefill locally). BUILT: this caller ran `prefill()`.
        """
        keys = [self.key(h) for h in block_hashes]
        lock_key = self.keys.lock(f"prefix:{self.model_fingerprint}:{hash_id(block_hashes[-1])}")

        def lookup() -> Union[Entry[PrefixSource], NoValueType]:
            # EXISTS counts the keys that exist: one cheap round trip, no blob bytes.
            # Content never goes stale, hence an infinite logical expiry.
            present = self.client.exists(*keys) == len(keys)
            return Entry(PrefixSource.COLD, math.inf) if present else NO_VALUE

        def build() -> PrefixSource:
            prefill()
            return PrefixSource.BUILT

        return self.flight.run(lock_key, lookup, build)
