"""LFM2 (Liquid AI 2025, Lfm2ForCausalLM): a hybrid of gated short convolutions (models/layers/short_conv.py, a
state per request) and grouped-query attention layers with per-head q/k RMSNorm, as `layer_types` ("conv",
"full_attention") interleaves them; each layer then a SwiGLU MLP. Pre-norm residual blocks; the final norm is the
checkpoint's `embedding_norm`; the LM head tied to the embedding.

Attention layers read and write the paged KV cache as the Llama family's do; conv layers get their state tensor
and the step's StateMetadata in the same places of `forward`'s per-layer lists (the model runner's KV cache group
of recurrent layers, engine.core.kv_cache_spec.MambaSpec).
"""

import re
from typing import Iterable

import torch
from torch import nn

from models.attention.base import AttentionBackend, AttentionMetadata
from models.config import ModelShape
from models.distributed.group import TPGroup
from models.distributed.pipeline import PPMissingLayer, PPStage
from models.layers.attention import SelfAttention
from models.layers.checkpoint import keep_norms_float32, load_checkpoint
from models.layers.decoder_stack import run_layers
from models.layers.layernorm import RMSNorm
from models.layers.mlp import SwiGLUMLP
from models.layers.rotary_embedding import RotaryEmbedding
from models.layers.short_conv import ShortConv, StateMetadata
from models.layers.vocab_parallel_embedding import embedding_and_head
from models.quantization.gguf import GGUFConfig

# the checkpoint's names -> the shared layers' (load_checkpoint stacks w1/w3 as gate_up_proj)
RENAMES = (
    (r"\.feed_forward\.w1\.", ".feed_forward.gate_proj."),
    (r"\.feed_forward\.w3\.", ".feed_forward.up_proj."),
    (r"\.feed_forward\.w2\.", ".feed_forward.down_proj."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"\.self_attn\.q_layernorm\.", ".self_attn.q_norm."),
    (r"\.self_attn\.k_layernorm\.", ".self_attn.k_norm."),
)


def lfm2_intermediate_size(config) -> int:
    """The MLP's width: `intermediate_size`, or with `block_auto_adjust_ff_dim` two thirds of it, times
    `block_ffn_dim_multiplier` rounded up to `block_multiple_of` (transformers' Lfm2MLP)."""
    size = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        if getattr(config, "block_ffn_dim_multiplier", None) is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            multiple = config.block_multiple_of
            size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2DecoderLayer(nn.Module):
    """operator_norm -> a short convolution or attention -> residual; ffn_norm -> SwiGLU MLP -> residual."""

    def __init__(self, config, shape: ModelShape, backend, tp, quant_config, kind: str):
        super().__init__()
        eps, hidden = config.norm_eps, config.hidden_size
        self.is_conv = kind == "conv"
        self.operator_norm = RMSNorm(hidden, eps)
        if self.is_conv:
            self.conv = ShortConv(hidden, config.conv_L_cache, bool(config.conv_bias), tp, quant_config)
        else:
            self.self_attn = SelfAttention(shape, backend, False, tp, eps, quant_config)
        self.ffn_norm = RMSNorm(hidden, eps)
        self.feed_forward = SwiGLUMLP(hidden, lfm2_intermediate_size(config), tp, quant_config)

    def forward(self, residual, x, rope, cache, meta):
        """residual: the float32 stream [T, hidden], updated in place; x: the previous layer's MLP output (None
        before the first layer); cache and meta: the layer's KV cache and AttentionMetadata, or (a conv layer)
        its state tensor and StateMetadata. Returns this layer's MLP output, not yet added."""
        h = self.operator_norm(residual, x)
        x = self.conv(h, cache, meta) if self.is_conv else self.self_attn(h, rope, cache, meta)
        return self.feed_forward(self.ffn_norm(residual, x))


class Lfm2ForCausalLM(nn.Module):
    """The LFM2 decoder over the paged KV cache and per-request conv states. Shapes as LlamaForCausalLM's;
    `backend`: each layer's attention backend (None for conv layers: models.attention.make_backends).
    `state_shape`: one conv layer's state per slot (float32), for the model runner to allocate.
    Raises ValueError for a config this file does not build."""

    def __init__(
        self,
        config,
        shape: ModelShape,
        backend: AttentionBackend | list[AttentionBackend | None],
        max_model_len: int,
        tp: TPGroup | None = None,
        quant_config: GGUFConfig | None = None,
        pp: PPStage | None = None,
    ):
        super().__init__()
        self.config = config
        n = config.num_hidden_layers
        kinds = list(config.layer_types)
        self.pp = pp = pp or PPStage.whole(n)
        self.rotary = RotaryEmbedding(config, shape.head_dim, max_model_len)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.embed_tokens, self.lm_head = embedding_and_head(config, tp, quant_config, pp, self.tie_word_embeddings)
        backends = backend if isinstance(backend, list) else [backend] * n
        self.layers = nn.ModuleList(
            Lfm2DecoderLayer(config, shape, backends[i], tp, quant_config, kind) if pp.holds(i) else PPMissingLayer()
            for i, kind in enumerate(kinds)
        )
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps) if pp.is_last else PPMissingLayer()
        self.quantized = quant_config is not None
        self.supports_cuda_graphs = False  # the conv layers loop over the step's sequences on the host
        self.state_shape = (config.conv_L_cache - 1, config.hidden_size // (tp.world_size if tp else 1))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        attn_metadata: list[AttentionMetadata | StateMetadata],
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As LlamaForCausalLM.forward; a conv layer's entries of kv_caches and attn_metadata are its state
        tensor and the step's StateMetadata."""
        return run_layers(self, input_ids, positions, kv_caches, attn_metadata, residual, self.embedding_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As LlamaForCausalLM.load_weights, the checkpoint's names mapped to the shared layers' (RENAMES)."""
        dtype = self.layers[self.pp.start_layer].operator_norm.weight.dtype
        if self.quantized:
            keep_norms_float32(self)

        def renamed():
            for name, tensor in weights:
                for pattern, new in RENAMES:
                    name = re.sub(pattern, new, name)
                yield name, tensor

        skip = "lm_head.weight" if self.tie_word_embeddings else None
        load_checkpoint(self, self.config, renamed(), dtype, skip=skip)
        self.rotary.compute_table(self.layers[self.pp.start_layer].operator_norm.weight.device)
