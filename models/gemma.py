"""Gemma 2 and Gemma 3 (text) over the paged KV cache (Gemma Team 2024, "Gemma 2: Improving Open Language
Models at a Practical Size"; 2025, "Gemma 3 Technical Report").

The Llama blocks with Gemma's differences: RMSNorm scaled by (1 + weight), GeGLU (GELU, tanh approximation)
in the MLP, embeddings multiplied by sqrt(hidden_size), each sublayer's output normalised again before it
joins the residual stream (pre- and post-norms), attention scaled by query_pre_attn_scalar ** -0.5,
alternating sliding-window and global layers (`layer_types`). Gemma 2 soft-caps the attention scores and the
final logits; Gemma 3 normalises each query and key head instead, and gives its sliding layers a rotary base
of their own (rope parameters per layer type).
"""

import itertools
import math
from typing import Iterable

import torch
from torch import nn

from models.attention.base import AttentionBackend, AttentionMetadata
from models.config import ModelShape, layer_sliding_windows
from models.distributed.group import TPGroup
from models.distributed.pipeline import PPMissingLayer, PPStage
from models.kernels import ops
from models.layers.attention import SelfAttention
from models.layers.checkpoint import keep_norms_float32, load_checkpoint
from models.layers.layernorm import HeadRMSNorm, RMSNorm
from models.layers.linear import ColumnParallelLinear, RowParallelLinear
from models.layers.rotary_embedding import RotaryEmbedding
from models.layers.vocab_parallel_embedding import embedding_and_head
from models.quantization.gguf import GGUFConfig


class PostNorm(nn.Module):
    """RMSNorm of a sublayer's output alone (no residual add): Gemma's post-attention and post-feedforward
    norms. x [T, hidden] -> the same shape and dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class GemmaMLP(nn.Module):
    """GeGLU: down(GELU_tanh(gate(x)) * up(x)), gate and up stacked into one projection; `size`: the width
    (default the config's intermediate_size)."""

    def __init__(self, config, tp: TPGroup | None, quant_config: GGUFConfig | None, size: int | None = None):
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported by Gemma (supported: gelu_pytorch_tanh)")
        size = size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.merged(config.hidden_size, [size] * 2, False, tp, quant_config)
        self.down_proj = RowParallelLinear(size, config.hidden_size, tp, quant_config)

    def forward(self, x):
        return self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around attention and the MLP; `kind`: "sliding_attention" or "full_attention"."""

    def __init__(self, config, shape: ModelShape, backend, tp, quant_config, kind: str):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.kind = kind
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = SelfAttention(
            shape,
            backend,
            False,
            tp,
            eps if getattr(config, "model_type", "") == "gemma3_text" else None,
            quant_config,
        )
        self.post_attention_layernorm = PostNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = GemmaMLP(config, tp, quant_config)
        self.post_feedforward_layernorm = PostNorm(hidden, eps)

    def forward(self, residual, x, rope, kv_cache, meta):
        """residual: the float32 stream [T, hidden], updated in place; x: the previous layer's normed MLP
        output (None before the first layer). Returns this layer's normed MLP output, not yet added."""
        x = self.self_attn(self.input_layernorm(residual, x), rope, kv_cache, meta)
        x = self.mlp(self.pre_feedforward_layernorm(residual, self.post_attention_layernorm(x)))
        return self.post_feedforward_layernorm(x)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text decoder (Gemma2ForCausalLM, Gemma3ForCausalLM), the LM head tied to the
    embedding (as Gemma's checkpoints have it) unless the config says otherwise. Shapes as LlamaForCausalLM's;
    `backend` one per layer (the sliding and the global layers each have theirs: models.attention.make_backends).
    """

    def __init__(
        self,
        config,
        shape: ModelShape,
        backend: AttentionBackend | list[AttentionBackend],
        max_model_len: int,
        tp: TPGroup | None = None,
        quant_config: GGUFConfig | None = None,
        pp: PPStage | None = None,
    ):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention true is not supported (causal attention only)")
        self.config = config
        n = config.num_hidden_layers
        kinds = ["sliding_attention" if w else "full_attention" for w in layer_sliding_windows(config)]
        # one rotary table per layer kind: Gemma 3's sliding layers have a rope base of their own
        per_kind = isinstance((getattr(config, "rope_parameters", None) or {}).get("full_attention"), dict)
        self.rotary = nn.ModuleDict(
            {k: RotaryEmbedding(config, shape.head_dim, max_model_len, k if per_kind else None) for k in set(kinds)}
        )
        self.pp = pp = pp or PPStage.whole(n)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.embed_tokens, self.lm_head = embedding_and_head(config, tp, quant_config, pp, self.tie_word_embeddings)
        backends = backend if isinstance(backend, list) else [backend] * n
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, shape, backends[i], tp, quant_config, kinds[i])
            if pp.holds(i)
            else PPMissingLayer()
            for i in range(n)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else PPMissingLayer()
        self.quantized = quant_config is not None
        self.normalizer = math.sqrt(config.hidden_size)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: list[AttentionMetadata],
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As LlamaForCausalLM.forward: kv_caches and attn_metadata per layer of this stage."""
        if self.pp.is_first:
            residual = self.embed_tokens(input_ids).float() * self.normalizer
        x, rope = None, {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        layers = itertools.islice(self.layers, self.pp.start_layer, self.pp.end_layer)  # no new ModuleList
        for layer, kv_cache, meta in zip(layers, kv_caches, attn_metadata):
            x = layer(residual, x, rope[layer.kind], kv_cache, meta)
        return self.norm(residual, x) if self.pp.is_last else residual.add_(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, vocab] of hidden [N, hidden_size] (None on ranks other than 0), soft-capped
        (Gemma 2: cap * tanh(logits / cap))."""
        logits = (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        cap = self.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if logits is not None and cap else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As LlamaForCausalLM.load_weights; then every RMSNorm's weight w becomes 1 + w, the scale Gemma's
        norms apply (the checkpoint stores w)."""
        first = self.layers[self.pp.start_layer].input_layernorm.weight
        dtype = first.dtype
        if self.quantized:
            keep_norms_float32(self)
        load_checkpoint(self, self.config, weights, dtype, skip="lm_head.weight" if self.tie_word_embeddings else None)
        for module in self.modules():
            if isinstance(module, (RMSNorm, PostNorm, HeadRMSNorm)):
                module.weight.data += 1
        for rotary in self.rotary.values():
            rotary.compute_table(first.device)
