"""What the API and the scheduler know of the served model without its weights: its name,
its shape, its tokenizer, and the limits a request is checked against.

`load_model_info(source)` reads a built-in model's config, or a Hugging Face checkpoint
directory's config.json and tokenizer.json (never its weights); the worker's
`workers/model/loader.py` loads the weights on top of the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvfleet.modelconfig import LlamaConfig
from kvfleet.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

BUILTIN_PREFIX = "builtin:"
BUILTIN_CONFIGS: dict[str, LlamaConfig] = {
    # Small enough that a test's forward pass takes milliseconds on one CPU core.
    "tiny": LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024, bos_token_id=256, eos_token_id=(257,),
    ),
    # Big enough that matrix work, not Python, dominates a step: what benchmarks need.
    "bench": LlamaConfig(
        vocab_size=258, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=4096, bos_token_id=256, eos_token_id=(257,),
    ),
}


@dataclass(frozen=True)
class ModelInfo:
    name: str  # what clients put in `model`: "builtin:tiny" or the checkpoint directory's name
    config: LlamaConfig
    tokenizer: Tokenizer

    @property
    def max_context(self) -> int:
        """Tokens, prompt and output together."""
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


def load_model_info(source: str) -> ModelInfo:
    """"builtin:tiny", "builtin:bench", or a checkpoint directory (config.json and
    tokenizer.json; the weights are not read)."""
    if source.startswith(BUILTIN_PREFIX):
        size = source.removeprefix(BUILTIN_PREFIX)
        if size not in BUILTIN_CONFIGS:
            raise ValueError(f"unknown built-in model {source!r}; choose one of "
                             f"{[BUILTIN_PREFIX + k for k in sorted(BUILTIN_CONFIGS)]}")
        return ModelInfo(source, BUILTIN_CONFIGS[size], ByteTokenizer())
    path = Path(source)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file} not found: a model source is 'builtin:tiny', 'builtin:bench' or a "
            "Hugging Face checkpoint directory with config.json, *.safetensors and tokenizer.json"
        )
    config = LlamaConfig.from_hf_dict(json.loads(config_file.read_text()))
    return ModelInfo(path.resolve().name, config, _checkpoint_tokenizer(path, config))


def _checkpoint_tokenizer(path: Path, config: LlamaConfig) -> HFTokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} not found: the checkpoint must ship a `tokenizers` tokenizer.json")
    tokenizer = HFTokenizer(
        tokenizer_file,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id[0] if config.eos_token_id else None,
    )
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer.json has {tokenizer.vocab_size} tokens but the model's vocab_size is {config.vocab_size}"
        )
    return tokenizer
