"""One request's state inside the engine: its tokens, its KV blocks, its progress."""

from __future__ import annotations

import enum
import time
from typing import Callable, Optional

import torch

from kvfleet.contracts import Sampling
from workers.engine.spec import PromptLookup
from workers.model.sampling import make_generator


class SequenceStatus(str, enum.Enum):
    WAITING = "waiting"  # not holding blocks: new, or preempted
    RUNNING = "running"  # holding blocks; prefilling or decoding
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_tokens: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        *,
        priority_rank: int,
        stop: tuple[str, ...],
        ignore_eos: bool,
        arrival_order: int,
        on_token: Optional[Callable[[int], None]] = None,
        cache_salt: Optional[str] = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_tokens)  # prompt, then every generated token
        self.num_prompt_tokens = len(prompt_tokens)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.generator: torch.Generator | None = make_generator(sampling)
        self.priority_rank = priority_rank  # 0 is served first (contracts.Priority.rank)
        self.stop = stop
        self.ignore_eos = ignore_eos
        self.stop_token_ids = frozenset(sampling.stop_token_ids)  # end it like EOS, even with ignore_eos
        #: Told each new token on the step thread (a stream's publisher): O(1), never blocks.
        self.on_token = on_token
        self.arrival_order = arrival_order  # ties in priority go to the older request
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "eos" | "stop" | "length"
        #: Ended by one of `stop_token_ids`: that token stays in the tokens but not in the text.
        self.stopped_by_token = False

        #: Root of its block-hash chain: its tenant's KV-cache namespace (None: the
        #: engine used alone, as benchmarks and tests do).
        self.cache_salt = cache_salt
        self.block_table: list[int] = []
        #: Chained hashes of the leading full blocks, computed once and kept across
        #: preemption (the tokens of a full block never change).
        self.block_hashes: list[str] = []
        #: Tokens whose K/V are in this sequence's blocks (cached or computed).
        self.num_computed_tokens = 0
        #: Prompt tokens served from the prefix cache when first admitted.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        #: Proposes up to `num_speculative_tokens` drafts per decode step (workers/engine/spec.py);
        #: None: this sequence decodes one token a step.
        self.drafter = PromptLookup(num_speculative_tokens) if num_speculative_tokens > 0 else None

        self.submitted_at = time.time()  # unix seconds, for the Completion
        self.started_at: float | None = None  # first scheduled
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def text_token_ids(self) -> list[int]:
        """The completion tokens its text is decoded from: all but a stop token that ended it."""
        ids = self.completion_token_ids
        return ids[:-1] if self.stopped_by_token else ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Past its prompt with K/V for all but its last token: a step computes one
        token of its own (a prefill, or the recomputation after a preemption, computes more)."""
        return self.num_completion_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Service order: priority first, then age. The largest key is preempted first."""
        return (self.priority_rank, self.arrival_order)

    def num_blocks(self, block_size: int) -> int:
        """Blocks needed to hold every token's K/V."""
        return (self.num_tokens + block_size - 1) // block_size

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size:(index + 1) * block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
