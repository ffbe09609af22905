"""The model a worker serves: Llama over a paged KV cache, its tokenizer, loading, sampling."""

from workers.model.config import LlamaConfig
from workers.model.loader import LoadedModel, load_model

__all__ = ["LlamaConfig", "LoadedModel", "load_model"]
