"""The shape of a Llama model: what `workers/model/llama.py` builds, read from a checkpoint's
config.json (kvfleet/modelinfo.py) or one of the built-in models."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    #: Every id that ends generation: HF allows one id or a list (Llama 3 lists several).
    eos_token_id: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError("rms_norm_eps and rope_theta must be > 0")
        for token_id in (self.bos_token_id, *self.eos_token_id):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"special token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """Read a Hugging Face `config.json` (transformers 4.x or 5.x layout).

        Refuses what this implementation would silently compute wrong: other
        architectures, biases, activations other than SiLU, and RoPE scaling.
        """
        if d.get("model_type") != "llama":
            raise ValueError(f"model_type {d.get('model_type')!r} is not supported; only 'llama' checkpoints load")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; Llama uses 'silu'")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias checkpoints are not supported")
        # transformers 5 nests RoPE settings in rope_parameters; 4.x has rope_theta + rope_scaling.
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"RoPE scaling {rope_type!r} is not supported; only plain RoPE ('default')")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None

    def to_json(self) -> str:
        """Canonical text (sorted keys): part of the model fingerprint."""
        return json.dumps(asdict(self), sort_keys=True)
