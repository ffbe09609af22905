"""The per-request token ceilings: a job over its class's ceiling can never run.

High may hold 2× `base_ceiling_tokens`, normal 1×, low ¼ (`PolicyConfig.ceiling`). The
API refuses such a job (422) before it is queued; the scheduler applies the same check
to every job it reads, for those produced straight to Kafka.
"""

from __future__ import annotations

from typing import Optional

from kvfleet.contracts import Priority, token_cost
from kvfleet.settings import PolicyConfig


def over_ceiling(priority: Priority, prompt_tokens: int, max_new_tokens: int, config: PolicyConfig) -> Optional[str]:
    """What to change when the job is over its class's ceiling; None when it fits."""
    cost, limit = token_cost(prompt_tokens, max_new_tokens), config.ceiling(priority)
    if cost <= limit:
        return None
    others = ", ".join(f"{p.value} {config.ceiling(p)}" for p in Priority if p is not priority)
    return (f"job needs {cost} tokens (prompt {prompt_tokens} + max_new_tokens {max_new_tokens}) "
            f"but the {priority.value} ceiling is {limit}; lower max_new_tokens or shorten the prompt "
            f"(other ceilings: {others})")
