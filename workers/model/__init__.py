"""The model a worker serves: Llama over a paged KV cache, loading, sampling (its config
and tokenizer are the core's: kvfleet/modelconfig.py, kvfleet/tokenizer.py)."""

from workers.model.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
