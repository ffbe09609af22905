"""The engine's front end: what other threads call.

`Engine` builds the parts (block manager ← scheduler, model runner, kernels) from one
EngineConfig, starts the step loop (workers/engine/loop.py), and hands requests to it
through the inbox (workers/engine/inbox.py).

Threads. Any thread may `submit`, `generate`, `cancel`, `call_soon` or read `stats`:
those touch only the inbox, under its lock, and the stats snapshot, an immutable object
the step thread replaces after every step. The step thread alone runs the scheduler,
the sequences and the model, and alone writes the block manager and the KV pool.

Other threads do read the block manager, in two places, both from the shared-prefix step
on Celery task threads (workers/prefix.py):
- `block_manager.prefix_hashes(prompt)` reads only fields fixed at construction: safe.
- `block_manager.cached_block_ids(hashes)` reads `hash_to_block` while the step thread
  changes it: each lookup is atomic, so the answer is a hint that may be stale (see the
  method), which prefix.py uses as such and repeats inside `call_soon`, where it is exact.
`fingerprint` and `block_size` (the cold tier's keys and layout) are fixed. The KV pool's
tensors are read outside the step thread only inside `call_soon`.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Sequence as Seq

from kernels import ops
from kernels.ops import Kernels
from kvfleet.contracts import Completion, Sampling
from kvfleet.settings import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.errors import InvalidRequest, PromptTooLong
from workers.engine.hooks import BlockHooks
from workers.engine.inbox import Inbox
from workers.engine.loop import StepLoop
from workers.engine.model_runner import ModelRunner, kv_bytes_per_block
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.engine.stats import EngineStats
from workers.model.llama import KVCache, VScales
from workers.model.loader import LoadedModel


class RequestHandle:
    """What `submit` returns: wait for the result or cancel the request."""

    def __init__(self, engine: "Engine", request_id: str, future: "Future[Completion]") -> None:
        self.request_id = request_id
        self._engine = engine
        self._future = future

    def result(self, timeout: float | None = None) -> Completion:
        """Blocks; raises the engine's error (RequestCancelled, StepFailed, ...) instead."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[["RequestHandle"], object]) -> None:
        """Call `fn(self)` once the request has its result or its error (at once if it has)."""
        self._future.add_done_callback(lambda _: fn(self))

    def cancel(self) -> bool:
        return self._engine.cancel(self.request_id)


