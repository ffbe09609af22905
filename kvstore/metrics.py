"""Prometheus metrics of kvstore, `kvfleet_` prefix, base units.

Defined once per process (the client library refuses a second registration of a
name); `cache` labels the value caches (a Cache's `name`, "kv_prefix" for the cold
tier's prefix builds), so several live side by side.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# --- The stampede-safe cache (kvstore.singleflight, kvstore.cache) -----------------
HITS = Counter(
    "kvfleet_cache_hits_total", "Lookups answered from the cache, by freshness.", ["cache", "state"]
)  # state: fresh | stale (served while another caller rebuilds)
MISSES = Counter("kvfleet_cache_misses_total", "Lookups that found no value at all.", ["cache"])
BUILDS = Counter("kvfleet_cache_builds_total", "Values built (creator function run).", ["cache"])
EARLY_REFRESHES = Counter(
    "kvfleet_cache_early_refreshes_total", "Builds started early by XFetch while the value was fresh.", ["cache"]
)
LOCK_WAITS = Counter(
    "kvfleet_cache_lock_waits_total", "Callers that found no value and another caller building it.", ["cache"]
)
LOCK_TAKEOVERS = Counter(
    "kvfleet_cache_lock_takeovers_total",
    "Waiters that took the rebuild lock after its holder died or failed without storing a value.",
    ["cache"],
)
WAIT_TIMEOUTS = Counter(
    "kvfleet_cache_wait_timeouts_total", "Waiters that gave up waiting and built the value themselves.", ["cache"]
)
BUILD_SECONDS = Histogram(
    "kvfleet_cache_build_seconds",
    "Time to build one value.",
    ["cache"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CORRUPT_VALUES = Counter(
    "kvfleet_cache_corrupt_values_total", "Stored values that failed to decode; deleted and treated as misses.", ["cache"]
)

# --- The KV cold tier (kvstore.coldtier, kvstore.spill) ---------------------------
KV_SPILLED_BLOCKS = Counter("kvfleet_kv_cold_spilled_blocks_total", "KV blocks written to the cold tier.")
KV_SPILLED_BYTES = Counter("kvfleet_kv_cold_spilled_bytes_total", "Blob bytes written to the cold tier.")
KV_SPILL_RECLAIMED = Counter(
    "kvfleet_kv_cold_spill_reclaimed_blocks_total",
    "Blocks on loan to a spill that the engine needed back before they were written.",
)
KV_SPILL_DROPPED = Counter(
    "kvfleet_kv_cold_spill_dropped_blocks_total",
    "Evicted blocks not spilled, by reason (queue_full: the writer was behind; error: Redis failed).",
    ["reason"],
)
KV_SPILL_QUEUE_BYTES = Gauge("kvfleet_kv_cold_spill_queue_bytes", "Bytes of evicted blocks waiting for the writer.")
KV_LOOKUP_BLOCKS = Counter(
    "kvfleet_kv_cold_lookup_blocks_total", "Prefix blocks asked of the cold tier, by result.", ["result"]
)  # result: hit (loaded) | miss (absent, or after the first absent block)
KV_LOADED_BYTES = Counter("kvfleet_kv_cold_loaded_bytes_total", "Blob bytes loaded from the cold tier.")
KV_REJECTED = Counter(
    "kvfleet_kv_cold_rejected_blobs_total", "Blobs that failed validation; deleted, never loaded.", ["reason"]
)
KV_LOAD_SECONDS = Histogram(
    "kvfleet_kv_cold_load_seconds",
    "One prefix load: the round trip, validation and copy into the block pool.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
KV_DECISIONS = Counter(
    "kvfleet_kv_cold_decisions_total",
    "Prefixes found in the cold tier, by what was sooner: loading them or recomputing them (kvstore/decision.py).",
    ["decision"],
)
KV_REFRESHES = Counter(
    "kvfleet_kv_cold_refreshes_total",
    "Cold-tier prefixes whose logical expiry one reader extended (past expiry, or early by XFetch).",
)

# Every known label value exported from the start, at 0: a dashboard's rate() then has a
# series before the first event, and a test of what the services expose finds it.
for _result in ("hit", "miss"):
    KV_LOOKUP_BLOCKS.labels(_result)
for _decision in ("load", "recompute"):
    KV_DECISIONS.labels(_decision)
for _reason in ("queue_full", "error"):
    KV_SPILL_DROPPED.labels(_reason)
