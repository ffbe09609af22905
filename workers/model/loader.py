"""`load_model(source)`: a built-in seeded-random model or a Hugging Face Llama checkpoint.

Either way the result carries a `fingerprint`: a hash of the config and of every weight
byte. Cached KV is only valid for the exact weights that computed it, so the fingerprint
is part of every block hash and every cold-tier key; two workers share KV exactly when
their fingerprints match. The name, config and tokenizer come from the core's
`kvfleet.modelinfo`, which the API and the scheduler read without the weights.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from kvfleet.modelconfig import LlamaConfig
from kvfleet.modelinfo import BUILTIN_PREFIX, load_model_info, packaged_path
from kvfleet.tokenizer import Tokenizer
from workers.model.llama import LlamaForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: LlamaConfig
    name: str  # what clients put in `model`: "builtin:tiny" or the checkpoint directory's name
    device: torch.device
    dtype: torch.dtype
    fingerprint: str  # 32 hex chars; same config and weights -> same string, in any process
    max_context: int  # tokens, prompt and output together


def load_model(source: str, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """"builtin:tiny", "builtin:bench" (seeded random weights), "builtin:english" (trained,
    shipped in the package), or a checkpoint directory (config.json,
    *.safetensors, tokenizer.json). device "auto": cuda when available, else cpu;
    dtype "auto": bfloat16 on cuda, float32 on cpu."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device)
    if dtype == "auto":
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    elif dtype in _DTYPES:
        dt = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {sorted(_DTYPES)}")

    info = load_model_info(source)
    tokenizer, config, name = info.tokenizer, info.config, info.name
    packaged = packaged_path(source)
    if packaged is not None:  # builtin:english: trained weights shipped in the package
        state, fingerprint = _checkpoint_weights(packaged, config)
    elif source.startswith(BUILTIN_PREFIX):
        state, fingerprint = _builtin_weights(config)
    else:
        state, fingerprint = _checkpoint_weights(Path(source), config)
    model = LlamaForCausalLM(config, device="meta")  # structure only: no memory, no random init
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # missing/unexpected names, wrong shapes: torch lists them all
        raise ValueError(f"weights of {source!r} do not fit a Llama with this config.json: {e}") from None
    model.to(device=dev, dtype=dt).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, config, name, dev, dt, fingerprint, config.max_position_embeddings)


def _builtin_weights(config: LlamaConfig) -> tuple[dict[str, torch.Tensor], str]:
    # Seeded (from the config) CPU init in a fixed name order: every process builds the same bytes.
    seed = int.from_bytes(hashlib.blake2b(config.to_json().encode(), digest_size=8).digest(), "little")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, meta in sorted(LlamaForCausalLM(config, device="meta").state_dict().items()):
        if name.endswith("norm.weight"):
            state[name] = torch.ones(meta.shape)
            continue
        # Unit-variance embeddings and 1/sqrt(fan_in) projections keep activations O(1)
        # through the layers; a wider lm_head spreads the logits over a few units, so
        # random weights still give input-dependent (not uniform) next tokens.
        std = 1.0 if "embed_tokens" in name else meta.shape[1] ** -0.5
        if name == "lm_head.weight":
            std *= 4.0
        state[name] = torch.randn(meta.shape, generator=gen) * std
    h = hashlib.blake2b(config.to_json().encode(), digest_size=16)
    for name, tensor in state.items():
        h.update(name.encode())
        h.update(tensor.numpy().tobytes())
    return state, h.hexdigest()


def _checkpoint_weights(path: Path, config: LlamaConfig) -> tuple[dict[str, torch.Tensor], str]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (PyTorch .bin checkpoints are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, tensor in safetensors.torch.load_file(f, device="cpu").items():
            if name in state:
                raise ValueError(f"weight {name!r} appears in two shards of {path}")
            state[name] = tensor
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # some tied checkpoints store a copy; the model has none
    # Every byte of every shard, in file-name order. Each shard hashes on its own thread
    # (hashlib releases the GIL), about 1 s per GB per core; a cheaper digest of headers
    # alone would give two fine-tunes with equal shapes the same fingerprint.
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        digests = list(pool.map(_file_digest, files))
    h = hashlib.blake2b(config.to_json().encode(), digest_size=16)
    for f, digest in zip(files, digests):
        h.update(f.name.encode() + digest)
    return state, h.hexdigest()


def _file_digest(path: Path) -> bytes:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=32)).digest()
