"""kvstore.coldtier and kvstore.hooks against the real cache Redis, on CPU block pools."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import REGISTRY

from kernels import ops
from kvfleet.constants import Keys
from kvfleet.settings import ColdTierSettings
from kvstore.blob import EXPIRES_AT, EXPIRES_AT_OFFSET, HEADER, BlobCodec, KVLayout, Quant
from kvstore.coldtier import ColdTier, PrefixSource, connect
from kvstore.hooks import ColdTierHooks

# kvstore.blob silences this at import; pytest resets warning filters per test.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

MODEL = "model-a"
# A GPU pool exercises the device → host gather and the on-device dequantize; CPU always.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HASHES = [f"{i:032x}" for i in range(1, 6)]  # the engine's block hashes are 32 hex chars
#: The most any wait below may take; only a broken behaviour reaches it.
TIMEOUT_S = 30.0
_SETTINGS = ColdTierSettings()
#: What every ColdTier needs: the production defaults, the kernels the engine runs by default.
TIER_OPTIONS = dict(kernels=ops.select("auto", "paged"), quant=Quant(_SETTINGS.quant), ttl_s=_SETTINGS.ttl_s,
                    grace_s=_SETTINGS.grace_s, spill_max_bytes=_SETTINGS.spill_max_bytes)


def store(tier: ColdTier, hashes, block_ids) -> None:
    """Write blocks at once, as the fleet's single-flight prefill does (workers/prefix.py)."""
    tier.write(tier.copy_out(hashes, block_ids))


def make_pool(dtype=torch.float16, *, layers=2, blocks=8, block_size=4, heads=2, dim=64, seed=0, zeros=False, device="cpu"):
    """Per layer (k, v), each (NB, BS, Hkv, D), as the engine's kv_cache."""
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, block_size, heads, dim)
    if zeros:
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(layers)]
    return [(torch.randn(shape, generator=gen).to(device, dtype), torch.randn(shape, generator=gen).to(device, dtype))
            for _ in range(layers)]