class Engine:
    def __init__(self, loaded_model: LoadedModel, config: EngineConfig = EngineConfig(), *,
                 hooks: BlockHooks | None = None) -> None:
        self.loaded = loaded_model
        self.config = config
        self.max_model_len = min(config.max_model_len or loaded_model.max_context, loaded_model.max_context)
        bs = config.block_size
        num_blocks = config.num_blocks or config.kv_memory_bytes // kv_bytes_per_block(
            loaded_model, bs, config.kv_cache_dtype)
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"a KV pool of {num_blocks} blocks x {bs} tokens cannot hold one request of max_model_len "
                f"{self.max_model_len} tokens; raise kv_memory_bytes / num_blocks or lower max_model_len"
            )
        eos = set(loaded_model.config.eos_token_id)
        if loaded_model.tokenizer.eos_token_id is not None:
            eos.add(loaded_model.tokenizer.eos_token_id)
        self.kernels: Kernels = ops.select(config.kernels, config.attention)
        self.block_manager = BlockManager(num_blocks, bs, loaded_model.fingerprint, hooks)
        scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens, eos_token_ids=frozenset(eos),
                              priority_step_slack=config.priority_step_slack,
                              decode_step_slack=config.decode_step_slack)
        self._runner = ModelRunner(loaded_model, num_blocks, bs, self.kernels, kv_cache_dtype=config.kv_cache_dtype)
        self._inbox = Inbox()
        self._loop = StepLoop(self._inbox, scheduler, self._runner, loaded_model.tokenizer)
        self._loop.start()

    def tokens_per_s(self) -> float | None:
        """What one more token in a step costs here, as tokens per second (the slope of
        the engine's step-cost fit): the rate at which this worker computes a prompt's
        tokens. None until enough steps were measured."""
        fit = self._loop.scheduler.step_cost.fit()
        return None if fit is None or fit[1] <= 0 else 1.0 / fit[1]

    def submit(self, request_id: str, prompt_tokens: Seq[int], max_new_tokens: int,
               sampling: Sampling = Sampling(), *, priority_rank: int = 1, stop: Seq[str] = (),
               ignore_eos: bool = False, on_token: Callable[[int], None] | None = None,
               cache_salt: str | None = None) -> RequestHandle:
        """Queue a request. Stop strings are `sampling.stop` and `stop` together;
        `ignore_eos` (benchmarks) generates exactly `max_new_tokens` unless a
        `sampling.stop_token_ids` token ends it. `on_token(token_id)` is called on the
        step thread with each new token, in order, before the result resolves: it must
        be O(1) and never block (put it on a queue), or it stalls every request.
        `cache_salt` (32 hex chars) roots its block hashes in a cache namespace: it
        shares cached blocks only with requests of the same salt. `sampling.speculative`
        (None: `EngineConfig.speculate`) turns speculative decoding on or off for it."""
        prompt = list(prompt_tokens)
        self._validate(prompt, max_new_tokens)
        stops = tuple(dict.fromkeys([*sampling.stop, *stop]))
        speculate = self.config.speculate if sampling.speculative is None else sampling.speculative
        future = self._inbox.put(request_id, lambda arrival_order: Sequence(
            request_id, prompt, max_new_tokens, sampling, priority_rank=priority_rank, stop=stops,
            ignore_eos=ignore_eos, arrival_order=arrival_order, on_token=on_token, cache_salt=cache_salt,
            num_speculative_tokens=self.config.spec_tokens if speculate else 0))
        return RequestHandle(self, request_id, future)

    def generate(self, request_id: str, prompt_tokens: Seq[int], max_new_tokens: int,
                 sampling: Sampling = Sampling(), *, priority_rank: int = 1, stop: Seq[str] = (),
                 ignore_eos: bool = False, on_token: Callable[[int], None] | None = None,
                 cache_salt: str | None = None) -> Completion:
        """`submit` and wait for the result (or the error)."""
        return self.submit(request_id, prompt_tokens, max_new_tokens, sampling, priority_rank=priority_rank,
                           stop=stop, ignore_eos=ignore_eos, on_token=on_token, cache_salt=cache_salt).result()

    def cancel(self, request_id: str) -> bool:
        """Ends the request at the next step (its waiter gets RequestCancelled); False if unknown or done."""
        return self._inbox.cancel(request_id)

    def call_soon(self, fn: Callable[[], Any]) -> "Future[Any]":
        """Run `fn` on the step thread between two steps; the future holds its result.

        For work that must see the block pool still (no step can evict or overwrite a
        block while `fn` runs), such as copying a prefix's blocks to the cold tier.
        """
        return self._inbox.call(fn)

    def stats(self) -> EngineStats:
        return self._loop.stats

    @property
    def kv_cache(self) -> KVCache:
        """Per layer (k, v), each (num_blocks, block_size, num_kv_heads, head_dim): for block hooks.
        With kv_cache_dtype "int8-v" each v is int8 and means nothing without `v_scales`."""
        return self._runner.kv_cache

    @property
    def v_scales(self) -> VScales:
        """Per layer (num_blocks, block_size, num_kv_heads) fp16 scales of the int8 V rows; None
        unless kv_cache_dtype is "int8-v"."""
        return self._runner.v_scales

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the step loop; requests still in flight fail with EngineStopped."""
        self._inbox.stop()
        self._loop.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _validate(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise InvalidRequest("prompt_tokens is empty")
        if max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.loaded.config.vocab_size
        if not all(0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt_tokens must be ids in 0..{vocab - 1}")
        if len(prompt) + max_new_tokens > self.max_model_len:
            raise PromptTooLong(
                f"prompt of {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceeds the context of "
                f"{self.max_model_len} tokens; shorten the prompt or ask for at most "
                f"{max(self.max_model_len - len(prompt), 0)} new tokens"
            )
