"""Next-token choice: greedy at temperature 0, else temperature, top-k and top-p.

Each sampled sequence draws from its own `torch.Generator`, seeded from the request's
seed, and each token costs it exactly one draw. So a seeded request yields the same
tokens alone or in any batch, on any device (the draw happens on the CPU), and with or
without speculative decoding (workers/engine/spec.py draws each token the same way).
"""

from __future__ import annotations

import secrets

import torch

from kvfleet.contracts import Sampling


def make_generator(sampling: Sampling) -> torch.Generator | None:
    """None for greedy; else a CPU generator seeded from the request (random if unseeded)."""
    if sampling.temperature == 0:
        return None
    seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
    return torch.Generator(device="cpu").manual_seed(seed)


def probabilities(logits: torch.Tensor, params: Sampling) -> torch.Tensor:  # (V,) float32 CPU -> (V,)
    """The distribution a token is drawn from: temperature -> top-k -> top-p (the order HF
    applies them), then softmax."""
    scores = logits / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)  # (V,), (V,)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)  # back to vocab order
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1)


def sample_row(logits: torch.Tensor, params: Sampling, generator: torch.Generator) -> int:  # (V,) float32 CPU
    """One multinomial draw from `probabilities(logits, params)`."""
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator).item())
