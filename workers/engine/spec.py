"""Speculative decoding without a draft model: prompt-lookup drafts, verified in one pass.

A decoding sequence computes one token a step, and on a small batch that step costs
about as much for a few tokens as for one (the weights are read once either way). When
the sequence's last tokens occurred earlier in its prompt or output (code being edited,
a summary quoting its source, a list of one shape), the tokens that followed them then
are a cheap guess at what follows now. `PromptLookup` proposes up to k of them; the
scheduler gives the sequence 1 + k tokens in the step, and the model runner feeds
[last token, d1 .. dk] as one chunk over the cached context (the chunked-prefill path),
so that row j's logits are the model's distribution for the token after d1 .. dj.
`verify` keeps the drafts the model agrees with and adds one token of the model's own:
a step yields 1 to k + 1 tokens. The K/V written for rejected drafts are rolled back by
the block manager (`BlockManager.rollback`): their slots are past the sequence's computed
tokens, so they are never read or published, and blocks that held only them are freed.

Exactness. At each row the model chooses a token exactly as decoding one token a step
would (the argmax; or one draw of `sample_row` from the request's generator, whose j-th
draw is the j-th token's), and a draft is kept while it equals that choice; the first
choice that differs is the step's last token. Greedy: every token is the model's argmax
given the tokens before it. Sampling: this is speculative sampling (Leviathan et al.
2023; Chen et al. 2023) for a point-mass draft q = δ(d), whose rule is: accept d with
probability min(1, p(d) / q(d)) = p(d), and on rejection draw from the residual
max(p - q, 0) renormalised, which is p with d's mass removed. Drawing x ~ p and keeping
d iff x = d accepts with probability p(d), and on rejection x is p conditioned on x ≠ d:
the residual. So every token comes out with probability p(x), as without speculation;
and because the draws are the ones plain decoding makes, in the same order, a seeded
request gets the same tokens with and without speculation (up to the rounding of the
k + 1-row forward, as for a batched one), which keeps seeded requests reproducible and
the result cache's keys (workers/result_cache.py) valid.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvfleet.contracts import Sampling
from workers.model.sampling import sample_row

#: Longest and shortest suffix looked up. Three tokens find the phrase a repetition is
#: in; one still finds a single repeated token (a run of spaces, a closing bracket).
#: Misses cost nothing (no draft); wrong guesses cost their verification, which the
#: adaptive length and the back-off keep rare while they keep failing.
MAX_NGRAM = 3
MIN_NGRAM = 1
#: After a draft the model rejected outright, the drafter rests 1, 2, 4 ... up to this
#: many steps (doubling while rejections go on, reset by any acceptance). Sampled text
#: that does not repeat rejects ~97% of one-token guesses (builtin:english at
#: temperature 1), and a step with a draft costs 1.2-1.6x one without on a small batch
#: (docs/engine.md). With the rests such text gets drafts for 7% of its tokens (over 192;
#: the first rests are short), while a repetition that starts is found within 32 tokens.
#: A cap of 16 drafted for 8.5% and found no more of the repetitive workload's tokens.
MAX_BACKOFF = 32


class PromptLookup:
    """The drafter of one sequence: the continuation of the latest earlier occurrence of
    its last n tokens (n from MAX_NGRAM down to MIN_NGRAM), in its prompt and output.

    Keeps an index of where each n-gram last ended, extended by the tokens appended since
    the last call, so a proposal costs O(MAX_NGRAM) per new token rather than a scan of the
    whole sequence per step. Tokens are only ever appended (preemption keeps them), so the
    index stays valid for the sequence's life.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"a drafter proposes at least 1 token, got max_tokens={max_tokens}")
        self.max_tokens = max_tokens
        #: The next draft's length: the last verification's accepted count + 1, up to
        #: max_tokens. A run of agreement grows it a token a step; a miss cuts it back,
        #: so text that does not repeat costs about one wasted row a step.
        self.num_tokens = max_tokens
        self._backoff = 0  # steps to rest after the next outright rejection, halved
        self._rest = 0  # proposals still to skip
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
        self._indexed = 0  # n-grams ending (exclusive) at positions up to this one are indexed

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(num_tokens, limit) draft tokens to follow `token_ids`; [] when its
        suffix occurred nowhere before."""
        self._extend(token_ids)
        k = min(self.num_tokens, limit)
        if k <= 0:
            return []
        if self._rest > 0:
            self._rest -= 1
            return []
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(token_ids) > n:
                end = self._ends[n].get(tuple(token_ids[-n:]))
                if end is not None:
                    return _copy_from(token_ids, end, k)
        return []

    def observe(self, accepted: int) -> None:
        """After a verification that kept `accepted` of the drafts."""
        self.num_tokens = min(self.max_tokens, accepted + 1)
        if accepted:
            self._backoff = 0
        else:
            self._backoff = min(max(2 * self._backoff, 1), MAX_BACKOFF)
            self._rest = self._backoff

    def _extend(self, token_ids: list[int]) -> None:
        # Only n-grams that end before the last token: the suffix must not find itself,
        # and an occurrence has to be followed by something to copy.
        for end in range(self._indexed + 1, len(token_ids)):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(token_ids[end - n:end])] = end  # later occurrences overwrite: the latest wins
        self._indexed = max(self._indexed, len(token_ids) - 1)


def _copy_from(token_ids: list[int], end: int, k: int) -> list[int]:
    """The k tokens that follow, if the sequence goes on as it did after position `end`.

    The copy may run into its own output: after "a b a b" the match of "a b" ends 2 back,
    so the guess is "a b a b ...", periodic with period len(token_ids) - end."""
    draft: list[int] = []
    for j in range(k):
        i = end + j
        draft.append(token_ids[i] if i < len(token_ids) else draft[i - len(token_ids)])
    return draft


def verify(drafts: list[int], greedy: list[int], logits: torch.Tensor | None, sampling: Sampling,
           generator: torch.Generator | None) -> list[int]:
    """The tokens a step gives a sequence: the drafts the model agrees with, then its own
    choice where it first disagrees (or after the last draft).

    `greedy`: the argmax of each of the len(drafts) + 1 rows; `logits`: those rows,
    (len(drafts) + 1, V) float32 on the CPU, when the sequence samples (None when greedy).
    Without drafts this is plain decoding: the argmax, or one draw of `sample_row`.
    """
    if sampling.temperature == 0:
        return accept_greedy(drafts, greedy)
    assert logits is not None and generator is not None
    return accept_sampled(drafts, logits, sampling, generator)


def accept_greedy(drafts: list[int], greedy: list[int]) -> list[int]:
    """Every token out is the model's argmax: drafts while they equal it, then the argmax
    where they first differ (or after the last draft)."""
    return _accept(drafts, greedy.__getitem__)


def accept_sampled(drafts: list[int], logits: torch.Tensor, sampling: Sampling,
                   generator: torch.Generator) -> list[int]:  # logits: (len(drafts) + 1, V)
    """Speculative sampling against a point-mass draft (see the module docstring): row j's
    token is drawn as plain decoding draws it, and the draft is kept iff it is that token."""
    return _accept(drafts, lambda j: sample_row(logits[j], sampling, generator))


def _accept(drafts: list[int], choose: Callable[[int], int]) -> list[int]:
    """Row by row, the model's choice; go on while it is the draft. `choose` is called in
    row order, once per token returned (a sampler's draws stay one per token)."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        out.append(choose(j))
        if out[-1] != draft:
            return out
    out.append(choose(len(drafts)))  # every draft kept: the model's token after the last
    return out
