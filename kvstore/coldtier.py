"""The KV cold tier: full blocks of the engine's paged pool, kept in Redis.

    evict  (engine thread)  spill(hash, block_id): copy the block out of the pool into
                            a wire buffer, queue it; a writer thread writes batches
                            over a few connections, each sealing (quantize, header,
                            crc32c) what it sends (kvstore/wire.py). Or lend(...):
                            queue the block id alone, and the writer sends the block
                            straight from the pool, which reuses it once given back
    fetch  (task thread)    fetch_into(hashes, block_ids): pipelined GETs of a job's
                            missing prefix while the job waits, received straight
                            into pool blocks the engine set aside for it and validated
                            there; the engine then adopts them into its hot tier, so
                            admission finds them cached: no Redis and no copy on the
                            step thread, and a running batch never waits on a load
                            (load() does the GETs and the copy there, for callers
                            without a task thread)
    fleet  (task thread)    ensure_prefix(hashes, prefill, first_missing): when several
                            workers miss the same blocks, one prefills them and writes
                            them, the others wait and then load them

Keys are `Keys.kv_block(namespace, block_hash)`, the namespace being the model
fingerprint and the pool layout (`KVLayout.tag`: dtype, layers, block size, heads, head
dim): a block hash chains all the tokens before it, so one key names one immutable K/V
content for one model in one layout, and workers of other dtypes never meet it.
Because that content never changes, a block past its logical expiry is still
correct: it is served, and exactly one reader extends its life (a touch, under a short
refresh lease), never rebuilds it. XFetch makes that reader refresh a popular prefix a
little before its expiry, with δ the prefix's recompute time. Logical expiry + grace
and jitter then decide only how long unused blocks occupy memory, and popular prefixes
written together do not all expire together; the instance's `allkeys-lru` is the hard
bound.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional, Sequence, Union

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kernels.ops import Kernels
from kvfleet.constants import Keys
from kvfleet.scriptbatch import ScriptBatch
from kvstore import metrics
from kvstore.blob import EXPIRES_AT, EXPIRES_AT_OFFSET, HEADER, BlobCodec, KVBlob, KVLayout, Quant
from kvstore.blob import VERSION as BLOB_VERSION
from kvstore.buffers import BufferPool
from kvstore.errors import BlobError
from kvstore.expiry import DEFAULT_JITTER, jittered, physical_ttl_ms, xfetch_due
from kvstore.lock import Lease
from kvstore.singleflight import NO_VALUE, Entry, Held, NoValueType, SingleFlight
from kvstore.spill import SpillQueue
from kvstore.wire import Wire

log = logging.getLogger(__name__)

#: The most bytes of free read buffers a tier keeps for its next loads.
READ_BUFFERS_BYTES = 256 << 20
#: A load spreads over another connection per this many bytes: below it, the thread
#: hand-off costs more than the parallel read gains (a 1,024-token prefix of the bench
#: model is 4 MiB; of an 8B model, 128 MiB).
BYTES_PER_CONNECTION = 8 << 20

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

# How many of KEYS, from the first, exist: one command however long the prompt, where a
# pipeline of EXISTS costs the client a command's packing and parsing per block.
_PRESENT_RUN = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 0 then return i - 1 end
end
return #KEYS
"""


class _Loan:
    """A block spilled straight from a CPU pool: the engine lent it (on_evict returned
    True) and reuses it after `give_back`, unless it `reclaim`s it before its write
    began; then `copy` holds what the writer sends instead."""

    __slots__ = ("block", "block_id", "give_back", "sending", "copy")

    def __init__(self, block: str, block_id: int, give_back: Callable[[int], None]) -> None:
        self.block, self.block_id, self.give_back = block, block_id, give_back
        self.sending = False
        self.copy: Optional[bytearray] = None


SpillItem = Union[tuple[str, bytearray], _Loan]


