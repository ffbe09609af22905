"""What the API and the scheduler know of the served model without its weights: its name,
its shape, its tokenizer, and the limits a request is checked against.

`load_model_info(source)` reads a built-in model's config, or a Hugging Face checkpoint
directory's config.json and tokenizer.json (never its weights), plus its chat template
(kvfleet/chat.py) and the end-of-turn ids generation stops at; the worker's
`workers/model/loader.py` loads the weights on top of the same.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvfleet.chat import ChatError, ChatTemplate, builtin_chat_template, load_chat_template, normalize_messages
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
    chat: Optional[ChatTemplate] = None  # None: the checkpoint has no chat template, so no chat
    #: End-of-turn ids that stop generation besides the tokenizer's main EOS, e.g.
    #: <|im_end|>, <|eot_id|>, <end_of_turn>: a chat model ends its turn with them.
    stop_token_ids: tuple[int, ...] = ()

    @property
    def max_context(self) -> int:
        """Tokens, prompt and output together."""
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Prompt tokens for OpenAI chat `messages` (as a client sends them: validated
        here by `normalize_messages`), rendered with the model's template and a
        generation prompt. ChatError names the field to fix."""
        if self.chat is None:
            raise ChatError(
                f"the model {self.name} has no chat template (no chat_template in tokenizer_config.json or "
                "chat_template.jinja): use /v1/completions with a prompt, or add a template to the checkpoint",
                param="messages",
            )
        text = self.chat.render(normalize_messages(messages), add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=self.chat.add_special_tokens)


#: Checkpoints shipped inside the package under a built-in name: trained weights, read
#: like any checkpoint directory. `builtin:english` is the demo's model
#: (scripts/train_english.py made it; its training.json says how and how well).
PACKAGED_DIR = Path(__file__).resolve().parent / "models"
PACKAGED = ("english",)


def packaged_path(source: str) -> Optional[Path]:
    """The directory of a packaged checkpoint (`builtin:english`), or None."""
    name = source.removeprefix(BUILTIN_PREFIX) if source.startswith(BUILTIN_PREFIX) else None
    return PACKAGED_DIR / name if name in PACKAGED else None


def load_model_info(source: str) -> ModelInfo:
    """"builtin:tiny", "builtin:bench", or a checkpoint directory (config.json and
    tokenizer.json; the weights are not read)."""
    packaged = packaged_path(source)
    if packaged is not None:
        return dataclasses.replace(load_model_info(str(packaged)), name=source)
    if source.startswith(BUILTIN_PREFIX):
        size = source.removeprefix(BUILTIN_PREFIX)
        if size not in BUILTIN_CONFIGS:
            raise ValueError(f"unknown built-in model {source!r}; choose one of "
                             f"{[BUILTIN_PREFIX + k for k in sorted([*BUILTIN_CONFIGS, *PACKAGED])]}")
        # The byte tokenizer's EOS (257) ends a built-in model's turn: no other stop ids.
        return ModelInfo(source, BUILTIN_CONFIGS[size], ByteTokenizer(), chat=builtin_chat_template())
    path = Path(source)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{config_file} not found: a model source is 'builtin:tiny', 'builtin:bench', 'builtin:english' or a "
            "Hugging Face checkpoint directory with config.json, *.safetensors and tokenizer.json"
        )
    config = LlamaConfig.from_hf_dict(json.loads(config_file.read_text()))
    tokenizer = _checkpoint_tokenizer(path, config)
    chat = load_chat_template(path)
    return ModelInfo(path.resolve().name, config, tokenizer, chat=chat,
                     stop_token_ids=_stop_token_ids(path, config, tokenizer, chat))


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


def _stop_token_ids(path: Path, config: LlamaConfig, tokenizer: HFTokenizer, chat: Optional[ChatTemplate]) -> tuple[int, ...]:
    """Every id that ends a turn, less the main EOS: config.json's and generation_config.json's
    eos_token_id (Llama 3 Instruct lists <|eot_id|> there), and the template's eos_token
    (ChatML checkpoints name <|im_end|> there)."""
    ids = list(config.eos_token_id)
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        eos = json.loads(generation_file.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if chat is not None and chat.eos_token is not None:
        eos_id = tokenizer.token_to_id(chat.eos_token)
        if eos_id is not None:
            ids.append(eos_id)
    for token_id in ids:
        if not isinstance(token_id, int) or not 0 <= token_id < config.vocab_size:
            raise ValueError(f"{path}: end-of-turn token id {token_id!r} is outside the vocabulary (0..{config.vocab_size - 1})")
    return tuple(dict.fromkeys(i for i in ids if i != tokenizer.eos_token_id))  # ordered, once each
