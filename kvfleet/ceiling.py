"""The per-request token ceilings: a job over its class's ceiling can never run.

High may hold 2× `base_ceiling_tokens`, normal 1×, low ¼ (`PolicyConfig.ceiling`). The
API refuses such a job (422) before it is queued; the scheduler applies the same check
to every job it reads, for those produced straight to Kafka.
"""

from __future__ import annotations

from typing import Optional

from kvfleet.contracts import Priority, token_cost
from kvfleet.settings import PolicyConfig


def over_ceiling(priority: Priority, prompt_tokens: int, max_new_tokens: int, config: PolicyConfig, *,
                 output_field: str = "max_new_tokens") -> Optional[str]:
    """What to change when the job is over its class's ceiling; None when it fits.
    `output_field` is what the client called max_new_tokens (the OpenAI API's `max_tokens`)."""
    cost, limit = token_cost(prompt_tokens, max_new_tokens), config.ceiling(priority)
    if cost <= limit:
        return None
    over, room = cost - limit, limit - prompt_tokens
    fixes = [f"lower {output_field} to at most {room}"] if room >= 1 else []
    fixes.append(f"shorten the prompt by {over} tokens" if room >= 1
                 else f"shorten the prompt by at least {1 - room} tokens (with {output_field} 1)")
    fits = [f"{p.value} ({config.ceiling(p)})" for p in Priority if p is not priority and config.ceiling(p) >= cost]
    if fits:
        fixes.append(f"send it as {' or '.join(fits)}")
    others = ", ".join(f"{p.value} {config.ceiling(p)}" for p in Priority if p is not priority)
    return (f"job needs {cost} tokens (prompt {prompt_tokens} + {output_field} {max_new_tokens}) "
            f"but the {priority.value} ceiling is {limit}: {', or '.join(fixes)} "
            f"(other ceilings: {others})")
