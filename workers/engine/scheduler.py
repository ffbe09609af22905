"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step has a budget of `max_num_batched_tokens`. Running sequences go first, in
service order (priority rank, then age): a decoding sequence takes 1 token, a prefill
still in progress takes what is left of its prompt, up to the budget (chunked prefill).
Then waiting sequences are admitted in the same order while blocks, sequence slots and
budget allow, so prefills and decodes share one step (a mixed batch).

Stall-free decodes: while sequences are decoding, a step's prefill chunks together (new
prompts, the rest of a prompt, a preempted sequence's recomputation) take only as many
tokens as keep the step within `decode_step_slack` of the decodes' work alone
(StepCost), and never fewer than one. Every decoding sequence waits the whole step for
its one token, so the prefill beside it sets its time per output token; held to a bound,
a burst of long prompts is spread over many steps instead of stalling every decode for
whole-budget chunks (Sarathi-Serve's stall-free batching, with a time budget instead of
a token one: on a GPU, where a token costs almost nothing, it is no limit). The bound
holds a prompt back only for decodes ahead of it in service order: a high-priority
prompt with only batch lines decoding is not spread over many steps to spare decodes it
outranks (the priority guard below bounds what those get beside it). With no decode
ahead, or no fit yet, a prefill takes the whole budget.

When a decoding sequence needs a new block and none is free, the sequence last in
service order (lowest priority, newest) is preempted: its blocks are released and it
goes back to waiting with its tokens, to be recomputed later. Its full blocks stay in
the pool as cache entries, so the recomputation is mostly prefix-cache hits. A waiting
sequence that outranks the back of the running list and finds no slot or no blocks
preempts it the same way: a batch line never keeps an online request out.