class PrefixSource(str, Enum):
    COLD = "cold"  # in the cold tier (stored before, or by another worker): load() it
    BUILT = "built"  # this caller ran prefill()


@dataclass(frozen=True)
class PrefixBuild:
    """A prefix this caller builds, claimed by `ColdTier.claim_prefixes`."""

    held: Held
    marker: str  # hash_id of its first missing block: the key write() holds back


def connect(url: str, *, timeout_s: float = 1.0) -> redis.Redis:
    """A client for the cold tier (settings.redis.cache_url) that fails fast.

    load() runs on the engine's step thread: redis-py's default retries with backoff
    would stall every running sequence for seconds while Redis is down, where a miss
    only costs a recompute. One immediate retry covers a pooled connection that went
    stale across a Redis restart.
    """
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(NoBackoff(), 1))


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor, to receive into."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


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
        refresh_beta: float = 1.0,
        connections: int = 4,
    ) -> None:
        """`client` is the cache instance, from connect(). `kv_caches` is the
        engine's pool, one (k_cache, v_cache) pair per layer; blocks are copied out of
        and into it by block id. `kernels`: the engine's (INT8 quantize and dequantize).

        quant, ttl_s, grace_s, spill_max_bytes: kvfleet.settings.ColdTierSettings, where
        their defaults and reasons are.
        lock_* / wait_timeout_s / poll_s / use_lock: the prefix build, see SingleFlight;
            wait_timeout_s should exceed the longest prefill of a shared prefix.
        connections: how many connections a load uses at once, and spill writer threads
            (one connection each).
        spill_batch: the most spills a writer sends in one pipelined round trip.
        """
        self.client = client
        self.keys = keys
        self.model_fingerprint = model_fingerprint
        self.kv_caches = kv_caches
        self.layout = KVLayout.of(kv_caches)
        #: Keys and prefix locks live under this: a bf16 worker and an fp32 worker of the
        #: same model must not share (and reject, and delete) each other's blobs.
        self.namespace = f"{model_fingerprint}:{self.layout.tag}-v{BLOB_VERSION}"
        self.codec = BlobCodec(self.layout, model_fingerprint, quant=quant, kernels=kernels)
        self.ttl_s = ttl_s
        self.grace_s = grace_s
        self.jitter = jitter
        self._touch = client.register_script(_TOUCH)
        self._present_run = client.register_script(_PRESENT_RUN)
        #: The lookups of jobs arriving together (one Celery message's) share a round trip.
        self._lookups = ScriptBatch(client)
        # Enough free buffers for the batches in flight (copied spills: a GPU's or an
        # INT8 tier's, and the builder's writes), up to READ_BUFFERS_BYTES idle.
        self._buffers = BufferPool(self.codec.raw_nbytes, keep=max(
            4, min(spill_batch * connections, READ_BUFFERS_BYTES // self.codec.raw_nbytes)))
        # Loads read into reused buffers too (kvstore/wire.py says why), up to
        # READ_BUFFERS_BYTES of them kept idle; a blob of another size gets a fresh one.
        self._read_buffers = BufferPool(self.blob_nbytes, keep=max(4, READ_BUFFERS_BYTES // self.blob_nbytes))
        # A CPU pool's 2L tensors as flat bytes, sliced per block to receive into (fetch_into).
        caches = [cache for pair in kv_caches for cache in pair]  # K before V, layer by layer
        if caches[0].device.type == "cpu" and all(c.is_contiguous() for c in caches):
            self._pool_bytes: Optional[list[memoryview]] = [_byte_view(c) for c in caches]
            self._block_part_bytes = caches[0][0].numel() * caches[0].element_size()  # (BS, Hkv, D) of one
        else:
            self._pool_bytes = None
        self.flight = SingleFlight(
            lock_client or client, name="kv_prefix", lock_ttl_s=lock_ttl_s,
            wait_timeout_s=wait_timeout_s, poll_s=poll_s, early_refresh_beta=0.0, use_lock=use_lock,
            # Nearly every prompt is unique: its miss need not look again under the lock
            # unless a build of the same prefix wrote its blocks lately (see SingleFlight).
            recheck="after_builds",
        )
        self._lock_client = lock_client or client
        #: Loads and spills go over this many connections at once, validating (or
        #: sealing) as they go (kvstore/wire.py): redis-py's own parser and packer
        #: moved about a third of what the socket can. Two of them, so that a batch of
        #: spills never queues a job's load behind it.
        self._reader = Wire(client, connections)
        self._writer = Wire(client, connections)
        #: One fetch at a time per worker. Fetches running at once fight over the GIL
        #: with each other and with the engine's step thread, which takes it back at
        #: every torch op: six jobs' concurrent fetches stalled decoding for 79 ms, where
        #: one after another they took 22 ms in all.
        self._fetching = threading.Lock()
        #: XFetch's β for the early refresh of popular prefixes (kvstore/expiry.py).
        self.refresh_beta = refresh_beta
        # The first missing block of each prefix ensure_prefix is building here: the
        # key its waiters look for, so write() stores it after the rest; and those of
        # them write() has stored, so the flight knows its build left something to find.
        self._building: dict[str, int] = {}
        self._written: set[str] = set()
        self._building_lock = threading.Lock()
        # Blocks on loan from the engine's pool by block id (lend), and the condition
        # under which a writer and the engine's reclaim agree who has one.
        self._loans: dict[int, _Loan] = {}
        self._loans_changed = threading.Condition()
        #: Blocks the spill writers send at once, one batch each.
        self.spill_in_flight = spill_batch * connections
        self.spill_queue: SpillQueue[SpillItem] = SpillQueue(
            # One writer thread per connection, each sending its own small batch in its
            # own thread: no batch waits for the slowest connection of another.
            lambda items: self._write_batch(items, connections=1), max_bytes=spill_max_bytes,
            max_batch=spill_batch, writers=connections, name="kv-spill"
        )
        metrics.KV_SPILL_QUEUE_BYTES.set_function(lambda: self.spill_queue.pending_bytes)

    def key(self, block_hash: BlockHash) -> str:
        return self.keys.kv_block(self.namespace, hash_id(block_hash))

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

    @property
    def can_lend(self) -> bool:
        """Whether `lend` can send this pool's blocks as they are: an unquantized CPU
        pool (a GPU's blocks are copied to the host, an INT8 blob is quantized first)."""
        return self._pool_bytes is not None and self.codec.quant is Quant.NONE

    def lend(self, block_hash: BlockHash, block_id: int, give_back: Callable[[int], None]) -> bool:
        """Spill block `block_id` straight from the pool: no copy on the engine's thread
        (a 2 MiB block's gather out of the pool took that thread 0.5-1.2 ms here). True:
        the block is on loan until `give_back(block_id)` is called, from a writer thread,
        once it is sent, or until the engine `reclaim`s it. False: dropped and counted
        (the queue is full), the block is free at once. Only where `can_lend`."""
        nbytes = self.codec.raw_nbytes  # what the queue bounds: the block's bytes stay taken until sent
        loan = _Loan(hash_id(block_hash), block_id, give_back)
        with self._loans_changed:
            self._loans[block_id] = loan
        if self.spill_queue.offer(loan, nbytes):
            return True
        with self._loans_changed:
            del self._loans[block_id]
        metrics.KV_SPILL_DROPPED.labels("queue_full").inc()
        return False

    def reclaim(self, block_id: int) -> bool:
        """The engine needs a lent block back now (nothing else in its pool is free).
        True: it was still queued, so it is copied out here, the copy is sent instead,
        and it is the engine's again. False: it is given back, by now or, if it was
        being sent, once sent (waited for here: at most the socket's timeout)."""
        with self._loans_changed:
            loan = self._loans.get(block_id)
            if loan is None:
                return False
            metrics.KV_SPILL_RECLAIMED.inc()
            if loan.sending:
                while loan.sending:
                    self._loans_changed.wait()
                return False
            loan.copy = self._copy_out(block_id)
            del self._loans[block_id]  # so the writer sends the copy and gives nothing back
            return True

    def copy_out(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> list[tuple[str, bytearray]]:
        """The blocks' bytes, copied out of the pool. Must run where the pool is still
        (the engine's step thread); `write` them from any thread afterwards."""
        return [(hash_id(h), self._copy_out(b)) for h, b in zip(block_hashes, block_ids)]

    def write(self, items: list[tuple[str, bytearray]]) -> None:
        """Write copied-out blocks now, in this thread; raises if Redis fails. For a
        prefill whose waiters load the blocks the moment it returns (see ensure_prefix).

        A block that marks a prefix this tier is building goes last, once the others
        are stored: the blocks go over several connections in no set order, and a
        caller arriving mid-write that saw the marker would load a partial prefix."""
        with self._building_lock:
            markers = set(self._building)
        rest = [item for item in items if item[0] not in markers]
        last = [item for item in items if item[0] in markers]
        for part in (rest, last):
            if part:
                self._write_batch(part, raise_errors=True)
        if last:
            with self._building_lock:
                self._written.update(item[0] for item in last if item[0] in self._building)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for queued spills to be written; False on timeout."""
        return self.spill_queue.flush(timeout_s)

    def close(self) -> None:
        self.spill_queue.close()
        self._reader.close()
        self._writer.close()

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

    def _seal(self, item: SpillItem) -> tuple[str, Union[bytearray, list], int]:
        logical_s = jittered(self.ttl_s, self.jitter)
        expires_at, px = time.time() + logical_s, physical_ttl_ms(logical_s, self.grace_s)
        if isinstance(item, _Loan):
            with self._loans_changed:
                item.sending = item.copy is None
            if item.sending:  # from the pool as it is: the header, then the block's 2L parts
                n = self._block_part_bytes
                parts = [pool[item.block_id * n:(item.block_id + 1) * n] for pool in self._pool_bytes]
                return (self.keys.kv_block(self.namespace, item.block),
                        [self.codec.seal_parts(parts, item.block, expires_at), *parts], px)
            block, buf = item.block, item.copy  # reclaimed before its turn: its copy goes
        else:
            block, buf = item
        return self.keys.kv_block(self.namespace, block), self.codec.seal(buf, block, expires_at), px

    def _write_batch(self, items: list[tuple[str, bytearray]], *, raise_errors: bool = False,
                     connections: Optional[int] = None) -> None:
        """Seal and SET a batch (a spill thread, or write()) over up to `connections` of
        the writer's connections, each sealing its blobs as it sends them, so one
        block's crc32c (or quantization) overlaps another's socket write; both release
        the GIL."""
        try:
            self._writer.set_many(items, self._seal, connections=connections)
            metrics.KV_SPILLED_BLOCKS.inc(len(items))
            metrics.KV_SPILLED_BYTES.inc(len(items) * self.blob_nbytes)
        except redis.RedisError:
            # Some may have been written; none is known to be, so all count as dropped.
            metrics.KV_SPILL_DROPPED.labels("error").inc(len(items))
            if raise_errors:
                raise
            log.warning("spill batch failed; blocks dropped", extra={"blocks": len(items)}, exc_info=True)
        finally:
            for item in items:  # sent (or dropped): safe to overwrite
                if isinstance(item, _Loan):
                    self._end_loan(item)
                else:
                    self._buffers.give(item[1])

    def _end_loan(self, loan: _Loan) -> None:
        with self._loans_changed:
            if self._loans.get(loan.block_id) is loan:
                del self._loans[loan.block_id]
                loan.give_back(loan.block_id)  # under the lock: a reclaim after this finds it gone
            loan.sending = False
            self._loans_changed.notify_all()
        if loan.copy is not None:
            self._buffers.give(loan.copy)

    # --- admission side --------------------------------------------------------------
    def fetch(self, block_hashes: Sequence[BlockHash], *, rebuild_s: float = 0.0) -> list[KVBlob]:
        """The longest run of valid blobs from the start of `block_hashes`, in one round
        trip on each of a few connections (pipelined GETs, kvstore/wire.py).

        A hole ends the run: block i is only useful if blocks 0..i-1 are loaded too.
        Invalid blobs are deleted (a miss, never loaded). A run past its logical expiry
        (or, by XFetch, close to it, `rebuild_s` being what a miss would cost) is still
        returned, and extended by one reader only (`_refresh`).

        The blobs' buffers are the tier's to reuse: `release` them once copied in.
        """
        ids = [hash_id(h) for h in block_hashes]

        def check(i: int, raw: Optional[bytearray]) -> tuple[Optional[bytearray], Union[KVBlob, BlobError, None]]:
            # In the reading thread: block i's crc32c runs while the next block arrives.
            if raw is None:
                return None, None
            try:
                return raw, self.codec.open(raw, ids[i])
            except BlobError as exc:
                return raw, exc

        keys, found = self._get(ids, check, lambda _i, n: self._take_read_buffer(n))
        outcomes = [(r.expires_at, r.nbytes) if isinstance(r, KVBlob) else (r, 0) for _, r in found]
        n = self._leading_run(ids, keys, outcomes, rebuild_s)
        for raw, _ in found[n:]:  # after a hole, or rejected: never loaded
            if raw is not None:
                self._read_buffers.give(raw)
        return [blob for _, blob in found[:n]]

    def fetch_into(self, block_hashes: Sequence[BlockHash], block_ids: Sequence[int], *,
                   rebuild_s: float = 0.0) -> tuple[int, int]:
        """Read the leading run of `block_hashes` straight into pool blocks `block_ids`
        (one each, held by the caller and by nobody else, so no step reads or writes
        them meanwhile): how many of the leading blocks now hold valid K/V, and the bytes
        read. For the job's task thread: the engine then adopts the blocks into its
        hot tier (BlockManager.adopt), so admission finds them cached and copies nothing.

        On a CPU pool an unquantized blob's payload is received in place, 2L parts into
        the 2L tensors of its block, and validated there (a block that fails holds
        garbage, and is not counted: the caller frees it). Other blobs (INT8, or a GPU
        pool) are read into a buffer, validated and dequantized, and copied in here.
        Expiry, refresh and rejection are as for `fetch`."""
        ids = [hash_id(h) for h in block_hashes]
        if len(block_ids) < len(ids):
            raise ValueError(f"{len(block_ids)} blocks for {len(ids)} hashes")
        device = self.kv_caches[0][0].device
        in_place = self._pool_bytes is not None

        def take(i: int, nbytes: int) -> Union[bytearray, list]:
            if in_place and nbytes == self.codec.raw_nbytes:  # this layout, unquantized
                lo = block_ids[i] * self._block_part_bytes
                return [bytearray(HEADER.size), *(pool[lo:lo + self._block_part_bytes] for pool in self._pool_bytes)]
            return self._take_read_buffer(nbytes)

        def check(i: int, value: Union[bytearray, list, None]) -> tuple[Union[float, BlobError, None], int]:
            if value is None:
                return None, 0
            try:
                if isinstance(value, list):
                    return self.codec.open_parts(value[0], value[1:], ids[i]), self.codec.raw_nbytes
                blob = self.codec.open(value, ids[i])
                try:
                    self.copy_in([blob], [block_ids[i]])
                finally:
                    self.release([blob])
                return blob.expires_at, blob.nbytes
            except BlobError as exc:
                if not isinstance(value, list):
                    self._read_buffers.give(value)
                return exc, 0

        keys, found = self._get(ids, check, take)
        if not in_place and found and device.type == "cuda":
            torch.cuda.synchronize(device)  # the copies are done before the engine reads the blocks
        n = self._leading_run(ids, keys, found, rebuild_s)
        return n, sum(nbytes for _, nbytes in found[:n])

    def _get(self, ids: list[str], check: Callable, take: Callable) -> tuple[list[str], list]:
        """The blocks' keys, and `check`'s result for each of them (one fetch at a time)."""
        keys = [self.keys.kv_block(self.namespace, i) for i in ids]
        if not keys:
            return keys, []
        with self._fetching:
            return keys, self._reader.get_many(keys, check, take=take,
                                               connections=len(keys) * self.blob_nbytes // BYTES_PER_CONNECTION)

    def _leading_run(self, ids: list[str], keys: list[str], found: Sequence[tuple[Union[float, BlobError, None], int]],
                     rebuild_s: float) -> int:
        """How many of the read blocks, from the first, are valid (`found`: each one's
        logical expiry, BlobError or None, and its bytes); deletes a rejected blob, lets
        one reader extend a stale run, and counts it all."""
        n, rejected = 0, []
        for key, (outcome, _) in zip(keys, found):
            if outcome is None:
                break
            if isinstance(outcome, BlobError):
                metrics.KV_REJECTED.labels(outcome.reason).inc()
                log.warning("rejected a cold-tier blob; deleting it", extra={"key": key, "reason": str(outcome)})
                rejected.append(key)
                break
            n += 1
        refresh: list[str] = []
        if n:
            now, expires_at = time.time(), min(outcome for outcome, _ in found[:n])
            if now >= expires_at or xfetch_due(now, expires_at, rebuild_s, self.refresh_beta):
                refresh = self._refresh(ids[n - 1], keys[:n])
        self._repair(rejected, refresh)
        metrics.KV_LOOKUP_BLOCKS.labels("hit").inc(n)
        metrics.KV_LOOKUP_BLOCKS.labels("miss").inc(len(ids) - n)
        metrics.KV_LOADED_BYTES.inc(sum(nbytes for _, nbytes in found[:n]))
        return n

    def _take_read_buffer(self, nbytes: int) -> bytearray:
        return self._read_buffers.take() if nbytes == self._read_buffers.nbytes else bytearray(nbytes)

    def release(self, blobs: Sequence[KVBlob]) -> None:
        """Hand fetched blobs' buffers back for reuse: nothing may read them after."""
        for blob in blobs:
            if isinstance(blob.buf, bytearray):
                self._read_buffers.give(blob.buf)

    def _refresh(self, last_block: str, keys: list[str]) -> list[str]:
        """The keys to extend, if this reader is the one to do it: a short lease per
        prefix (named by its last block), left to expire rather than released, so that
        of all the readers of a popular prefix one touches it per lease period."""
        lease = Lease(self._lock_client, self.keys.lock(f"kv_refresh:{self.namespace}:{last_block}"), 5_000)
        try:
            if not lease.acquire():
                return []
        except redis.RedisError:
            return []  # the next reader tries; the grace period covers the wait
        metrics.KV_REFRESHES.inc()
        return keys

    def present_run(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of `block_hashes`, from the first, are in the tier: one script of
        EXISTS per key, stopping at the first hole, in one round trip; no blob bytes."""
        if not block_hashes:
            return 0
        return int(self._lookups.run(self._present_run, [self.key(h) for h in block_hashes]))

    def present_runs(self, runs: Sequence[Sequence[BlockHash]]) -> list[int]:
        """`present_run` of each, in one round trip for all; raises the first error."""
        replies = self._lookups.run_all([(self._present_run, [self.key(h) for h in hashes], [])
                                         for hashes in runs if hashes])
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        counts = iter(replies)
        return [int(next(counts)) if hashes else 0 for hashes in runs]

    @property
    def blob_nbytes(self) -> int:
        """Bytes of one stored block (header included), as this worker writes them."""
        return self.codec.raw_nbytes - self.layout.payload_nbytes(Quant.NONE) + self.layout.payload_nbytes(self.codec.quant)

    def copy_in(self, blobs: Sequence[KVBlob], block_ids: Sequence[int]) -> None:
        """Copy each blob into its block of the pool."""
        device = self.kv_caches[0][0].device
        blocks = []
        for blob in blobs:
            kv = blob.tensor(device)  # (L, 2, BS, Hkv, D)
            blocks.append(kv.view(-1, *kv.shape[2:]).unbind(0))  # 2L × (BS, Hkv, D), K before V
        self._copy_blocks(blocks, block_ids)

    def _copy_blocks(self, blocks: Sequence[Sequence[torch.Tensor]], block_ids: Sequence[int]) -> None:
        """All 2L tensors of every block into the pool in one op: one at a time, the
        copies cost more in dispatch (and GIL hand-offs) than in bytes."""
        caches = [cache for pair in self.kv_caches for cache in pair]  # 2L × (NB, BS, Hkv, D), K before V
        dst, src = [], []
        for parts, block_id in zip(blocks, block_ids, strict=True):
            src.extend(parts)
            dst.extend(cache[block_id] for cache in caches)
        torch._foreach_copy_(dst, src)  # the private name is the one torch has (optimizers use it)

    def load(self, block_hashes: Sequence[BlockHash], block_ids: Callable[[int], Sequence[int]]) -> int:
        """Fill the leading blocks of a prefix from the cold tier; how many were filled.

        `block_ids(n)` is called once, when there are n > 0 hits, and returns the pool
        blocks to copy them into. In the engine these exist already: it allocates a block
        for every missing one before its admission hook asks (kvstore/hooks.py passes
        the first n of them), and recomputes those this call leaves unfilled.
        """
        started = time.perf_counter()
        blobs = self.fetch(block_hashes)
        try:
            if blobs:
                self.copy_in(blobs, block_ids(len(blobs)))
        finally:
            self.release(blobs)
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
    def _prefix_lock(self, block_hashes: Sequence[BlockHash], first_missing: int) -> str:
        return self.keys.lock(f"prefix:{self.namespace}:{hash_id(block_hashes[first_missing])}")

    def prefix_waiters(self, block_hashes: Sequence[BlockHash], first_missing: int = 0) -> int:
        """How many callers wait for the prefix that `ensure_prefix` builds now (they
        listen on its lock's channel). The builder itself counts them in the release
        script (SingleFlight.release_unless_waited); this is the same count, for a look
        from outside."""
        lock_key = self._prefix_lock(block_hashes, first_missing)
        return int(dict(self._lock_client.pubsub_numsub(lock_key)).get(lock_key.encode(), 0))

    def claim_prefixes(self, prefixes: Sequence[tuple[Sequence[BlockHash], int]]) -> list[Optional["PrefixBuild"]]:
        """`ensure_prefix(hashes, ..., first_missing=i, known_missing=True, store=...)` for
        several prefixes at once, for callers that compute them without blocking (a
        message's jobs, each its own prefill): the claims are one round trip. A
        `PrefixBuild` where this caller builds (BUILT): compute the blocks, then end it
        with `finish_prefixes`; None where the caller goes through `ensure_prefix`
        instead (another builds it, or a look again is due: see SingleFlight.claim_many)."""
        markers = [hash_id(hashes[first]) for hashes, first in prefixes]
        held = self.flight.claim_many([self._prefix_lock(hashes, first) for hashes, first in prefixes])
        builds: list[Optional[PrefixBuild]] = []
        for marker, h in zip(markers, held):
            if h is not None:
                self._build_begin(marker)
            builds.append(None if h is None else PrefixBuild(h, marker))
        return builds

    def finish_prefixes(self, builds: Sequence[tuple["PrefixBuild", Callable[[], None]]]) -> None:
        """The blocks of these `claim_prefixes` builds are computed: each is written by its
        `store()` only if somebody waits for it, and every lock is released (one round
        trip for the count and the releases of all that nobody waits for)."""
        items = []
        for build, store in builds:
            wrote = [self._build_end(build.marker)]

            def store_if_waited(build: PrefixBuild = build, store: Callable[[], None] = store,
                                wrote: list[bool] = wrote) -> None:
                self._build_begin(build.marker)
                try:
                    store()
                finally:
                    wrote.append(self._build_end(build.marker))

            items.append((build.held, store_if_waited, lambda wrote=wrote: any(wrote)))
        self.flight.finish_held(items)

    def _build_begin(self, marker: str) -> None:
        """A build of the prefix ending in `marker` runs: write() holds the marker back."""
        with self._building_lock:
            self._building[marker] = self._building.get(marker, 0) + 1

    def _build_end(self, marker: str) -> bool:
        """That build is over; whether write() wrote the marker while it ran."""
        with self._building_lock:
            wrote = marker in self._written
            self._building[marker] -= 1
            if not self._building[marker]:
                del self._building[marker]
                self._written.discard(marker)
        return wrote

    def ensure_prefix(self, block_hashes: Sequence[BlockHash], prefill: Callable[[], None], *,
                      first_missing: int = 0, known_missing: bool = False,
                      store: Optional[Callable[[], None]] = None) -> PrefixSource:
        """Make sure a prefix's blocks are in the cold tier, prefilling them at most once fleet-wide.

        The flight is keyed on `block_hashes[first_missing]`, the first block that no tier
        holds: a hash chains every token before it, so all requests that share the
        prompt up to and past that block (a system prompt, a document) meet on one key,
        whatever they ask after it, and prefill the shared blocks once across the fleet;
        each then computes only its own suffix.

        `prefill()` must compute the blocks and `write()` them before it returns, or,
        with `store`, only compute them: `store()` then writes them, called only if
        somebody waits for them once they are computed (the count and, nobody waiting,
        the release are one round trip: SingleFlight's `store_if_waited`). COLD:
        the blocks are in Redis, load them (a load that still comes up short, e.g. after
        an eviction, means prefill locally). BUILT: this caller ran `prefill()`.
        `known_missing`: the caller has just found `block_hashes[first_missing]` absent
        (`present_run`), so the flight does not look again before it takes the lock,
        nor after unless a build of this prefix wrote its blocks lately (SingleFlight's
        recheck="after_builds"): a miss nobody shares costs the claim and the release.
        """
        marker = hash_id(block_hashes[first_missing])
        first = self.key(marker)
        lock_key = self._prefix_lock(block_hashes, first_missing)

        def lookup() -> Union[Entry[PrefixSource], NoValueType]:
            # The builder writes its blocks from the first missing one on, that one last
            # (write() holds it back): so that one key tells the rest are there too.
            # One EXISTS, no blob bytes; the blocks' own expiry is fetch()'s business.
            return Entry(PrefixSource.COLD, math.inf) if self.client.exists(first) else NO_VALUE

        wrote: list[bool] = []

        def building(step: Callable[[], None]) -> None:
            # While `step` runs, write() holds this prefix's marker back and notes it wrote it.
            self._build_begin(marker)
            try:
                step()
            finally:
                wrote.append(self._build_end(marker))

        def build() -> PrefixSource:
            building(prefill)
            return PrefixSource.BUILT

        # A builder nobody waited for wrote nothing: it leaves no record for the next
        # claim of this prefix to look again for (SingleFlight's recheck="after_builds").
        return self.flight.run(lock_key, lookup, build, missing=known_missing, stored=lambda: any(wrote),
                               store_if_waited=None if store is None else lambda: building(store))
