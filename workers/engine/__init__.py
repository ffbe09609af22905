"""Continuous-batching inference over a paged KV cache with prefix caching.

Dependencies point one way: sequence <- block_manager <- scheduler <- engine -> model_runner.
"""

from kvfleet.settings import EngineConfig
from workers.engine.engine import Engine, EngineStats, RequestHandle
from workers.engine.errors import (
    EngineError, EngineStopped, InvalidRequest, PromptTooLong, RequestCancelled, StepFailed,
)
from workers.engine.hooks import BlockHooks, MissingBlock, NoBlockHooks

__all__ = [
    "BlockHooks", "Engine", "EngineConfig", "EngineError", "EngineStats", "EngineStopped", "InvalidRequest",
    "MissingBlock", "NoBlockHooks", "PromptTooLong", "RequestCancelled", "RequestHandle", "StepFailed",
]