Priority under batching: the best class with work (the lowest rank running or waiting)
is scheduled first, running then waiting; lower classes then fill the step only with as
many tokens as keep it within `priority_step_slack` of the best class's work alone
(StepCost, learnt from the engine's own step times), and never fewer than one, so they
are slowed, not starved. With one class in the engine there is no guard.

Speculation (workers/engine/spec.py): a running sequence with a drafter that reaches the
end of its tokens in this step also computes the drafts it proposes, within the same
budget and only in slots that evict nothing; `postprocess` keeps what the model agreed
with and rolls the rest back.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable

from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.step_cost import StepCost


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens each sequence computes in this step, its drafts included
    #: Each sequence's draft tokens (mostly none), computed after its own last token: the
    #: last len(drafts) of its num_new_tokens.
    drafts: list[list[int]]

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
        priority_step_slack: float = float("inf"),
        step_cost: StepCost | None = None,
        decode_step_slack: float = float("inf"),
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_step_slack = decode_step_slack
        self.eos_token_ids = eos_token_ids
        self.priority_step_slack = priority_step_slack
        #: Fed by the step loop with every step's tokens and seconds.
        self.step_cost = step_cost or StepCost()
        self.num_priority_preemptions = 0  # lower-class sequences preempted for a waiting better one
        self.guarded_steps = 0  # steps in which the guard held lower-class tokens back
        # Both kept sorted by Sequence.sort_key: the front is served first, the back preempted first.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prompt_tokens_cached = 0  # tokens found in cache at admission (pool or outside tier)
        self.prompt_tokens_computed = 0  # tokens that admission left to prefill
        self.spec_draft_tokens = 0  # draft tokens verified by the model
        self.spec_accepted_tokens = 0  # ... and kept

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def schedule(self) -> ScheduledBatch:
        self._preempt_for_waiting()
        top = self._top_rank()
        step = _Step(self.max_num_batched_tokens, self._prefill_limits())
        self._schedule_running(step, lambda seq: seq.priority_rank <= top)
        self._admit_waiting(step, max_rank=top)
        if self._has_lower(top):
            step.lower_allowance = self.step_cost.extra_tokens(step.num_tokens, self.priority_step_slack)
        self._schedule_running(step, lambda seq: seq.priority_rank > top)
        self._admit_waiting(step, max_rank=None)
        if step.held_back:
            self.guarded_steps += 1
        return ScheduledBatch(step.seqs, step.counts, step.drafts)

    def _prefill_limits(self) -> "_PrefillLimits":
        """The stall-free bound of the next step: while sequences decode, the prefill
        tokens that keep the step within `decode_step_slack` of their tokens alone; but
        a prompt with no decode ahead of it in service order takes the whole budget."""
        keys = [seq.sort_key for seq in self.running]  # sorted: the running list's order
        first_decode = next((i for i, seq in enumerate(self.running) if seq.is_decoding), None)
        decoding = sum(seq.is_decoding for seq in self.running)
        extra = self.step_cost.extra_tokens(decoding, self.decode_step_slack) if decoding else None
        bound = self.max_num_batched_tokens if extra is None else min(extra, self.max_num_batched_tokens)

        def limit(seq: Sequence) -> int:
            ahead = first_decode is not None and bisect.bisect_left(keys, seq.sort_key) > first_decode
            return bound if ahead else self.max_num_batched_tokens

        return limit

    def _top_rank(self) -> int:
        """The best class with work: it sets the pace of the step."""
        ranks = [seq.priority_rank for seq in self.running[:1] + self.waiting[:1]]
        return min(ranks, default=0)

    def _has_lower(self, top: int) -> bool:
        # Both lists are sorted by rank: their backs hold their lowest classes.
        return any(seq.priority_rank > top for seq in self.running[-1:] + self.waiting[-1:])

    def _schedule_running(self, step: "_Step", which) -> None:
        for seq in list(self.running):  # a copy: preemption removes from the back
            if step.budget == 0:
                return
            if seq.status != SequenceStatus.RUNNING or not which(seq):
                continue  # preempted earlier in this step, or the other pass's
            wanted = seq.num_uncomputed_tokens
            prefill = not seq.is_decoding  # a prompt's chunk or a recomputation: within the prefill budget
            drafts = self._propose(seq, step.budget - wanted)
            n = step.grant(wanted + len(drafts), prefill=seq if prefill else None)
            if n == 0:
                continue  # held back a step: by the guard (a lower class) or the prefill bound
            if not self._make_room(seq):
                step.refund(n)
                step.preempted = True
                continue
            # Drafts only after the sequence's last token, and only in what the budget
            # and the free blocks give them (they never preempt or evict).
            drafts = drafts[:max(n - wanted, 0)][:self.block_manager.num_lookahead_slots(seq)]
            if drafts:
                self.block_manager.may_append(seq, len(drafts))
            used = min(n, wanted) + len(drafts)
            step.refund(n - used)
            step.add(seq, used, drafts, prefill=prefill)

    def _admit_waiting(self, step: "_Step", max_rank: int | None) -> None:
        # No admissions after a preemption: blocks are short, and a new prompt would
        # only take what the preempted sequences need back.
        while not step.preempted and self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if max_rank is not None and seq.priority_rank > max_rank:
                return
            if not self.block_manager.can_allocate(seq):
                return  # head of line waits: admitting smaller ones behind it would starve it
            n = step.grant(seq.num_uncomputed_tokens, prefill=seq)
            if n == 0:
                return
            self._admit(seq)
            # Admission may have found cached blocks: the chunk is what is left to compute.
            used = min(n, seq.num_uncomputed_tokens)
            step.refund(n - used)
            step.add(seq, used, prefill=True)

    def _preempt_for_waiting(self) -> None:
        """While the head of the waiting list outranks the back of the running list and
        cannot be admitted (no slot, no blocks), preempt the back (recomputed later)."""
        while self.waiting and self.running:
            head, back = self.waiting[0], self.running[-1]
            if head.priority_rank >= back.priority_rank:
                return
            if len(self.running) < self.max_num_seqs and self.block_manager.can_allocate(head):
                return
            self._preempt(back)
            self.num_priority_preemptions += 1

    def _propose(self, seq: Sequence, room: int) -> list[int]:
        """Drafts for `seq` if it has a drafter and reaches its end with `room` tokens of
        the step's budget to spare."""
        if seq.drafter is None or room <= 0:
            return []
        # The model adds a token of its own after the drafts: never more than the request may take.
        return seq.drafter.propose(seq.token_ids, min(room, seq.max_new_tokens - seq.num_completion_tokens - 1))

    def postprocess(self, batch: ScheduledBatch, sampled: list[list[int]],
                    stop_string: Callable[[Sequence], bool] | None = None) -> list[Sequence]:
        """Record a finished step; returns the sequences it finished.

        `sampled[i]`: the tokens the model gave sequence i: none for a prefill chunk short
        of the prompt's end, else the drafts it kept and one of its own. They are appended
        one by one, and the first that ends the sequence (EOS, a stop token, the length,
        or `stop_string(seq)`: its text now holds a stop string) drops those after it, as
        decoding one token a step would have; `sampled[i]` is cut to the tokens kept.
        """
        finished = []
        for seq, n, drafts, tokens in zip(batch.seqs, batch.num_new_tokens, batch.drafts, sampled, strict=True):
            rejected = 0
            if drafts:
                accepted = len(tokens) - 1
                rejected = len(drafts) - accepted
                self.spec_draft_tokens += len(drafts)
                self.spec_accepted_tokens += accepted
                seq.drafter.observe(accepted)
            reason = None
            for kept, token in enumerate(tokens, start=1):
                seq.append_token(token)
                reason = self._finish_reason(seq, token, stop_string)
                if reason is not None:
                    del tokens[kept:]
                    break
            # K/V are valid for every token the step computed up to the first rejected
            # draft; of those, only the ones still in the sequence count.
            computed = min(seq.num_computed_tokens + n - rejected, seq.num_tokens)
            new = computed - seq.num_computed_tokens
            seq.num_computed_tokens = computed
            self.block_manager.cache_computed_blocks(seq, new)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
            elif drafts:
                self.block_manager.rollback(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int, stop_string: Callable[[Sequence], bool] | None) -> str | None:
        """Why `token`, just appended, ends `seq` (None: it does not)."""
        if token in self.eos_token_ids and not seq.ignore_eos:
            return "eos"
        if token in seq.stop_token_ids:
            # The request's own end tokens (a chat template's end of turn): an EOS by
            # another name, so "stop", and kept out of the text like EOS.
            seq.stopped_by_token = True
            return "stop"
        if seq.num_completion_tokens >= seq.max_new_tokens:
            return "length"
        if stop_string is not None and stop_string(seq):
            return "stop"
        return None

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


#: A prefilling sequence -> the prefill tokens a step may hold with it (the stall-free bound).
_PrefillLimits = Callable[[Sequence], int]


class _Step:
    """One step being assembled: its sequences, their tokens, what is left of the step's
    token budget and of the lower classes' allowance (None: no allowance set), and the
    prefill tokens granted so far, which count against each next prefill's limit."""

    def __init__(self, budget: int, prefill_limits: _PrefillLimits) -> None:
        self.seqs: list[Sequence] = []
        self.counts: list[int] = []
        self.drafts: list[list[int]] = []
        self.budget = budget
        self.prefill_limits = prefill_limits
        self.prefill_tokens = 0
        self.num_tokens = 0
        self.lower_allowance: int | None = None
        self.preempted = False
        self.held_back = False

    def grant(self, wanted: int, *, prefill: Sequence | None = None) -> int:
        """Tokens a sequence that wants `wanted` may compute in this step (0: none):
        bounded by the step's budget, a prefill's (`prefill`: the sequence) also by its
        stall-free limit less the prefill tokens already granted, and, once set, taken
        from the lower classes' allowance. `add` spends the budgets."""
        n = min(wanted, self.budget)
        if prefill is not None:
            n = min(n, max(self.prefill_limits(prefill) - self.prefill_tokens, 0))
        if self.lower_allowance is not None:
            if self.lower_allowance < n:
                self.held_back = True
            n = min(n, self.lower_allowance)
            self.lower_allowance -= n
        return n

    def refund(self, n: int) -> None:
        """Give back granted tokens a sequence did not use (preempted, or found cached)."""
        if self.lower_allowance is not None:
            self.lower_allowance += n

    def add(self, seq: Sequence, n: int, drafts: list[int] | None = None, *, prefill: bool = False) -> None:
        self.seqs.append(seq)
        self.counts.append(n)
        self.drafts.append(drafts or [])
        self.budget -= n
        if prefill:
            self.prefill_tokens += n
        self.num_tokens += n
