"""Everything the engine raises, rooted in one class."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every engine error."""


class InvalidRequest(EngineError, ValueError):
    """A request the engine refuses at submit: fix the request, not the engine."""


class PromptTooLong(InvalidRequest):
    """The prompt, or prompt + max_new_tokens, exceeds the model's context."""


class RequestCancelled(EngineError):
    """`cancel()` ended the request before it finished."""


class EngineStopped(EngineError):
    """The engine was shut down before the request finished."""


class StepFailed(EngineError):
    """A model step raised; every request in flight then fails with this (cause chained)."""
