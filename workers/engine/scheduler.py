"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a budget of `max_num_batched_tokens`. Running sequences go first, in
service order (priority rank, then age): a decoding sequence takes 1 token, a prefill
still in progress takes what is left of its prompt, up to the budget (chunked prefill).
Then waiting sequences are admitted in the same order while blocks, sequence slots and
budget allow, so prefills and decodes share one step (a mixed batch).

When a decoding sequence needs a new block and none is free, the sequence last in
service order (lowest priority, newest) is preempted: its blocks are released and it
goes back to waiting with its tokens, to be recomputed later. Its full blocks stay in
the pool as cache entries, so the recomputation is mostly prefix-cache hits.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes in this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids = eos_token_ids
        # Both kept sorted by Sequence.sort_key: the front is served first, the back preempted first.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prompt_tokens_cached = 0  # tokens found in cache at admission (pool or outside tier)
        self.prompt_tokens_computed = 0  # tokens that admission left to prefill

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False
        for seq in list(self.running):  # a copy: preemption removes from the back
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._make_room(seq):
                preempted = True
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        # No admissions after a preemption: blocks are short, and a new prompt would
        # only take what the preempted sequences need back.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break  # head of line waits: admitting smaller ones behind it would starve it
            self._admit(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def postprocess(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Record a finished step; returns the sequences it finished (EOS, a stop token or length)."""
        finished = []
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, sampled, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq, n)
            if token is None:
                continue  # a prefill chunk short of the prompt's end: nothing to sample yet
            seq.append_token(token)
            if token in self.eos_token_ids and not seq.ignore_eos:
                self.finish(seq, "eos")
                finished.append(seq)
            elif token in seq.stop_token_ids:
                # The request's own end tokens (a chat template's end of turn): an EOS
                # by another name, so "stop", and kept out of the text like EOS.
                self.finish(seq, "stop")
                seq.stopped_by_token = True
                finished.append(seq)
            elif seq.num_completion_tokens >= seq.max_new_tokens:
                self.finish(seq, "length")
                finished.append(seq)
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` wherever it is (running or waiting) and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _admit(self, seq: Sequence) -> None:
        self.block_manager.allocate(seq)  # first: if a hook raises, seq is still in waiting
        self.waiting.pop(0)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)
        self.prompt_tokens_cached += seq.num_computed_tokens
        self.prompt_tokens_computed += seq.num_uncomputed_tokens
        if seq.started_at is None:  # first admission, not a re-admission after preemption
            seq.started_at = time.time()
            seq.num_cached_tokens = seq.num_computed_tokens

    def _make_room(self, seq: Sequence) -> bool:
        """A slot for `seq`'s next token, preempting from the back of the running list;
        False when `seq` itself was the one preempted."""
        while not self.block_manager.can_append(seq):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.may_append(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