def block_of(pool, block_id: int) -> torch.Tensor:  # (L, 2, BS, Hkv, D)
    return torch.stack([torch.stack([k[block_id], v[block_id]]) for k, v in pool])


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def wait_until(condition, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


@pytest.fixture
def make_tier(cache_client, prefix):
    tiers: list[ColdTier] = []

    def make(pool, **options) -> ColdTier:
        options.setdefault("ttl_s", 60)
        tier = ColdTier(cache_client, Keys(prefix), options.pop("model", MODEL), pool, **{**TIER_OPTIONS, **options})
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_then_load_is_exact(make_tier, dtype, device):
    src, dst = make_pool(dtype, device=device), make_pool(dtype, zeros=True, device=device)
    store(make_tier(src), HASHES[:3], [1, 2, 3])
    asked = []
    loaded = make_tier(dst).load(HASHES[:3], lambda n: asked.append(n) or [5, 6, 7][:n])
    assert loaded == 3 and asked == [3]
    for src_id, dst_id in [(1, 5), (2, 6), (3, 7)]:
        assert torch.equal(block_of(dst, dst_id), block_of(src, src_id))
    assert block_of(dst, 0).abs().sum() == 0  # nothing else written


@pytest.mark.parametrize("device", DEVICES)
def test_int8_load_is_within_tolerance(make_tier, device):
    src, dst = make_pool(torch.float16, device=device), make_pool(torch.float16, zeros=True, device=device)
    store(make_tier(src, quant=Quant.INT8), HASHES[:1], [1])
    assert make_tier(dst).load(HASHES[:1], lambda n: [4]) == 1  # any reader opens int8 blobs
    x, y = block_of(src, 1).float(), block_of(dst, 4).float()
    step = x.abs().amax(dim=-1, keepdim=True) / 127  # half a step per row, plus fp16 rounding
    assert ((y - x).abs() <= step / 2 + x.abs() * 2**-10 + 1e-6).all()


def test_load_returns_the_longest_leading_run(make_tier):
    tier = make_tier(make_pool())
    store(tier, [HASHES[0], HASHES[1], HASHES[3]], [0, 1, 3])  # HASHES[2] missing
    assert tier.load(HASHES[:4], lambda n: list(range(4, 4 + n))) == 2
    assert tier.load(HASHES[2:4], lambda n: pytest.fail("nothing to allocate")) == 0


def test_loads_read_into_reused_buffers_and_each_block_lands_where_it_belongs(make_tier):
    """Every load reads into the buffers the last one handed back (a fresh 2 MiB buffer
    costs page faults and zeroing with the GIL held), and what is left of a read after a
    hole goes back too; reuse never mixes blocks up."""
    src = make_pool(seed=3)
    writer = make_tier(src)
    store(writer, [HASHES[0], HASHES[1], HASHES[3]], [0, 1, 3])  # HASHES[2] missing
    dst = make_pool(zeros=True)
    reader = make_tier(dst, connections=2)
    assert reader.load(HASHES[:4], lambda n: [4, 5][:n]) == 2  # read 3 values; the one after the hole is not used
    free = {id(b) for b in reader._read_buffers._free}
    assert len(free) == 3
    blobs = reader.fetch(HASHES[:2])
    assert {id(b.buf) for b in blobs} <= free  # the same buffers, read again
    reader.release(blobs)
    for a, b in [(0, 6), (1, 7), (0, 4), (1, 5)]:  # two more loads through the reused buffers
        assert reader.load([HASHES[a]], lambda n: [b]) == 1
    for a, b in [(0, 6), (1, 7), (0, 4), (1, 5)]:
        assert torch.equal(block_of(dst, b), block_of(src, a))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fetch_into_receives_blocks_in_place_up_to_the_first_hole(make_tier, dtype):
    src = make_pool(dtype, seed=4)
    store(make_tier(src), [HASHES[0], HASHES[1], HASHES[3]], [0, 1, 3])  # HASHES[2] missing
    dst = make_pool(dtype, zeros=True)
    tier = make_tier(dst, connections=2)
    landed, nbytes = tier.fetch_into(HASHES[:4], [4, 5, 6, 7])
    assert (landed, nbytes) == (2, 2 * tier.blob_nbytes)
    for got, want in [(4, 0), (5, 1)]:
        assert torch.equal(block_of(dst, got), block_of(src, want))
    assert len(tier._read_buffers._free) == 0  # in place: no read buffer at all


def test_fetch_into_a_corrupt_blob_is_not_counted_and_is_deleted(make_tier, cache_client):
    src = make_pool(seed=7)
    writer = make_tier(src)
    store(writer, HASHES[:2], [0, 1])
    key = writer.key(HASHES[1])
    cache_client.setrange(key, HEADER.size + 100, b"\xff\xfe")  # payload bytes: only the checksum can tell
    dst = make_pool(zeros=True)
    tier = make_tier(dst)
    before = metric("kvfleet_kv_cold_rejected_blobs_total", reason="checksum")
    assert tier.fetch_into(HASHES[:2], [4, 5]) == (1, tier.blob_nbytes)
    assert metric("kvfleet_kv_cold_rejected_blobs_total", reason="checksum") == before + 1
    assert not cache_client.exists(key)
    assert torch.equal(block_of(dst, 4), block_of(src, 0))


def test_an_int8_blob_is_fetched_through_a_buffer_and_dequantized_into_its_block(make_tier):
    src = make_pool(seed=6)
    store(make_tier(src, quant=Quant.INT8), HASHES[:2], [0, 1])
    dst = make_pool(zeros=True)
    tier = make_tier(dst)  # reads INT8 blobs whatever it writes
    landed, _ = tier.fetch_into(HASHES[:2], [4, 5])
    assert landed == 2
    for got, want in [(4, 0), (5, 1)]:
        x, y = block_of(src, want).float(), block_of(dst, got).float()
        assert ((y - x).abs() <= x.abs().amax(dim=-1, keepdim=True) / 254 + x.abs() * 2**-10 + 1e-6).all()


def test_workers_of_another_dtype_keep_apart_instead_of_deleting_each_others_blobs(make_tier, cache_client):
    """Issue 14: the key named the model only, so an fp32 worker rejected (and deleted)
    a bf16 worker's blobs for the same prefix, and the other way round: a thrash."""
    bf16, fp32 = make_tier(make_pool(torch.bfloat16)), make_tier(make_pool(torch.float32))
    assert bf16.key(HASHES[0]) != fp32.key(HASHES[0]) and "bfloat16" in bf16.key(HASHES[0])
    store(bf16, HASHES[:2], [0, 1])
    before = metric("kvfleet_kv_cold_rejected_blobs_total", reason="dtype")
    assert fp32.load(HASHES[:2], lambda n: pytest.fail("not its blobs")) == 0  # a miss, not a rejection
    assert metric("kvfleet_kv_cold_rejected_blobs_total", reason="dtype") == before
    assert bf16.load(HASHES[:2], lambda n: [4, 5][:n]) == 2  # still there for its own kind


def test_spill_copies_the_block_before_it_is_reused(make_tier):
    pool = make_pool()
    expected = block_of(pool, 2).clone()
    tier = make_tier(pool)
    assert tier.spill(HASHES[0], 2)
    for k, v in pool:  # the engine reuses block 2 right after the hook returns
        k[2].fill_(7), v[2].fill_(7)
    assert tier.flush(10)
    dst = make_pool(zeros=True)
    assert make_tier(dst).load(HASHES[:1], lambda n: [0]) == 1
    assert torch.equal(block_of(dst, 0), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_lent_block_is_sent_from_the_pool_and_given_back_once_written(make_tier, dtype):
    pool = make_pool(dtype)
    tier = make_tier(pool)
    assert tier.can_lend and not make_tier(make_pool(dtype), quant=Quant.INT8).can_lend
    given_back: list[int] = []
    assert all(tier.lend(h, i, given_back.append) for i, h in enumerate(HASHES[:3]))
    assert tier.flush(TIMEOUT_S) and sorted(given_back) == [0, 1, 2]
    dst = make_pool(dtype, zeros=True)
    assert make_tier(dst).load(HASHES[:3], lambda n: [5, 6, 7][:n]) == 3  # the same blob a copy makes
    for src_id, dst_id in [(0, 5), (1, 6), (2, 7)]:
        assert torch.equal(block_of(dst, dst_id), block_of(pool, src_id))


class _Gate:
    """Holds a tier's spill writers at one point until opened."""

    def __init__(self) -> None:
        self.reached, self.open = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.reached.set()
        assert self.open.wait(TIMEOUT_S), "the gate was never opened"


def test_a_lent_block_reclaimed_before_its_write_is_copied_and_not_given_back(make_tier, monkeypatch):
    pool = make_pool()
    expected = block_of(pool, 2).clone()
    tier = make_tier(pool, connections=1)
    gate, set_many = _Gate(), tier._writer.set_many
    monkeypatch.setattr(tier._writer, "set_many", lambda *a, **kw: (gate.hold(), set_many(*a, **kw)))
    given_back: list[int] = []
    assert tier.lend(HASHES[0], 2, given_back.append)
    assert gate.reached.wait(TIMEOUT_S)  # the writer took it, and has not begun sending it
    assert tier.reclaim(2)  # the pool's again, at once
    for k, v in pool:  # the engine reuses block 2 right away
        k[2].fill_(7), v[2].fill_(7)
    gate.open.set()
    assert tier.flush(TIMEOUT_S) and given_back == []
    dst = make_pool(zeros=True)
    assert make_tier(dst).load(HASHES[:1], lambda n: [0]) == 1
    assert torch.equal(block_of(dst, 0), expected)  # its copy was sent


def test_reclaiming_a_block_being_sent_waits_for_the_send_and_finds_it_given_back(make_tier, monkeypatch):
    pool = make_pool()
    tier = make_tier(pool, connections=1)
    gate, seal = _Gate(), tier._seal
    monkeypatch.setattr(tier, "_seal", lambda item: (seal(item), gate.hold())[0])  # sealed: about to be sent
    given_back: list[int] = []
    assert tier.lend(HASHES[0], 2, given_back.append)
    assert gate.reached.wait(TIMEOUT_S)
    answer: list[tuple[bool, list[int]]] = []
    reclaiming = threading.Thread(target=lambda: answer.append((tier.reclaim(2), list(given_back))))
    reclaiming.start()
    reclaiming.join(0.5)
    assert reclaiming.is_alive(), "reclaim returned while the block was still being sent"
    gate.open.set()
    reclaiming.join(TIMEOUT_S)
    assert answer == [(False, [2])]  # the writer gave it back before reclaim returned
    assert tier.flush(TIMEOUT_S) and tier.reclaim(2) is False


def test_a_lend_the_queue_has_no_room_for_is_dropped_and_the_block_free_at_once(make_tier):
    before = metric("kvfleet_kv_cold_spill_dropped_blocks_total", reason="queue_full")
    tier = make_tier(make_pool(), spill_max_bytes=1000)  # less than one block
    given_back: list[int] = []
    assert not tier.lend(HASHES[0], 0, given_back.append)
    assert metric("kvfleet_kv_cold_spill_dropped_blocks_total", reason="queue_full") == before + 1
    assert tier.reclaim(0) is False and given_back == []


def test_spill_drops_and_counts_when_the_queue_is_full(make_tier):
    before = metric("kvfleet_kv_cold_spill_dropped_blocks_total", reason="queue_full")
    tier = make_tier(make_pool(), spill_max_bytes=1000)  # less than one block
    assert not tier.spill(HASHES[0], 0)
    assert metric("kvfleet_kv_cold_spill_dropped_blocks_total", reason="queue_full") == before + 1


def test_spill_writes_batches_with_jittered_physical_ttls(make_tier, cache_client):
    tier = make_tier(make_pool(), ttl_s=100, grace_s=50)
    spilled = time.monotonic()
    for i, h in enumerate(HASHES):
        assert tier.spill(h, i)
    assert tier.flush(TIMEOUT_S)
    pttls = [cache_client.pttl(tier.key(h)) for h in HASHES]
    ran_down_ms = (time.monotonic() - spilled) * 1000  # however long the writes and reads took
    assert all(140_000 - ran_down_ms - 1 <= p <= 160_000 for p in pttls)  # (100 ± 10%) + 50 s
    assert len(set(pttls)) == len(HASHES)


def test_a_stale_block_is_loaded_and_its_life_extended(make_tier, cache_client):
    tier = make_tier(make_pool(), ttl_s=0.2, grace_s=30, jitter=0.0)
    store(tier, HASHES[:1], [0])

    def expires_at() -> float:
        return EXPIRES_AT.unpack_from(cache_client.get(tier.key(HASHES[0])), EXPIRES_AT_OFFSET)[0]

    stored_expiry = expires_at()
    wait_until(lambda: time.time() > stored_expiry, "the block is logically expired")  # physically present
    loading = time.time()
    assert tier.load(HASHES[:1], lambda n: [1]) == 1  # still correct (content-addressed), so still used
    assert expires_at() >= loading + 0.2  # touched: a whole new lifetime from the load on
    assert tier.load(HASHES[:1], lambda n: [1]) == 1  # the touched blob still validates


def test_a_stale_popular_prefix_is_served_to_all_and_refreshed_by_one(make_tier, cache_client):
    """Issue 14: every reader touched a stale block. Now all readers are served the stale
    (still correct) blocks at once, and one of them extends them."""
    tier = make_tier(make_pool(), ttl_s=0.2, grace_s=30, jitter=0.0)
    store(tier, HASHES[:3], [0, 1, 2])
    expiry = EXPIRES_AT.unpack_from(cache_client.get(tier.key(HASHES[2])), EXPIRES_AT_OFFSET)[0]
    wait_until(lambda: time.time() > expiry, "the prefix is logically expired")
    readers = [make_tier(make_pool(zeros=True), ttl_s=60, jitter=0.0) for _ in range(6)]
    before = metric("kvfleet_kv_cold_refreshes_total")
    start = threading.Barrier(len(readers))
    got: list[int] = []

    def read(reader: ColdTier) -> None:
        start.wait()
        got.append(len(reader.fetch(HASHES[:3])))

    threads = [threading.Thread(target=read, args=(r,)) for r in readers]
    [t.start() for t in threads]
    [t.join(TIMEOUT_S) for t in threads]
    assert got == [3] * 6  # every reader served, none waited for a rebuild
    assert metric("kvfleet_kv_cold_refreshes_total") == before + 1
    new_expiry = [EXPIRES_AT.unpack_from(cache_client.get(tier.key(h)), EXPIRES_AT_OFFSET)[0] for h in HASHES[:3]]
    assert all(e > time.time() + 30 for e in new_expiry)  # one reader's 60 s lifetime


def test_xfetch_refreshes_a_prefix_before_it_expires_when_a_miss_would_be_costly(make_tier, cache_client):
    tier = make_tier(make_pool(), ttl_s=2.0, grace_s=30, jitter=0.0, refresh_beta=1.0)
    store(tier, HASHES[:2], [0, 1])
    before = metric("kvfleet_kv_cold_refreshes_total")
    assert len(tier.fetch(HASHES[:2])) == 2  # fresh, and a miss would cost nothing: no refresh
    assert metric("kvfleet_kv_cold_refreshes_total") == before
    # A rebuild that takes far longer than the time left: XFetch refreshes it now.
    assert len(tier.fetch(HASHES[:2], rebuild_s=1e6)) == 2
    assert metric("kvfleet_kv_cold_refreshes_total") == before + 1


def _mangled(tier: ColdTier, how: str) -> bytes:
    good = BlobCodec(tier.layout, MODEL, kernels=tier.codec.kernels)
    buf = bytearray(good.raw_nbytes)
    kv = good.payload(buf)
    kv.normal_()
    raw = bytes(good.seal(buf, HASHES[0], time.time() + 60))
    if how == "corrupt":
        return raw[:HEADER.size] + bytes([raw[HEADER.size] ^ 1]) + raw[HEADER.size + 1:]
    if how == "truncated":
        return raw[: len(raw) // 2]
    if how == "model":
        other = BlobCodec(tier.layout, "model-b", kernels=tier.codec.kernels)
    else:  # shape
        other = BlobCodec(KVLayout(2, 4, 2, 32, torch.float16), MODEL, kernels=tier.codec.kernels)
    buf = bytearray(other.raw_nbytes)
    kv = other.payload(buf)
    kv.normal_()
    return bytes(other.seal(buf, HASHES[0], time.time() + 60))


@pytest.mark.parametrize("how, reason", [("corrupt", "checksum"), ("truncated", "truncated"), ("model", "model"), ("shape", "shape")])
def test_an_invalid_blob_is_a_miss_and_is_deleted(make_tier, cache_client, how, reason):
    dst = make_pool(zeros=True)
    tier = make_tier(dst)
    cache_client.set(tier.key(HASHES[0]), _mangled(tier, how))
    before = metric("kvfleet_kv_cold_rejected_blobs_total", reason=reason)
    assert tier.load(HASHES[:2], lambda n: pytest.fail("nothing may be allocated")) == 0
    assert not cache_client.exists(tier.key(HASHES[0]))
    assert metric("kvfleet_kv_cold_rejected_blobs_total", reason=reason) == before + 1
    assert all(k.abs().sum() == 0 and v.abs().sum() == 0 for k, v in dst)  # never loaded


def test_ensure_prefix_prefills_once_across_workers(make_tier, cache_client, prefix):
    builder_pool = make_pool(seed=1)
    prefills = []

    def worker(results: list) -> None:
        tier = make_tier(make_pool(zeros=True), poll_s=0.05)

        def prefill() -> None:  # stands in for a local prefill of the prompt
            prefills.append(1)
            # Stored only once the five others wait on it: none of them finds it done already.
            key = Keys(prefix).lock(f"prefix:{tier.namespace}:{HASHES[0]}")  # the first missing block
            wait_until(lambda: cache_client.pubsub_numsub(key)[0][1] == 5, "the others wait")
            # Through a tier of its own, so the first block (the flight's marker) goes last
            # by hand, as ColdTier.write orders the blocks of a prefix its own tier
            # builds: a waiter that polls mid-write must not find the marker early.
            builder = make_tier(builder_pool)
            store(builder, HASHES[1:3], [1, 2])
            store(builder, HASHES[:1], [0])

        source = tier.ensure_prefix(HASHES[:3], prefill)
        if source is PrefixSource.COLD:
            assert tier.load(HASHES[:3], lambda n: [3, 4, 5]) == 3
            assert torch.equal(block_of(tier.kv_caches, 5), block_of(builder_pool, 2))
        results.append(source)

    results: list = []
    threads = [threading.Thread(target=worker, args=(results,), daemon=True) for _ in range(6)]
    [t.start() for t in threads]
    [t.join(2 * TIMEOUT_S) for t in threads]
    assert len(prefills) == 1
    assert sorted(results) == sorted([PrefixSource.BUILT] + [PrefixSource.COLD] * 5)


def test_the_builder_stores_the_block_its_waiters_look_for_after_the_others(make_tier, cache_redis_url):
    """The builder's blocks go over several connections in no set order; a newcomer that
    looks while they land must not see the prefix's marker (its first missing block)
    before the rest are stored, or it loads a partial prefix (the stampede bench
    loaded 1 of 2 blocks this way)."""
    import redis as redis_lib

    builder_pool = make_pool(seed=5)
    tier = make_tier(builder_pool, connections=4)
    prefills, order = [], []
    monitor_client = redis_lib.Redis.from_url(cache_redis_url)
    watching = threading.Event()

    def watch() -> None:
        with monitor_client.monitor() as m:
            watching.set()
            for command in m.listen():
                words = command["command"].split()
                if words[0] == "SET" and words[1].strip('"').startswith(tier.key("")):  # blocks, not the lock
                    order.append(words[1].strip('"'))
                if len(order) == 5:
                    return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert watching.wait(TIMEOUT_S)

    def prefill() -> None:
        prefills.append(1)
        tier.write(tier.copy_out(HASHES[:5], [0, 1, 2, 3, 4]))  # block 0 is hot: the build is from block 1 on

    assert tier.ensure_prefix(HASHES[:5], prefill, first_missing=1) is PrefixSource.BUILT and prefills == [1]
    watcher.join(TIMEOUT_S)
    assert sorted(order) == sorted(tier.key(h) for h in HASHES[:5]), order
    assert order[-1] == tier.key(HASHES[1])  # the marker last, after 0, 2, 3 and 4
    assert tier._building == {}


def test_ensure_prefix_without_the_lock_prefills_everywhere(make_tier):
    prefills = []
    everyone = threading.Barrier(4)
    tiers = [make_tier(make_pool(zeros=True), use_lock=False) for _ in range(4)]

    def prefill(tier: ColdTier) -> None:
        prefills.append(1)
        everyone.wait(TIMEOUT_S)  # none stores before all four are prefilling
        store(tier, HASHES[:2], [0, 1])

    threads = [threading.Thread(target=t.ensure_prefix, args=(HASHES[:2], lambda t=t: prefill(t)), daemon=True)
               for t in tiers]
    [t.start() for t in threads]
    [t.join(2 * TIMEOUT_S) for t in threads]
    assert len(prefills) == 4 and not everyone.broken


@pytest.mark.parametrize("lend", [False, True])
def test_hooks_spill_on_evict_and_fill_on_admit(make_tier, lend):
    src, dst = make_pool(seed=3), make_pool(zeros=True)
    evicting = ColdTierHooks(make_tier(src))
    given_back: list[int] = []
    if lend:
        evicting.give_back = given_back.append
    for i, h in enumerate(HASHES[:2]):
        assert evicting.on_evict(h, (1, 2, 3, 4), None, i) is lend  # lent: the pool waits for it
    assert evicting.tier.flush(10)
    assert sorted(given_back) == ([0, 1] if lend else [])
    admitting = ColdTierHooks()
    missing = [SimpleNamespace(block_hash=h, parent_hash=None, token_ids=(), block_id=6 - i) for i, h in enumerate(HASHES[:3])]
    assert admitting.on_admit(missing) == 0  # no tier bound yet: a no-op
    admitting.tier = make_tier(dst)
    assert admitting.on_admit(missing) == 2  # the third was never spilled
    assert torch.equal(block_of(dst, 6), block_of(src, 0)) and torch.equal(block_of(dst, 5), block_of(src, 1))


def test_redis_down_is_a_quick_miss_not_an_error(prefix, monkeypatch):
    backoffs: list[float] = []
    monkeypatch.setattr("redis.retry.sleep", backoffs.append)  # where redis-py waits between retries
    before = metric("kvfleet_kv_cold_spill_dropped_blocks_total", reason="error")
    tier = ColdTier(connect("redis://127.0.0.1:1/0"), Keys(prefix), MODEL, make_pool(), **TIER_OPTIONS)  # nothing listens
    try:
        hooks = ColdTierHooks(tier)
        assert hooks.on_admit([SimpleNamespace(block_hash=HASHES[0], block_id=0)]) == 0
        assert backoffs == []  # the engine's step thread is not held up: no backoff before the miss
        hooks.on_evict(HASHES[0], (), None, 0)  # queued; the writer's failure is counted, not raised
        assert tier.flush(TIMEOUT_S)
        assert metric("kvfleet_kv_cold_spill_dropped_blocks_total", reason="error") == before + 1
    finally:
        tier.close()


def test_present_run_counts_the_stored_blocks_up_to_the_first_hole_in_one_command(make_tier, cache_client):
    tier = make_tier(make_pool())
    store(tier, [HASHES[0], HASHES[1], HASHES[3]], [0, 1, 3])
    other = make_tier(make_pool(dtype=torch.float32))  # another layout: its namespace holds none of them
    assert tier.present_run(HASHES) == 2  # block 2 is missing: block 3 is of no use without it
    assert tier.present_run(HASHES[:2]) == 2 and tier.present_run(HASHES[2:]) == 0 and tier.present_run([]) == 0
    assert other.present_run(HASHES) == 0
    sent = []
    execute = cache_client.execute_command
    cache_client.execute_command = lambda *args, **options: (sent.append(args[0]), execute(*args, **options))[1]
    try:
        assert tier.present_run(HASHES) == 2
    finally:
        del cache_client.execute_command
    assert sent == ["EVALSHA"]  # one command however long the prompt


def test_a_prefix_build_leaves_a_record_for_the_next_claim_only_if_it_wrote_the_blocks(make_tier, cache_client):
    # Locks on the cache instance here: its test client sees the record beside the lock.
    tier = make_tier(make_pool())
    record = tier._prefix_lock(HASHES, 0) + ":stored"
    assert tier.ensure_prefix(HASHES[:2], lambda: None, known_missing=True) is PrefixSource.BUILT
    assert not cache_client.exists(record)  # nobody waited, nothing written: the next claim need not look again
    assert tier.ensure_prefix(HASHES[:2], lambda: store(tier, HASHES[:2], [0, 1]),
                              known_missing=True) is PrefixSource.BUILT
    assert cache_client.exists(record) and tier._written == set()
    # A claim right after it looks again under the lock, and finds the blocks written.
    assert tier.ensure_prefix(HASHES[:2], lambda: pytest.fail("built twice"), known_missing=True) is PrefixSource.COLD
