"""A Llama decoder for a flat batch of tokens over a paged KV cache.

Same arithmetic as Hugging Face's `LlamaForCausalLM` (RMSNorm, rotary embeddings in
the rotate_half convention, grouped-query attention, SwiGLU MLP) and the same
parameter names, so a checkpoint's safetensors load with `load_state_dict` as they are.
What differs is the calling convention: no batch dimension and no padding. A step's
tokens from all sequences are concatenated (`input_ids (T,)`, `positions (T,)`), and
`AttentionMetadata` says which rows belong to which sequence and where their K/V live.

Classes go bottom-up: norm, rotary, attention, MLP, layer, model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention import AttentionMetadata, paged_attention
from kvfleet.modelconfig import LlamaConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (NB, BS, Hkv, D) each
#: The mixed pool's V scales, per layer (NB, BS, Hkv) fp16, whose V caches are int8; None otherwise.
VScales = list[torch.Tensor] | None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        # In float32 whatever the model dtype, as HF does: the mean of squares of
        # bf16 values loses too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (T, H) * (T, 1)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once in float32 on the CPU.

    Built on the CPU even when the parameters are created on the meta device (loading),
    so `model.to(device)` can move it.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))  # (D/2,)
        freqs = torch.outer(torch.arange(max_positions, device="cpu").float(), inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D): HF's rotate_half layout
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        positions: torch.Tensor,  # (T,)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D): broadcast over heads
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)  # (T, 1, D)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
    x1, x2 = x.chunk(2, dim=-1)  # (..., D/2) each
    return torch.cat((-x2, x1), dim=-1)  # (..., D)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        h, qd, kvd = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, qd, bias=False, device=device)
        self.k_proj = nn.Linear(h, kvd, bias=False, device=device)
        self.v_proj = nn.Linear(h, kvd, bias=False, device=device)
        self.o_proj = nn.Linear(qd, h, bias=False, device=device)

    def forward(
        self,
        x: torch.Tensor,  # (T, H)
        positions: torch.Tensor,  # (T,)
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_scales: torch.Tensor | None = None,  # (NB, BS, Hkv): v_cache is int8
    ) -> torch.Tensor:  # (T, H)
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # (T, Hq, D)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        q, k = rotary(q, k, positions)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, v_scales)  # (T, Hq, D)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))  # (T, Hq*D) -> (T, H)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, device: torch.device | str) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, device=device)
        self.up_proj = nn.Linear(h, i, bias=False, device=device)
        self.down_proj = nn.Linear(i, h, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, device: torch.device | str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, device)
        self.mlp = LlamaMLP(config, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)

    def forward(
        self,
        x: torch.Tensor,  # (T, H)
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        v_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:  # (T, H)
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, meta, k_cache, v_cache, v_scales)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_cache: KVCache,
        v_scales: VScales = None,
    ) -> torch.Tensor:  # (T, H)
        x = self.embed_tokens(input_ids)  # (T, H)
        scales = [None] * len(kv_cache) if v_scales is None else v_scales
        for layer, (k_cache, v_cache), v_scale in zip(self.layers, kv_cache, scales, strict=True):
            x = layer(x, positions, self.rotary_emb, meta, k_cache, v_cache, v_scale)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """`device="meta"` builds the structure without memory; the loader then assigns weights."""

    def __init__(self, config: LlamaConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, device)
        # A tied model has no lm_head parameter at all (logits use the embedding), so a
        # checkpoint without `lm_head.weight` loads strictly.
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, device=device
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        kv_cache: KVCache,
        v_scales: VScales = None,
    ) -> torch.Tensor:  # (T, H) final hidden states; `compute_logits` on the rows you need
        return self.model(input_ids, positions, meta, kv_cache, v_scales)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (N, H) -> (N, V)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)
