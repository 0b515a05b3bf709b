"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

Llama: Touvron et al. 2023; RMSNorm (Zhang & Sennrich 2019), rotary embeddings (Su et al. 2021),
grouped-query attention (Ainslie et al. 2023), SwiGLU (Shazeer 2020). Tokens of all sequences in a
step are flattened to one [T, hidden] batch; attention goes through the engine's backend, which
reads and writes the paged cache with the step's `AttentionMetadata`.
"""
import math
from typing import Iterable

import torch
from torch import nn
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference implementation does, then cast back.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2] (float32), with Llama 3's frequency scaling if set."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif rope_type not in ("default", None):
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over a precomputed cos/sin table of [max_len, head_dim // 2]."""

    def __init__(self, config, head_dim: int, max_len: int):
        super().__init__()
        self.config, self.head_dim = config, head_dim
        self.register_buffer("cos", torch.empty(max_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, head_dim // 2), persistent=False)
        self.compute_table()

    def compute_table(self) -> None:
        """Fills the table in float32, in place (on the buffers' device and in their dtype); again after
        a model built on the meta device is materialized with `to_empty`."""
        if self.cos.is_meta:
            return
        positions = torch.arange(self.cos.shape[0], dtype=torch.float32, device=self.cos.device)
        freqs = torch.outer(positions, rope_inv_freq(self.config, self.head_dim).to(self.cos.device))
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions (int64 [T]) as [T, 1, head_dim // 2] in `dtype`, once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, head_dim] by its positions' angles (cos, sin: [T, 1, head_dim // 2])."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config, backend: AttentionBackend, bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matmul; the loader stacks the checkpoint's three.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.backend = backend

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, heads + 2 kv heads, d]
        qk = apply_rotary(qkv[:, :self.num_heads + self.num_kv_heads], *rope)  # q and k in one go
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads:]
        o = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(o.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, backend, bias):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend, bias)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over the paged KV cache.

    `forward` maps a flat step batch (input_ids, positions: int64 [T]) to hidden states
    [T, hidden_size]; `compute_logits` maps selected hidden states [N, hidden] to float32 logits
    [N, vocab]. `qkv_bias` is True for Qwen2 (and any config with `attention_bias`).
    """

    def __init__(self, config, backend: AttentionBackend, max_model_len: int, qkv_bias: bool = False):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_model_len)
        bias = qkv_bias or bool(getattr(config, "attention_bias", False))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend, bias)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    # checkpoint name -> (our parameter, shard index) for the fused projections
    _STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face checkpoint tensors into this model, stacking q/k/v and gate/up, and
        computes the rotary table (not in checkpoints), so the model may be built on the meta device
        and materialized with `to_empty` (no random init of weights the checkpoint overwrites).

        Raises KeyError for an unknown tensor name and ValueError when a parameter stays unset.
        """
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            name = name.removeprefix("model.")
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._STACKED:
                fused, shard = self._STACKED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                param = params[target]
                offset = sum(self._shard_sizes(fused)[:shard])
                param.data[offset:offset + tensor.shape[0]].copy_(tensor)
                loaded.add((target, shard))
            else:
                params[name].data.copy_(tensor)
                loaded.add((name, 0))
        missing = [n for n in params if not any(t == n for t, _ in loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
        self.rotary.compute_table()

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            d = head_dim_of(c)
            return [c.num_attention_heads * d, c.num_key_value_heads * d, c.num_key_value_heads * d]
        return [c.intermediate_size, c.intermediate_size]
