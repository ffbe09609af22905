"""The exact-match result cache: a burst of identical requests runs the model once.

For a request whose output is determined (greedy, or sampling with a fixed seed), the
completion is a function of (model weights, prompt tokens, sampling, max_new_tokens):
the worker may serve a stored one instead of running the model. Opt-in twice, since
a cached answer is not a fresh sample and it costs no tokens of compute: the tenant
(`Tenant.result_cache`) and the request (`Sampling.cache`).

It is kvstore.cache's `Cache` (on the cache Redis, locks on the state Redis), so it has
what the seed's hot-key scenario asks for:
- logical expiry (`KVFLEET_RESULT_CACHE_TTL_S`, jittered ±10%) under a longer physical
  TTL, so entries written together do not expire together;
- stale-while-revalidate: a stale entry is served at once while one caller, the winner
  of the rebuild lock, runs the model again;
- a lock-guarded rebuild: of N identical requests that miss together, one runs the
  model and the others wait for its result (XFetch refreshes the hottest early).

Isolation: the key starts from the tenant's KV-cache namespace salt (Tenancy.cache_salt),
so tenants meet only inside a namespace they share, as for cached prefixes; the key is
a digest, so Redis never holds a prompt in clear. Values are msgpack, never pickle.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable

import msgspec
import redis

from kvfleet.constants import Keys
from kvfleet.contracts import Completion, JobRequest
from kvstore.cache import Cache

log = logging.getLogger("kvfleet.worker")


def outputs_fingerprint(model_fingerprint: str, kv_cache_dtype: str) -> str:
    """What a cached result's output depends on beyond the request: the model, and the
    KV pool's layout (an int8-v pool's outputs may differ from a 16-bit pool's by a
    token, so the two must never serve each other's results)."""
    return f"{model_fingerprint}:kv-{kv_cache_dtype}"


def determined(job: JobRequest) -> bool:
    """Its output is fixed by its inputs: greedy, or seeded sampling."""
    return job.sampling.temperature == 0.0 or job.sampling.seed is not None


class ResultCache:
    def __init__(self, client: redis.Redis, keys: Keys, model_fingerprint: str, *, ttl_s: float,
                 lock_client: redis.Redis | None = None, grace_s: float | None = None,
                 wait_timeout_s: float = 120.0, **cache_options) -> None:
        """`cache_options`: more of `Cache`'s (jitter, use_lock: the benchmark's baseline
        turns both off)."""
        self.keys = keys
        self.model_fingerprint = model_fingerprint
        self.cache = Cache(client, keys, name="result", ttl_s=ttl_s, grace_s=ttl_s if grace_s is None else grace_s,
                           lock_client=lock_client, wait_timeout_s=wait_timeout_s,
                           decode=lambda raw: msgspec.msgpack.decode(raw, type=Completion), **cache_options)

    def key(self, job: JobRequest, salt: str) -> str:
        """What the output depends on, digested: the namespace, the weights, the prompt,
        the sampling (the `cache` flag and, when greedy, the seed aside) and the length."""
        s = job.sampling
        material = msgspec.msgpack.encode([
            salt, self.model_fingerprint, job.prompt_tokens, job.max_new_tokens,
            s.temperature, s.top_p, s.top_k, s.seed if s.temperature > 0 else None, s.stop, s.stop_token_ids,
        ])
        digest = hashlib.blake2b(material, digest_size=16, person=b"kvfleet-result").hexdigest()
        return self.keys.result_cache(digest)

    def get_or_run(self, job: JobRequest, salt: str, run: Callable[[], Completion]) -> tuple[Completion, bool]:
        """The job's completion and whether it came from the cache (False: this caller ran
        the model). Served from the cache, it is dated now: the job ran now, for nothing."""
        ran: list[Completion] = []

        def build() -> Completion:
            ran.append(run())
            return ran[0]

        try:
            completion = self.cache.get_or_build(self.key(job, salt), build)
        except redis.RedisError:
            # The cache is an optimisation: a Redis failure costs a model run, never the
            # job, and never a second run (the one that already happened is kept).
            log.warning("result cache unavailable; running the model", extra={"job_id": job.job_id}, exc_info=True)
            return (ran[0] if ran else run()), False
        if ran:
            return completion, False
        now = time.time()
        return msgspec.structs.replace(completion, started_at=now, first_token_at=now, finished_at=now,
                                       cached_tokens=completion.prompt_tokens), True
