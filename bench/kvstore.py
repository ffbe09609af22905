"""Cold-tier benchmark: spill and load GB/s against plain redis-py on the same server in
the same run, a prefix stampede with and without the rebuild lock, the load-or-recompute
decision's regret over a sweep of prefix lengths (the bench model here, and an 8B layout
at a GPU's prefill rate), and the result cache under a Zipf hot-key stream.

    python bench/kvstore.py [--quick] [--device cpu|cuda] [--out bench/results]

Blocks are Llama-3-8B sized: 16 tokens × 32 layers × 8 KV heads × 128 dims × (K, V) in
fp16 = 2 MiB. "plain" is the best redis-py does with the same bytes and the same round
trips (pipelined SETs in batches of 8; one MGET per prefix) and no header, checksum,
copy out of or into a block pool. Rounds alternate plain and cold tier so both see the
same machine load; medians are reported. Target: cold-tier load ≥ 70% of plain.

The stampede: 4 processes × 50 threads ask for one missing prefix at once through
ColdTier.ensure_prefix; the prefill (a sleep standing in for the model, then a write)
is counted in Redis. TTFT: one 2,048-token prompt on the benchmark model, recomputed vs
loaded from the cold tier vs found in the hot pool (measure_ttft).

Block pools live on --device (default: cuda when available, else cpu). Prints a table,
writes <out>/kvstore.json and <out>/kvstore.png. Uses the local cache Redis that
kvfleet.infra starts (only it: the bench needs no Kafka), database 2 (tests use 1, the
demo 0), and deletes its keys.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, sys.path[0] is bench/, whose files would shadow the packages they are named after.
if not __package__:
    sys.path[0] = str(ROOT)

import redis  # noqa: E402
import torch  # noqa: E402

from kernels import ops  # noqa: E402
from kvfleet.infra import redis as local_redis  # noqa: E402
from kvfleet.constants import Keys  # noqa: E402
from kvfleet.settings import ColdTierSettings  # noqa: E402
from kvstore.blob import Quant  # noqa: E402
from kvstore.coldtier import ColdTier, PrefixSource, connect  # noqa: E402

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE = 32, 16, 8, 128, torch.float16  # 2 MiB a block
FINGERPRINT = "bench-llama3-8b"
BENCH_DB = 2
PIPELINE_BATCH = 8  # the spill writer's batch, and plain SET's
CONNECTIONS = 4  # the cold tier's loads and spills (ColdTier connections), and the raw ceiling's
STAMPEDE_PROCESSES, STAMPEDE_THREADS = 4, 50
STAMPEDE_PREFIX_BLOCKS, PREFILL_S = 2, 0.5
GiB = 1 << 30
_COLD = ColdTierSettings()
#: What every ColdTier here needs: the worker's defaults and kernels (Triton on CUDA pools).
TIER_OPTIONS = dict(kernels=ops.select("auto", "paged"), quant=Quant(_COLD.quant), ttl_s=_COLD.ttl_s,
                    grace_s=_COLD.grace_s, spill_max_bytes=_COLD.spill_max_bytes)


def make_pool(num_blocks: int, seed: int = 0, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)  # (NB, BS, Hkv, D) per layer, K and V
    return [(torch.randn(shape, generator=g).to(device, DTYPE), torch.randn(shape, generator=g).to(device, DTYPE))
            for _ in range(LAYERS)]


def median_s(samples: list[float]) -> float:
    return statistics.median(samples)


# --- throughput ----------------------------------------------------------------------
class RawSockets:
    """The ceiling: the same bytes over the same number of connections by the least a
    client can do. Plain blocking sockets, pipelined GET / SET, each GET reply read with
    one recv_into(MSG_WAITALL) into a buffer of its own allocated once (a load keeps
    every block it reads), each SET sent with one sendmsg of head, value and tail; no
    validation, no pool, no copy into tensors."""

    def __init__(self, url: str, connections: int) -> None:
        import socket
        from urllib.parse import urlparse

        u = urlparse(url)
        self.db = int((u.path or "/0").lstrip("/") or 0)
        self.socks = [socket.create_connection((u.hostname, u.port or 6379)) for _ in range(connections)]
        for sock in self.socks:
            sock.sendall(f"*2\r\n$6\r\nSELECT\r\n${len(str(self.db))}\r\n{self.db}\r\n".encode())
            assert sock.recv(64).startswith(b"+OK")
        self.threads = ThreadPoolExecutor(connections)
        self.buffers: dict[str, bytearray] = {}  # get()'s, one a key
        self.values: dict[str, bytearray] = {}  # set()'s, one a key

    @staticmethod
    def _cmd(*parts: bytes) -> bytes:
        return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)

    def _split(self, items: list) -> list[list]:
        n = len(self.socks)
        return [items[len(items) * i // n:len(items) * (i + 1) // n] for i in range(n)]

    def get(self, keys: list[str], value_bytes: int) -> None:
        import socket

        header = len(b"$%d\r\n" % value_bytes)
        for k in keys:  # each value its own buffer, as a load keeps every block; made once
            if len(self.buffers.get(k, b"")) != header + value_bytes + 2:
                self.buffers[k] = bytearray(header + value_bytes + 2)

        def one(sock, chunk) -> None:
            sock.sendall(b"".join(self._cmd(b"GET", k.encode()) for k in chunk))
            for k in chunk:
                view, pos = memoryview(self.buffers[k]), 0
                while pos < len(view):
                    pos += sock.recv_into(view[pos:], len(view) - pos, socket.MSG_WAITALL)
        list(self.threads.map(one, self.socks, self._split(keys)))

    def set(self, keys: list[str], value: bytes) -> None:
        # Each key sends a value of its own, as each spilled block is one: one value sent
        # again and again would stay in the CPU's cache, which no spill of distinct
        # blocks can. Made once, outside the timing, like get()'s buffers.
        for k in keys:
            if self.values.get(k) is None or len(self.values[k]) != len(value):
                self.values[k] = bytearray(value)

        def one(sock, chunk) -> None:
            tail = b"\r\n$2\r\nPX\r\n$6\r\n600000\r\n"
            for k in chunk:
                v = self.values[k]
                head = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k.encode(), len(v))
                parts, total = [head, memoryview(v), tail], len(head) + len(v) + len(tail)
                while total:  # one writev per key, the value never copied in user space
                    sent = sock.sendmsg(parts)
                    total -= sent
                    while sent:
                        if sent >= len(parts[0]):
                            sent -= len(parts.pop(0))
                        else:
                            parts[0], sent = memoryview(parts[0])[sent:], 0
            want, got = 5 * len(chunk), b""
            while len(got) < want:
                got += sock.recv(want - len(got))
        list(self.threads.map(one, self.socks, self._split(keys)))

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.threads.shutdown()


def throughput(url: str, prefix: str, blocks: int, rounds: int, device: str) -> dict:
    client = connect(url, timeout_s=10.0)
    keys = Keys(prefix)
    src, dst = make_pool(blocks, seed=1, device=device), make_pool(blocks, seed=2, device=device)
    hashes = [f"{i:032x}" for i in range(blocks)]
    ids = list(range(blocks))
    tiers = {q: ColdTier(client, keys, f"{FINGERPRINT}-{q.value}", src, spill_batch=PIPELINE_BATCH,
                         **{**TIER_OPTIONS, "quant": q, "spill_max_bytes": 4 * GiB}) for q in Quant}
    readers = {q: ColdTier(client, keys, f"{FINGERPRINT}-{q.value}", dst, connections=CONNECTIONS,
                           **TIER_OPTIONS) for q in Quant}
    blob_bytes = {}
    for q, tier in tiers.items():
        tier.write(tier.copy_out(hashes[:1], ids[:1]))
        blob_bytes[q] = client.strlen(tier.key(hashes[0]))
    plain_keys = [f"{prefix}:plain:{i}" for i in range(blocks)]
    plain_value = bytes(blob_bytes[Quant.NONE])  # the same bytes per block as an fp16 blob

    def plain_set() -> None:
        for lo in range(0, blocks, PIPELINE_BATCH):
            pipe = client.pipeline(transaction=False)
            for key in plain_keys[lo:lo + PIPELINE_BATCH]:
                pipe.set(key, plain_value, px=600_000)
            pipe.execute()

    def plain_get() -> None:
        assert all(v is not None for v in client.mget(plain_keys))

    hook_s: dict[Quant, list[float]] = {q: [] for q in Quant}  # the engine thread's share of a spill

    def spill(q: Quant) -> Callable[[], None]:
        tier = tiers[q]

        def run() -> None:  # as the worker's eviction hook does (kvstore/hooks.py)
            given_back: list[int] = []
            started = time.perf_counter()
            for h, i in zip(hashes, ids):
                if not (tier.lend(h, i, given_back.append) if tier.can_lend else tier.spill(h, i)):
                    raise RuntimeError("spill queue full: raise spill_max_bytes")
            hook_s[q].append((time.perf_counter() - started) / blocks)
            if not tier.flush(120):
                raise RuntimeError("spills not written within 120 s")
            if tier.can_lend and sorted(given_back) != ids:
                raise RuntimeError(f"{blocks - len(given_back)} lent blocks not given back")
        return run

    def fetch_into() -> None:  # the worker's load: a job's task thread, straight into pool blocks
        if readers[Quant.NONE].fetch_into(hashes, ids)[0] != blocks:
            raise RuntimeError("a fetch came up short: was a block evicted? (maxmemory)")

    def load(q: Quant) -> Callable[[], None]:
        def run() -> None:
            if readers[q].load(hashes, lambda n: ids[:n]) != blocks:
                raise RuntimeError("a load came up short: was a block evicted? (maxmemory)")
            if device != "cpu":
                torch.cuda.synchronize()  # the copies into the pool are part of the load
        return run

    raw = RawSockets(url, CONNECTIONS)
    ops = {"raw socket SET": lambda: raw.set(plain_keys, plain_value), "plain SET": plain_set,
           "cold spill fp16": spill(Quant.NONE), "cold spill int8": spill(Quant.INT8),
           "raw socket GET": lambda: raw.get(plain_keys, len(plain_value)), "plain MGET": plain_get,
           "cold load fp16": fetch_into, "cold load + copy fp16": load(Quant.NONE), "cold load int8": load(Quant.INT8)}
    wire = {"raw socket SET": len(plain_value), "raw socket GET": len(plain_value),
            "plain SET": len(plain_value), "plain MGET": len(plain_value),
            "cold spill fp16": blob_bytes[Quant.NONE], "cold load fp16": blob_bytes[Quant.NONE],
            "cold load + copy fp16": blob_bytes[Quant.NONE],
            "cold spill int8": blob_bytes[Quant.INT8], "cold load int8": blob_bytes[Quant.INT8]}
    samples: dict[str, list[float]] = {name: [] for name in ops}
    plain_set(), spill(Quant.NONE)(), spill(Quant.INT8)()  # warm up and fill what the loads read
    for _ in range(rounds):
        for name, op in ops.items():  # interleaved: plain and cold see the same machine load
            started = time.perf_counter()
            op()
            samples[name].append(time.perf_counter() - started)
    raw.close()
    for tier in [*tiers.values(), *readers.values()]:
        tier.close()
    kv_bytes = LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    rows = {}
    for name, secs in samples.items():
        s = median_s(secs)
        rows[name] = {"median_s": s, "blocks": blocks, "wire_bytes_per_block": wire[name],
                      "wire_gbps": blocks * wire[name] / s / 1e9, "kv_gbps": blocks * kv_bytes / s / 1e9}
    return {"rows": rows, "block_bytes_fp16": kv_bytes, "blob_bytes": {q.value: b for q, b in blob_bytes.items()},
            "spill_hook_ms_per_block": {q.value: median_s(v) * 1e3 for q, v in hook_s.items()}}


# --- stampede ------------------------------------------------------------------------
def stampede_process(url: str, prefix: str, use_lock: bool, ready, go, out) -> None:
    client = connect(url, timeout_s=30.0)
    pool = make_pool(2 * STAMPEDE_PREFIX_BLOCKS)
    tier = ColdTier(client, Keys(prefix), FINGERPRINT, pool, **TIER_OPTIONS, use_lock=use_lock, poll_s=0.05,
                    wait_timeout_s=60)
    hashes = [f"{prefix}{i:08x}" for i in range(STAMPEDE_PREFIX_BLOCKS)]
    block_ids = list(range(STAMPEDE_PREFIX_BLOCKS))

    def prefill() -> None:  # the model's work, then the write its waiters load from
        client.incr(f"{prefix}:prefills")
        time.sleep(PREFILL_S)
        tier.write(tier.copy_out(hashes, block_ids))

    latencies: list[float] = []
    barrier = threading.Barrier(STAMPEDE_THREADS)
    # This process stands for one worker: its engine loads the prefix into its pool
    # once, and its other requests find it there (the hot tier).
    pool_lock, in_pool = threading.Lock(), threading.Event()

    def request() -> None:
        barrier.wait()
        started = time.perf_counter()
        source = tier.ensure_prefix(hashes, prefill)
        with pool_lock:
            if source is PrefixSource.COLD and not in_pool.is_set():
                if tier.load(hashes, lambda n: [STAMPEDE_PREFIX_BLOCKS + i for i in range(n)]) != len(hashes):
                    raise RuntimeError("the prefix was not in the cold tier after ensure_prefix")
            in_pool.set()
        latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=request) for _ in range(STAMPEDE_THREADS)]
    ready.put(1)
    go.wait(120)
    [t.start() for t in threads]
    [t.join() for t in threads]
    tier.close()
    out.put(latencies)


def stampede(url: str, *, use_lock: bool) -> dict:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=stampede_process, args=(url, prefix, use_lock, ready, go, out))
             for _ in range(STAMPEDE_PROCESSES)]
    [p.start() for p in procs]
    [ready.get(timeout=180) for _ in procs]
    started = time.perf_counter()
    go.set()
    latencies = sorted(x for _ in procs for x in out.get(timeout=300))
    wall = time.perf_counter() - started
    [p.join(30) for p in procs]
    client = redis.Redis.from_url(url)
    prefills = int(client.get(f"{prefix}:prefills") or 0)
    cleanup(client, prefix)
    return {"requests": len(latencies), "prefills": prefills, "wall_s": wall,
            "p50_s": latencies[len(latencies) // 2], "p99_s": latencies[int(len(latencies) * 0.99) - 1]}


# --- TTFT ----------------------------------------------------------------------------
TTFT_PROMPT_TOKENS = 2048


def measure_ttft(url: str, runs: int) -> dict:
    """Time to first token of one 2,048-token prompt on the benchmark model, three ways:
    recompute (empty pool, empty cold tier), cold (a fresh pool, the prompt's blocks in
    Redis, fetched into the pool by the job's thread as a worker does and adopted) and
    hot (blocks still in the pool).
    Medians of `runs`; each run uses fresh keys."""
    from kvfleet.contracts import Sampling
    from kvstore.hooks import ColdTierHooks
    from workers.engine import Engine, EngineConfig
    from workers.model.loader import load_model
    from workers.prefix import PrefixSharing, PrefixSharingEngine

    model = load_model("builtin:bench")
    prompt = [(i * 7919 + 13) % 256 for i in range(TTFT_PROMPT_TOKENS)]

    def engine(prefix: str) -> tuple[Engine, ColdTier]:
        hooks = ColdTierHooks(prefetch_only=True)  # as a worker: the cold prefix is prefetched by the task thread
        e = Engine(model, EngineConfig(max_num_batched_tokens=TTFT_PROMPT_TOKENS), hooks=hooks)
        hooks.tier = ColdTier(connect(url), Keys(prefix), e.block_manager.fingerprint, e.kv_cache,
                              **{**TIER_OPTIONS, "kernels": e.kernels})
        return e, hooks.tier

    def ttft(e: Engine, request_id: str, tier: ColdTier, *, cached: int | None = None) -> float:
        # The worker's path: the prefix step (hot/cold lookup, decision, prefetch) and then
        # the engine; TTFT counts both.
        # (No fleet single flight: one worker here; the prefix is published by hand below.)
        generator = PrefixSharingEngine(e, PrefixSharing(e, tier, min_blocks=10**9))
        started = time.time()
        result = generator.generate(request_id, prompt, 1, Sampling())
        if cached is not None and result.cached_tokens != cached:
            raise RuntimeError(f"{result.cached_tokens} of the prompt's tokens were cached, not {cached}")
        return result.first_token_at - started

    samples: dict[str, list[float]] = {"recompute": [], "cold": [], "hot": []}
    for run in range(runs):
        prefix = f"bench{uuid.uuid4().hex[:8]}"
        first, tier = engine(prefix)
        samples["recompute"].append(ttft(first, f"r{run}", tier))
        hashes = first.block_manager.prefix_hashes(prompt)
        # Publish the blocks as the fleet's single-flight prefill does (workers/prefix.py).
        held = first.call_soon(lambda: tier.copy_out(hashes, first.block_manager.cached_block_ids(hashes)))
        tier.write(held.result())
        samples["hot"].append(ttft(first, f"h{run}", tier))
        second, tier2 = engine(prefix)
        # The whole prefix loaded from Redis, or the figure would be part recompute.
        samples["cold"].append(ttft(second, f"c{run}", tier2, cached=len(hashes) * second.block_manager.block_size))
        for e, t in ((first, tier), (second, tier2)):
            e.shutdown()
            t.close()
        cleanup(redis.Redis.from_url(url), prefix)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"ttft_s": med, "ttft_runs": samples,
            "ttft_cold_over_recompute": med["cold"] / med["recompute"],
            "ttft_hot_over_recompute": med["hot"] / med["recompute"]}


# --- load or recompute: the decision's regret -----------------------------------------
REGRET_PREFIX_TOKENS = (64, 256, 1024, 2048)
GPU_PREFILL_TOKENS_PER_S = 20_000.0  # an 8B model's prefill on one H100/H200-class GPU, about


def decision_regret_bench_model(url: str, runs: int, lengths: tuple[int, ...] = REGRET_PREFIX_TOKENS) -> dict:
    """TTFT of a prompt whose prefix sits in the cold tier, for a sweep of prefix lengths,
    on the benchmark model: always loading, always recomputing, and as FetchDecision
    chooses from this worker's live measurements. Regret = the TTFT of the way it chose
    over the better of the two (1.0 = it always picked the faster)."""
    from kvfleet.contracts import Sampling
    from kvstore.hooks import ColdTierHooks
    from workers.engine import Engine, EngineConfig
    from workers.model.loader import load_model
    from workers.prefix import PrefixSharing, PrefixSharingEngine

    model = load_model("builtin:bench")
    rows = {}
    for n_tokens in lengths:
        prompt = [(i * 7919 + 13 + n_tokens) % 256 for i in range(n_tokens + 1)]
        times: dict[str, list[float]] = {"load": [], "recompute": [], "decision": []}
        chosen = []
        for run in range(runs):
            prefix = f"bench{uuid.uuid4().hex[:8]}"
            hooks = ColdTierHooks(prefetch_only=True)
            writer = Engine(model, EngineConfig(max_num_batched_tokens=4096), hooks=hooks)
            hooks.tier = ColdTier(connect(url), Keys(prefix), writer.block_manager.fingerprint, writer.kv_cache,
                                  **{**TIER_OPTIONS, "kernels": writer.kernels})
            writer.generate("w", prompt, 1)
            hashes = writer.block_manager.prefix_hashes(prompt)
            hooks.tier.write(writer.call_soon(
                lambda: hooks.tier.copy_out(hashes, writer.block_manager.cached_block_ids(hashes))).result())
            for how in ("recompute", "load", "decision"):
                rhooks = ColdTierHooks(prefetch_only=True)
                e = Engine(model, EngineConfig(max_num_batched_tokens=4096), hooks=rhooks)
                rhooks.tier = ColdTier(connect(url), Keys(prefix), e.block_manager.fingerprint, e.kv_cache,
                                       **{**TIER_OPTIONS, "kernels": e.kernels})
                # Warm the engine's step-cost fit, as a worker that has run jobs has it.
                for k in range(20):
                    e.generate(f"warm{k}", [(k * 31 + j) % 256 for j in range(8 + 24 * k)], 1)
                rate = {"recompute": 1e15, "load": 1e-9, "decision": 0.0}[how]  # 0: measured
                sharing = PrefixSharing(e, rhooks.tier, min_blocks=10**9, prefill_tokens_per_s=rate)
                started = time.time()
                result = PrefixSharingEngine(e, sharing).generate(f"{how}{run}", prompt, 1, Sampling())
                times[how].append(result.first_token_at - started)
                if how == "decision":
                    chosen.append("load" if result.cached_tokens else "recompute")
                e.shutdown()
                rhooks.tier.close()
            writer.shutdown()
            hooks.tier.close()
            cleanup(redis.Redis.from_url(url), prefix)
        med = {k: statistics.median(v) for k, v in times.items()}
        # The regret of a choice is what the chosen way costs over the better way, both
        # as measured above (as for the 8B layout below); the decision's own runs give
        # its choices (and a TTFT of their own, kept for reference, noisier than that).
        best = min(med["load"], med["recompute"])
        rows[n_tokens] = {**{f"{k}_ttft_s": v for k, v in med.items()}, "chosen": chosen,
                          "regret": statistics.mean(med[c] for c in chosen) / best,
                          "decision_ttft_over_best": med["decision"] / best}
    return {"rows": rows, "regret": max(r["regret"] for r in rows.values())}


def decision_regret_8b_layout(url: str, rounds: int) -> dict:
    """The same question for an 8B-shaped layout (2 MiB blocks of 16 tokens, 128 KiB a
    token) on a GPU whose prefill rate is a setting (GPU_PREFILL_TOKENS_PER_S): loads are
    measured here, from this Redis; recompute is tokens / rate. Often the answer is to
    recompute: a 2,048-token prefix is 268 MB."""
    from kvstore.decision import FetchDecision

    prefix = f"bench{uuid.uuid4().hex[:8]}"
    blocks = max(REGRET_PREFIX_TOKENS) // BLOCK_SIZE
    src, dst = make_pool(blocks, seed=1), make_pool(blocks, seed=2)
    client = connect(url, timeout_s=10.0)
    writer = ColdTier(client, Keys(prefix), FINGERPRINT, src, **{**TIER_OPTIONS, "spill_max_bytes": 4 * GiB})
    reader = ColdTier(client, Keys(prefix), FINGERPRINT, dst, **TIER_OPTIONS)
    hashes = [f"{i:032x}" for i in range(blocks)]
    writer.write(writer.copy_out(hashes, list(range(blocks))))
    decision = FetchDecision(blob_bytes=reader.blob_nbytes, block_tokens=BLOCK_SIZE,
                             prefill_tokens_per_s=lambda: GPU_PREFILL_TOKENS_PER_S)
    rows = {}
    try:
        for n_tokens in REGRET_PREFIX_TOKENS:
            n = n_tokens // BLOCK_SIZE
            loads = []
            for _ in range(rounds):
                started = time.perf_counter()
                _, nbytes = reader.fetch_into(hashes[:n], list(range(n)))
                loads.append(time.perf_counter() - started)
                decision.observe_fetch(nbytes, loads[-1])
            load_s, recompute_s = statistics.median(loads), n_tokens / GPU_PREFILL_TOKENS_PER_S
            pick = "load" if decision.should_load(n) else "recompute"
            rows[n_tokens] = {"load_s": load_s, "recompute_s": recompute_s, "chosen": pick,
                              "regret": (load_s if pick == "load" else recompute_s) / min(load_s, recompute_s)}
    finally:
        writer.close()
        reader.close()
        cleanup(redis.Redis.from_url(url), prefix)
    return {"gpu_prefill_tokens_per_s": GPU_PREFILL_TOKENS_PER_S, "rows": rows,
            "regret": max(r["regret"] for r in rows.values())}


# --- one prefill per shared prefix, fleet-wide ------------------------------------------
SHARED_PROCESSES, SHARED_PREFIX_TOKENS = 4, 1024


def shared_prefix_process(url: str, state_url: str, prefix: str, index: int, requests: int, barrier, out) -> None:
    """One worker process as the service builds it, serving `requests` prompts that all
    begin with the same 1,024 tokens and end with a question of their own (32-128 tokens)."""
    import random

    import redis as redis_lib

    from kvfleet.contracts import Sampling
    from kvstore.hooks import ColdTierHooks
    from workers.engine import Engine, EngineConfig
    from workers.model.loader import load_model
    from workers.prefix import PrefixSharing, PrefixSharingEngine

    torch.set_num_threads(1)
    hooks = ColdTierHooks(prefetch_only=True)
    engine = Engine(load_model("builtin:bench"), EngineConfig(max_num_batched_tokens=2048), hooks=hooks)
    hooks.tier = ColdTier(connect(url), Keys(prefix), engine.block_manager.fingerprint, engine.kv_cache,
                          lock_client=redis_lib.Redis.from_url(state_url), **{**TIER_OPTIONS, "kernels": engine.kernels})
    generator = PrefixSharingEngine(engine, PrefixSharing(engine, hooks.tier))
    shared = [(i * 7919 + 13) % 256 for i in range(SHARED_PREFIX_TOKENS)]
    rng = random.Random(index)
    computed_shared, ttfts = 0, []
    barrier.wait()  # every process sends its first request at the same moment
    for r in range(requests):
        suffix = [rng.randrange(256) for _ in range(rng.randint(32, 128))]
        before = engine.stats().prompt_tokens_computed
        started = time.time()
        result = generator.generate(f"p{index}-{r}", shared + suffix, 1, Sampling())
        ttfts.append(result.first_token_at - started)
        # More tokens computed than the question holds: this request prefilled the
        # shared blocks (the 1-token prefix run of a flight builder counts here too).
        if engine.stats().prompt_tokens_computed - before >= SHARED_PREFIX_TOKENS:
            computed_shared += 1
    out.put({"shared_prefills": computed_shared, "ttfts": ttfts})
    engine.shutdown()
    hooks.tier.close()


def shared_prefix_prefills(url: str, state_url: str, requests_per_process: int) -> dict:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(SHARED_PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=shared_prefix_process,
                         args=(url, state_url, prefix, i, requests_per_process, barrier, out))
             for i in range(SHARED_PROCESSES)]
    started = time.perf_counter()
    [p.start() for p in procs]
    results = [out.get(timeout=1800) for _ in procs]
    wall = time.perf_counter() - started
    [p.join(60) for p in procs]
    cleanup(redis.Redis.from_url(url), prefix)
    cleanup(redis.Redis.from_url(state_url), prefix)
    ttfts = sorted(t for r in results for t in r["ttfts"])
    return {"processes": SHARED_PROCESSES, "requests": len(ttfts), "shared_prefix_tokens": SHARED_PREFIX_TOKENS,
            "shared_prefix_prefills": sum(r["shared_prefills"] for r in results),
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p99_s": ttfts[int(len(ttfts) * 0.99) - 1], "wall_s": wall}


# --- decode steps while cold prefixes arrive -------------------------------------------
DECODE_SEQS, DECODE_TOKENS, ARRIVING, ARRIVING_PREFIX_TOKENS = 8, 320, 12, 1024
ARRIVAL_GAP_S = 0.1  # between arriving jobs: a worker busy with a stream of jobs, not one burst


def decode_steps_with_cold_loads(url: str, arrival_gap_s: float = ARRIVAL_GAP_S) -> dict:
    """Decode step time (the gap between a decoding sequence's tokens) of DECODE_SEQS
    sequences on the bench model, p99, while ARRIVING jobs with 1,024-token prefixes
    join them one every `arrival_gap_s`. The arriving jobs compute only their last,
    partial block; their prefixes are:

    - "hot": already in the engine's own pool (the baseline: the same arrivals, the
      same suffix prefill, no cold load at all);
    - "prefetched": in the cold tier, loaded the worker's way (fetched in the job's
      thread, copied in at admission);
    - "step thread": in the cold tier, loaded the old way (fetched on the step thread).

    "alone" has no arrivals. The key is prefetched over hot: what cold loads add to a
    running batch's steps, beyond the arrivals' own compute."""
    from kvfleet.contracts import Sampling
    from kvstore.hooks import ColdTierHooks
    from workers.engine import Engine, EngineConfig
    from workers.model.loader import load_model
    from workers.prefix import PrefixSharing, PrefixSharingEngine

    model = load_model("builtin:bench")
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    prompts = [[(i * 7919 + 13 * k) % 256 for i in range(ARRIVING_PREFIX_TOKENS + 8)] for k in range(1, ARRIVING + 1)]

    def make(staged: bool) -> tuple[Engine, ColdTier]:
        hooks = ColdTierHooks(prefetch_only=staged)
        e = Engine(model, EngineConfig(max_num_batched_tokens=2048), hooks=hooks)
        hooks.tier = ColdTier(connect(url), Keys(prefix), e.block_manager.fingerprint, e.kv_cache,
                              **{**TIER_OPTIONS, "kernels": e.kernels})
        return e, hooks.tier

    writer, wtier = make(True)
    for k, p in enumerate(prompts):  # the arriving prompts' blocks, in Redis
        writer.generate(f"w{k}", p, 1)
        hashes = writer.block_manager.prefix_hashes(p)
        wtier.write(writer.call_soon(lambda h=hashes: wtier.copy_out(h, writer.block_manager.cached_block_ids(h))).result())
    writer.shutdown()
    wtier.close()

    def run(mode: str) -> list[float]:
        e, tier = make(mode != "step thread")
        if mode == "hot":
            for k, p in enumerate(prompts):
                e.generate(f"h{k}", p, 1)  # the prefixes, computed into this engine's pool
        gaps: list[float] = []
        last: dict[int, float] = {}

        def on_token(i: int):
            def tick(_token: int) -> None:
                now = time.perf_counter()
                if i in last:
                    gaps.append(now - last[i])
                last[i] = now
            return tick

        handles = [e.submit(f"d{i}", [(i * 13 + j) % 256 for j in range(32)], DECODE_TOKENS, ignore_eos=True,
                            on_token=on_token(i)) for i in range(DECODE_SEQS)]
        if mode != "alone":
            time.sleep(0.3)  # the batch is decoding
            generator = PrefixSharingEngine(e, PrefixSharing(e, tier, min_blocks=10**9, prefill_tokens_per_s=1.0))
            generate = e.generate if mode == "step thread" else (lambda *a: generator.generate(*a, Sampling()))

            def arrive(k: int, p: list[int]) -> None:
                time.sleep(k * arrival_gap_s)
                generate(f"a{k}", p, 1)

            threads = [threading.Thread(target=arrive, args=(k, p)) for k, p in enumerate(prompts)]
            [t.start() for t in threads]
            [t.join() for t in threads]
        [h.result() for h in handles]
        e.shutdown()
        tier.close()
        return gaps

    try:
        out = {mode: run(mode) for mode in ("alone", "hot", "prefetched", "step thread")}
    finally:
        cleanup(redis.Redis.from_url(url), prefix)

    def p99(v: list[float]) -> float:
        return sorted(v)[int(len(v) * 0.99) - 1]

    res = {mode: {"p50_ms": statistics.median(g) * 1e3, "p99_ms": p99(g) * 1e3} for mode, g in out.items()}
    return {"rows": res, "arrival_gap_s": arrival_gap_s,
            "decode_step_p99_with_cold_loads_over_without": res["prefetched"]["p99_ms"] / res["hot"]["p99_ms"],
            "decode_step_p99_step_thread_loads_over_without": res["step thread"]["p99_ms"] / res["hot"]["p99_ms"],
            "decode_step_p99_with_arrivals_over_alone": res["hot"]["p99_ms"] / res["alone"]["p99_ms"]}


# --- the result cache under a hot-key stream -------------------------------------------
ZIPF_S, ZIPF_KEYS, ZIPF_CLIENTS, MODEL_S, RESULT_TTL_S = 1.1, 200, 64, 0.2, 2.0


def result_cache_zipf(url: str, lock_url: str, seconds: float, *, protected: bool, seed: int = 7) -> dict:
    """The seed's hot-key scenario: ZIPF_CLIENTS threads send requests whose prompts are
    drawn from a Zipf(s = 1.1) law over ZIPF_KEYS distinct prompts, through the result
    cache, for `seconds`. Every entry is written at once before the run, with the same
    TTL, so they expire together (a synchronized expiry). The model is a sleep
    (a 200 ms generation; it releases the GIL, as a GPU forward does). `protected`: the rebuild lock, stale
    serving and ±10% jitter; else a cache-aside with the same TTL and no lock: every
    request that finds its entry expired runs the model."""
    import numpy as np

    from kvfleet.contracts import Completion, JobRequest, Priority, Sampling
    from workers.result_cache import ResultCache

    prefix = f"bench{uuid.uuid4().hex[:8]}"
    cache = ResultCache(redis.Redis.from_url(url), Keys(prefix), FINGERPRINT, ttl_s=RESULT_TTL_S,
                        grace_s=RESULT_TTL_S if protected else 0.0, lock_client=redis.Redis.from_url(lock_url),
                        jitter=0.1 if protected else 0.0, use_lock=protected, poll_s=0.01)
    jobs = [JobRequest(job_id=f"j{k}", tenant="bench", priority=Priority.NORMAL, model="m", max_new_tokens=8,
                       submitted_at=0.0, prompt_tokens=[k, k + 1, k + 2], sampling=Sampling(cache=True))
            for k in range(ZIPF_KEYS)]
    invocations = [0]
    lock = threading.Lock()

    def model() -> Completion:
        with lock:
            invocations[0] += 1
        time.sleep(MODEL_S)
        now = time.time()
        return Completion(text="x", tokens=[1] * 8, finish_reason="length", prompt_tokens=3, cached_tokens=0,
                          started_at=now, first_token_at=now, finished_at=now)

    for job in jobs:  # all written at once: their expiries line up
        cache.get_or_run(job, "salt", model)
    invocations[0] = 0
    ranks = np.arange(1, ZIPF_KEYS + 1, dtype=float)
    weights = ranks ** -ZIPF_S
    weights /= weights.sum()
    served = [0] * ZIPF_CLIENTS
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = np.random.default_rng(seed + i)
        while time.monotonic() < stop:
            cache.get_or_run(jobs[int(rng.choice(ZIPF_KEYS, p=weights))], "salt", model)
            served[i] += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(ZIPF_CLIENTS)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - started
    cleanup(redis.Redis.from_url(url), prefix)
    cleanup(redis.Redis.from_url(lock_url), prefix)
    requests = sum(served)
    return {"requests": requests, "model_invocations": invocations[0],
            "backend_load": invocations[0] / requests, "hit_rate": 1 - invocations[0] / requests,
            "requests_per_s": requests / wall, "seconds": wall}


# --- report --------------------------------------------------------------------------
def cleanup(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(f"{prefix}:*", count=1000))
    for lo in range(0, len(keys), 500):
        client.delete(*keys[lo:lo + 500])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["throughput"]["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    names = list(rows)
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [rows[n]["wire_gbps"] for n in names], 0.4, label="wire bytes", color="tab:blue")
    ax1.bar([i + 0.2 for i in x], [rows[n]["kv_gbps"] for n in names], 0.4, label="KV bytes (fp16 equivalent)",
            color="tab:orange")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("GB/s")
    ax1.set_title(f"2 MiB blocks, {result['config']['device']} pools, median of {result['config']['rounds']} rounds")
    ax1.tick_params(axis="x", rotation=25)
    ax1.legend()
    ax2.bar(["with lock", "without"], [result["stampede_prefills_with_lock"], result["stampede_prefills_without_lock"]],
            color=["tab:green", "tab:red"])
    ax2.set_yscale("log")
    ax2.set_title(f"prefills for {STAMPEDE_PROCESSES * STAMPEDE_THREADS} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and rounds (about 2 minutes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)  # keep torch's thread pool from fighting the Redis client for cores
    url = local_redis.start(local_redis.CACHE).rsplit("/", 1)[0] + f"/{BENCH_DB}"
    blocks, rounds = (16, 15) if args.quick else (32, 30)
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    try:
        tp = throughput(url, prefix, blocks, rounds, args.device)
    finally:
        cleanup(redis.Redis.from_url(url), prefix)
    with_lock, without_lock = stampede(url, use_lock=True), stampede(url, use_lock=False)
    state_url = local_redis.start(local_redis.STATE).rsplit("/", 1)[0] + f"/{BENCH_DB}"
    zipf_s = 6.0 if args.quick else 20.0
    shared = shared_prefix_prefills(url, state_url, 10 if args.quick else 200)
    decode = decode_steps_with_cold_loads(url)
    regret_small = (decision_regret_bench_model(url, 1, REGRET_PREFIX_TOKENS[:3]) if args.quick
                    else decision_regret_bench_model(url, 3))
    regret_8b = decision_regret_8b_layout(url, 3 if args.quick else 7)
    zipf_on = result_cache_zipf(url, state_url, zipf_s, protected=True)
    zipf_off = result_cache_zipf(url, state_url, zipf_s, protected=False)
    rows = tp["rows"]
    result = {
        "config": {"layers": LAYERS, "block_size": BLOCK_SIZE, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                   "dtype": str(DTYPE), "blocks_per_round": blocks, "rounds": rounds, "quick": args.quick,
                   "device": args.device, "redis": url, "cpus": os.cpu_count()},
        "throughput": tp,
        "load_vs_plain_redis": rows["cold load fp16"]["wire_gbps"] / rows["plain MGET"]["wire_gbps"],
        "load_gbps": rows["cold load fp16"]["wire_gbps"],
        "load_vs_ceiling": rows["cold load fp16"]["wire_gbps"] / rows["raw socket GET"]["wire_gbps"],
        "load_with_copy_gbps": rows["cold load + copy fp16"]["wire_gbps"],
        "load_with_copy_vs_ceiling": rows["cold load + copy fp16"]["wire_gbps"] / rows["raw socket GET"]["wire_gbps"],
        "spill_gbps": rows["cold spill fp16"]["wire_gbps"],
        "spill_vs_ceiling": rows["cold spill fp16"]["wire_gbps"] / rows["raw socket SET"]["wire_gbps"],
        "spill_vs_plain_redis": rows["cold spill fp16"]["wire_gbps"] / rows["plain SET"]["wire_gbps"],
        "int8_bytes_vs_fp16": tp["blob_bytes"]["int8"] / tp["blob_bytes"]["none"],
        **measure_ttft(url, 2 if args.quick else 5),
        "shared_prefix": shared,
        "shared_prefix_prefills": shared["shared_prefix_prefills"],
        "decode_steps": decode,
        "decode_step_p99_with_cold_loads_over_without": decode["decode_step_p99_with_cold_loads_over_without"],
        "decision_bench_model": regret_small,
        "decision_8b_layout": regret_8b,
        "fetch_decision_regret": max(regret_small["regret"], regret_8b["regret"]),
        "result_cache": {"with_lock_and_jitter": zipf_on, "without": zipf_off},
        "result_cache_backend_load_with_lock": zipf_on["backend_load"],
        "result_cache_backend_load_without": zipf_off["backend_load"],
        "stampede_prefills_with_lock": with_lock["prefills"],
        "stampede_prefills_without_lock": without_lock["prefills"],
        "stampede": {"with_lock": with_lock, "without_lock": without_lock},
    }
    print(f"{'operation':<18}{'median ms':>11}{'wire GB/s':>11}{'KV GB/s':>10}")
    for name, row in rows.items():
        print(f"{name:<18}{row['median_s'] * 1e3:>11.1f}{row['wire_gbps']:>11.2f}{row['kv_gbps']:>10.2f}")
    hook = tp["spill_hook_ms_per_block"]
    print(f"engine thread per evicted block (copy out + queue): {hook['none']:.2f} ms fp16, {hook['int8']:.2f} ms int8")
    print(f"load {result['load_gbps']:.2f} GB/s = {result['load_vs_ceiling']:.1%} of the raw-socket ceiling "
          f"(targets >= 1.0 GB/s, >= 80%); spill {result['spill_gbps']:.2f} GB/s = {result['spill_vs_ceiling']:.1%} "
          f"(targets >= 1.5 GB/s, >= 60%)")
    print(f"load read into a buffer, then copied into the pool (load(), the step-thread path): "
          f"{result['load_with_copy_gbps']:.2f} GB/s = {result['load_with_copy_vs_ceiling']:.0%} of the ceiling")
    print(f"load vs plain redis: {result['load_vs_plain_redis']:.0%} (target >= 70%), "
          f"spill vs plain: {result['spill_vs_plain_redis']:.0%}, int8 bytes vs fp16: {result['int8_bytes_vs_fp16']:.0%}")
    print(f"shared prefix: {shared['shared_prefix_prefills']} prefills of the shared {SHARED_PREFIX_TOKENS} tokens "
          f"for {shared['requests']} requests on {SHARED_PROCESSES} processes (target 1); "
          f"TTFT p50 {shared['ttft_p50_s'] * 1e3:.0f} ms, p99 {shared['ttft_p99_s'] * 1e3:.0f} ms")
    for mode, row in decode["rows"].items():
        print(f"decode step {mode:<12} p50 {row['p50_ms']:6.1f} ms  p99 {row['p99_ms']:6.1f} ms")
    print(f"decode p99 with cold loads / the same arrivals with hot prefixes: "
          f"{result['decode_step_p99_with_cold_loads_over_without']:.2f} (target <= 1.2; loads on the step thread: "
          f"{decode['decode_step_p99_step_thread_loads_over_without']:.2f}; hot arrivals / no arrivals: "
          f"{decode['decode_step_p99_with_arrivals_over_alone']:.2f})")
    print(f"{'load or recompute':<22}{'prefix':>7}{'load s':>9}{'recompute s':>12}{'chosen':>18}{'regret':>8}")
    for name, res in (("bench model", regret_small), ("8B layout, GPU rate", regret_8b)):
        for n, row in res["rows"].items():
            load = row.get("load_ttft_s", row.get("load_s"))
            rec = row.get("recompute_ttft_s", row.get("recompute_s"))
            print(f"{name:<22}{n:>7}{load:>9.3f}{rec:>12.3f}{str(row['chosen']):>18}{row['regret']:>8.2f}")
    print(f"fetch_decision_regret: {result['fetch_decision_regret']:.2f} (target <= 1.1)")
    print(f"{'result cache (Zipf 1.1)':<26}{'backend load':>13}{'hit rate':>10}{'requests/s':>12}")
    for name, z in result["result_cache"].items():
        print(f"{name:<26}{z['backend_load']:>13.1%}{z['hit_rate']:>10.1%}{z['requests_per_s']:>12.0f}")
    for name, s in result["stampede"].items():
        print(f"stampede {name:<13} {s['prefills']:>4} prefills for {s['requests']} requests, "
              f"p50 {s['p50_s']:.2f}s p99 {s['p99_s']:.2f}s, wall {s['wall_s']:.1f}s")
    t = result["ttft_s"]
    print(f"TTFT of a {TTFT_PROMPT_TOKENS}-token prompt (builtin:bench): recompute {t['recompute'] * 1e3:.0f} ms, "
          f"cold hit {t['cold'] * 1e3:.0f} ms ({result['ttft_cold_over_recompute']:.2f}x, target <= 0.3x), "
          f"hot hit {t['hot'] * 1e3:.0f} ms ({result['ttft_hot_over_recompute']:.2f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kvstore.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "kvstore.png")
    print(f"wrote {args.out / 'kvstore.json'} and {args.out / 'kvstore.png'}")


if __name__ == "__main__":
    main()
