"""The engine: a thread-safe front end over one step loop that owns all model state.

Threading model: any thread may `submit`, `generate`, `cancel` or read `stats`. Those
only touch the inbox, the cancel set and the request table under one condition
variable. The step-loop thread alone touches the scheduler, the block manager, the
sequences and the model; it drains the inbox between steps, sleeps while there is no
work, and resolves each request's future. So nothing in the engine below this file
needs a lock, and `stats()` reads an immutable snapshot replaced after every step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence as Seq

from kvfleet.contracts import Completion, Sampling
from workers.engine import metrics
from workers.engine.block_manager import BlockManager, block_hash
from kvfleet.settings import EngineConfig
from workers.engine.errors import EngineStopped, InvalidRequest, PromptTooLong, RequestCancelled, StepFailed
from workers.engine.hooks import BlockHooks
from workers.engine.model_runner import ModelRunner, kv_bytes_per_block
from workers.engine.scheduler import ScheduledBatch, Scheduler
from workers.engine.sequence import Sequence
from workers.model.llama import KVCache
from workers.model.loader import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int  # empty or holding a free cache entry
    block_size: int
    capacity_tokens: int  # blocks_total * block_size
    tokens_in_use: int  # tokens of the running sequences
    prefix_cache_queries: int  # full prompt blocks looked up
    prefix_cache_hits: int  # ... found in the pool
    outside_cache_hits: int  # ... filled by the admission hook
    prompt_tokens_computed: int  # prefilled by the model (recomputation after preemption included)
    prompt_tokens_cached: int  # served from cache instead
    tokens_computed: int  # every token run through the model
    generated_tokens: int
    preemptions: int
    steps: int
    last_batch_size: int  # sequences in the last step
    max_batch_size: int  # most sequences in one step so far


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

    def cancel(self) -> bool:
        return self._engine.cancel(self.request_id)


class Engine:
    def __init__(self, loaded_model: LoadedModel, config: EngineConfig = EngineConfig(), *,
                 hooks: BlockHooks | None = None) -> None:
        self.loaded = loaded_model
        self.config = config
        self.max_model_len = min(config.max_model_len or loaded_model.max_context, loaded_model.max_context)
        bs = config.block_size
        num_blocks = config.num_blocks or config.kv_memory_bytes // kv_bytes_per_block(loaded_model, bs)
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"a KV pool of {num_blocks} blocks x {bs} tokens cannot hold one request of max_model_len "
                f"{self.max_model_len} tokens; raise kv_memory_bytes / num_blocks or lower max_model_len"
            )
        eos = set(loaded_model.config.eos_token_id)
        if loaded_model.tokenizer.eos_token_id is not None:
            eos.add(loaded_model.tokenizer.eos_token_id)
        self.block_manager = BlockManager(num_blocks, bs, loaded_model.fingerprint, hooks)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   eos_token_ids=frozenset(eos))
        self.runner = ModelRunner(loaded_model, num_blocks, bs)

        self._cond = threading.Condition()
        # Guarded by _cond:
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()
        self._calls: list[tuple[Callable[[], Any], Future]] = []
        self._requests: dict[str, tuple[Sequence, Future]] = {}
        self._stopping = False
        self._arrivals = itertools.count()
        # Step-loop thread only:
        self._steps = self._tokens_computed = self._generated = self._last_batch = self._max_batch = 0
        self._published_queries = self._published_hits = 0
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="kvfleet-engine", daemon=True)
        self._thread.start()

    # --- any thread --------------------------------------------------------------

    def submit(self, request_id: str, prompt_tokens: Seq[int], max_new_tokens: int,
               sampling: Sampling = Sampling(), *, priority_rank: int = 1, stop: Seq[str] = (),
               ignore_eos: bool = False) -> RequestHandle:
        """Queue a request. Stop strings are `sampling.stop` and `stop` together;
        `ignore_eos` (benchmarks) generates exactly `max_new_tokens`."""
        prompt = list(prompt_tokens)
        self._validate(prompt, max_new_tokens)
        future: Future[Completion] = Future()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shut down")
            if request_id in self._requests:
                raise InvalidRequest(f"request {request_id!r} is already in this engine")
            seq = Sequence(request_id, prompt, max_new_tokens, sampling, priority_rank=priority_rank,
                           stop=tuple(dict.fromkeys([*sampling.stop, *stop])), ignore_eos=ignore_eos,
                           arrival_order=next(self._arrivals))
            self._requests[request_id] = (seq, future)
            self._inbox.append(seq)
            self._cond.notify()
        return RequestHandle(self, request_id, future)

    def generate(self, request_id: str, prompt_tokens: Seq[int], max_new_tokens: int,
                 sampling: Sampling = Sampling(), *, priority_rank: int = 1, stop: Seq[str] = (),
                 ignore_eos: bool = False) -> Completion:
        """`submit` and wait for the result (or the error)."""
        return self.submit(request_id, prompt_tokens, max_new_tokens, sampling, priority_rank=priority_rank,
                           stop=stop, ignore_eos=ignore_eos).result()

    def cancel(self, request_id: str) -> bool:
        """Ends the request at the next step (its waiter gets RequestCancelled); False if unknown or done."""
        with self._cond:
            if request_id not in self._requests:
                return False
            self._cancels.add(request_id)
            self._cond.notify()
            return True

    def call_soon(self, fn: Callable[[], Any]) -> "Future[Any]":
        """Run `fn` on the step thread between two steps; the future holds its result.

        For work that must see the block pool still (no step can evict or overwrite a
        block while `fn` runs), such as copying a prefix's blocks to the cold tier.
        """
        future: Future[Any] = Future()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shut down")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def prefix_hashes(self, prompt_tokens: Seq[int]) -> list[str]:
        """Chained hashes of the prompt's full blocks that a cache could serve (all but
        the block holding the last token, whose logits are always computed)."""
        bs, fp = self.block_manager.block_size, self.block_manager.fingerprint
        hashes: list[str] = []
        for i in range((len(prompt_tokens) - 1) // bs):
            hashes.append(block_hash(hashes[-1] if hashes else None, prompt_tokens[i * bs:(i + 1) * bs], fp))
        return hashes

    def cached_block_ids(self, hashes: Seq[str]) -> list[int]:
        """Pool block ids of the leading run of `hashes` held in the hot tier. Exact only
        on the step thread (inside `call_soon`); elsewhere a hint that may be stale."""
        found: list[int] = []
        for h in hashes:
            bid = self.block_manager.hash_to_block.get(h)
            if bid is None:
                break
            found.append(bid)
        return found

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def kv_cache(self) -> KVCache:
        """Per layer (k, v), each (num_blocks, block_size, num_kv_heads, head_dim): for block hooks."""
        return self.runner.kv_cache

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the step loop; requests still in flight fail with EngineStopped."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

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

    # --- step-loop thread --------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                try:
                    self._step()
                except Exception as e:  # the model or a hook failed: fail what is in flight, keep serving
                    self._fail_in_flight(e)
        finally:  # however the loop ends, no caller is left waiting
            log.info("engine loop stopped")
            with self._cond:
                self._stopping = True
                self._inbox.clear()
                pending = [seq for seq, _ in self._requests.values()]
            self._fail(pending, EngineStopped("the engine shut down before the request finished"))

    def _wait_for_work(self) -> bool:
        """Take new requests and cancellations; sleep while idle. False once stopping."""
        with self._cond:
            while not (self._inbox or self._cancels or self._calls or self._stopping) and self.scheduler.is_idle:
                self._publish_stats()
                self._cond.wait()
            if self._stopping:
                return False
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            calls, self._calls = self._calls, []
            requests = {rid: self._requests[rid][0] for rid in cancels if rid in self._requests}
        for seq in inbox:
            self.scheduler.add(seq)
        self._fail(list(requests.values()), RequestCancelled("cancelled"))
        for fn, future in calls:
            try:
                future.set_result(fn())
            except Exception as e:  # the caller's error, delivered to the caller
                future.set_exception(e)
        return True

    def _step(self) -> None:
        batch = self.scheduler.schedule()
        if batch.seqs:  # empty only when the one running sequence preempted itself
            sampled = self.runner.run(batch)
            finished = self.scheduler.postprocess(batch, sampled)
            self._after_step(batch, sampled, finished)
        self._publish_stats()

    def _after_step(self, batch: ScheduledBatch, sampled: list[int | None], finished: list[Sequence]) -> None:
        now = time.time()
        new_tokens = 0
        for seq, token in zip(batch.seqs, sampled):
            if token is None:
                continue
            new_tokens += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                metrics.TIME_TO_FIRST_TOKEN.observe(now - seq.submitted_at)
            if seq.stop and not seq.is_finished and self._stop_at(seq) is not None:
                self.scheduler.finish(seq, "stop")
                finished.append(seq)
        for seq in finished:
            seq.finished_at = now
            if seq.num_completion_tokens > 1:
                metrics.TIME_PER_OUTPUT_TOKEN.observe((now - seq.first_token_at) / (seq.num_completion_tokens - 1))
            self._resolve(seq, completion=self._completion(seq))
        self._steps += 1
        self._tokens_computed += batch.num_tokens
        self._generated += new_tokens
        self._last_batch = len(batch.seqs)
        metrics.BATCH_SIZE.observe(self._last_batch)
        self._max_batch = max(self._max_batch, self._last_batch)
        metrics.GENERATED_TOKENS.inc(new_tokens)

    def _stop_at(self, seq: Sequence) -> tuple[str, int] | None:
        """(text, index of the earliest stop string in it), or None."""
        text = self.loaded.tokenizer.decode(seq.completion_token_ids)
        hits = [i for i in (text.find(s) for s in seq.stop) if i >= 0]
        return (text, min(hits)) if hits else None

    def _completion(self, seq: Sequence) -> Completion:
        found = self._stop_at(seq) if seq.stop else None
        if found:  # the stop string and what follows it are cut; the tokens stay
            text, reason = found[0][:found[1]], "stop"
        else:
            text, reason = self.loaded.tokenizer.decode(seq.completion_token_ids), seq.finish_reason
        return Completion(text=text, tokens=seq.completion_token_ids, finish_reason=reason,
                          prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
                          started_at=seq.started_at, first_token_at=seq.first_token_at,
                          finished_at=seq.finished_at)

    def _fail_in_flight(self, cause: Exception) -> None:
        """Every request the scheduler has taken, wherever the failed step left it."""
        with self._cond:
            queued = {id(seq) for seq in self._inbox}
            seqs = [seq for seq, _ in self._requests.values() if id(seq) not in queued]
        log.error("engine step failed; failing %d requests", len(seqs), exc_info=cause)
        error = StepFailed(f"engine step failed: {cause!r}")
        error.__cause__ = cause
        self._fail(seqs, error)

    def _fail(self, seqs: list[Sequence], error: Exception) -> None:
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "aborted")
            self._resolve(seq, error=error)

    def _resolve(self, seq: Sequence, *, completion: Completion | None = None, error: Exception | None = None) -> None:
        with self._cond:
            entry = self._requests.pop(seq.request_id, None)
        if entry is None:
            return
        if error is None:
            entry[1].set_result(completion)
        else:
            entry[1].set_exception(error)

    def _publish_stats(self) -> None:
        s = self._stats = self._snapshot()
        metrics.RUNNING_SEQUENCES.set(s.running)
        metrics.WAITING_SEQUENCES.set(s.waiting)
        metrics.KV_BLOCKS_USED.set(s.blocks_used)
        metrics.KV_BLOCKS_FREE.set(s.blocks_free)
        metrics.PREFIX_CACHE_QUERIES.inc(s.prefix_cache_queries - self._published_queries)
        metrics.PREFIX_CACHE_HITS.inc(s.prefix_cache_hits - self._published_hits)
        self._published_queries, self._published_hits = s.prefix_cache_queries, s.prefix_cache_hits

    def _snapshot(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        return EngineStats(
            running=len(sch.running), waiting=len(sch.waiting),
            blocks_total=bm.num_blocks, blocks_used=bm.num_blocks - bm.num_free_blocks,
            blocks_free=bm.num_free_blocks, block_size=bm.block_size,
            capacity_tokens=bm.num_blocks * bm.block_size,
            tokens_in_use=sum(s.num_tokens for s in sch.running),
            prefix_cache_queries=bm.cache_queries, prefix_cache_hits=bm.cache_hits,
            outside_cache_hits=bm.outside_hits,
            prompt_tokens_computed=sch.prompt_tokens_computed, prompt_tokens_cached=sch.prompt_tokens_cached,
            tokens_computed=self._tokens_computed, generated_tokens=self._generated,
            preemptions=sch.num_preemptions, steps=self._steps,
            last_batch_size=self._last_batch, max_batch_size=self._max_batch,
        )
