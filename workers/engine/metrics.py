"""The engine's Prometheus metrics, on the default registry (defined once, at import).

Base units: seconds and tokens. Blocks are counted as blocks (of `block_size` tokens).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Buckets from a few ms (a cached prompt on a GPU) to a minute (a long prompt queued
# behind a busy CPU engine).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)

TIME_TO_FIRST_TOKEN = Histogram(
    "kvfleet_engine_time_to_first_token_seconds",
    "From submit to the first generated token", buckets=_TTFT_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "kvfleet_engine_time_per_output_token_seconds",
    "Mean time between generated tokens after the first, per request", buckets=_TPOT_BUCKETS,
)
GENERATED_TOKENS = Counter("kvfleet_engine_generated_tokens", "Tokens generated")
RUNNING_SEQUENCES = Gauge("kvfleet_engine_running_sequences", "Sequences holding KV blocks")
WAITING_SEQUENCES = Gauge("kvfleet_engine_waiting_sequences", "Sequences waiting for admission")
KV_BLOCKS_USED = Gauge("kvfleet_engine_kv_blocks_used", "KV pool blocks held by sequences")
KV_BLOCKS_FREE = Gauge("kvfleet_engine_kv_blocks_free", "KV pool blocks free (cached or empty)")
PREFIX_CACHE_QUERIES = Counter("kvfleet_engine_prefix_cache_queries", "Full prompt blocks looked up in the pool")
PREFIX_CACHE_HITS = Counter("kvfleet_engine_prefix_cache_hits", "Full prompt blocks found in the pool")
BATCH_SIZE = Histogram(
    "kvfleet_engine_batch_size_sequences", "Sequences computed together in one engine step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
STEP_SECONDS = Histogram(
    "kvfleet_engine_step_seconds", "Wall time of one engine step (the model's forward and sampling)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
# Against kvfleet_engine_step_seconds_sum: a step whose wall time is several times its
# thread's CPU time spent the rest waiting, in a Python process for the GIL that the
# worker's other threads hold (docs/engine.md, "Metrics").
STEP_CPU_SECONDS = Counter(
    "kvfleet_engine_step_cpu_seconds",
    "CPU time of the step thread in engine steps (the model's forward and sampling)",
)
STEP_CPU_WAIT_SECONDS = Counter(
    "kvfleet_engine_step_cpu_wait_seconds",
    "Time the step thread was ready to run during steps but waited for a CPU core that other threads or "
    "processes held (Linux schedstat; 0 where the kernel does not report it)",
)
PRIORITY_GUARDED_STEPS = Counter(
    "kvfleet_engine_priority_guarded_steps",
    "Steps in which lower classes' tokens were held back to keep a higher class's step short",
)
PRIORITY_PREEMPTIONS = Counter(
    "kvfleet_engine_priority_preemptions",
    "Lower-class sequences preempted so that a waiting higher-class one could run",
)
STEP_FAULTS = Counter("kvfleet_engine_step_faults", "Engine steps that raised (the model or a hook); their requests were failed")
SPEC_DRAFT_TOKENS = Counter(
    "kvfleet_engine_spec_draft_tokens",
    "Speculative draft tokens the model verified (prompt lookup, workers/engine/spec.py)",
)
SPEC_ACCEPTED_TOKENS = Counter(
    "kvfleet_engine_spec_accepted_tokens",
    "Speculative draft tokens the model kept: over spec_draft_tokens, the acceptance rate",
)
