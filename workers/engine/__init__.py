"""Continuous-batching inference over a paged KV cache with prefix caching.

Dependencies point one way: sequence <- block_manager <- scheduler <- loop (the step
thread; stops, model_runner) <- engine (the front end other threads call); the inbox is
where the two threads meet.
"""

from kvfleet.settings import EngineConfig
from workers.engine.engine import Engine, RequestHandle
from workers.engine.stats import EngineStats
from workers.engine.errors import (
    EngineError, EngineStopped, InvalidRequest, PromptTooLong, RequestCancelled, StepFailed,
)
from workers.engine.hooks import BlockHooks, MissingBlock, NoBlockHooks

__all__ = [
    "BlockHooks", "Engine", "EngineConfig", "EngineError", "EngineStats", "EngineStopped", "InvalidRequest",
    "MissingBlock", "NoBlockHooks", "PromptTooLong", "RequestCancelled", "RequestHandle", "StepFailed",
]
