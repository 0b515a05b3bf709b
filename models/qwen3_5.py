"""Qwen3.5 (Qwen 2026, Qwen3_5ForCausalLM; the language model of Qwen3_5ForConditionalGeneration) and Qwen3.5-MoE:
a hybrid of Gated DeltaNet layers (models/layers/gated_delta_net.py, a state per request) and gated grouped-query
attention, as `layer_types` ("linear_attention", "full_attention") interleaves them, three to one; each layer then
a SwiGLU MLP, or in the MoE models routed experts (top-k of a softmax, renormalised) with a sigmoid-gated shared
expert (models/layers/fused_moe.py). Its attention has per-head q/k RMSNorm, rotary positions on the first
`partial_rotary_factor` of each head (the multimodal rope's sections all read a text token's one position, so for
text it is plain rope), and its output gated by sigmoid of a second half of q_proj. Every RMSNorm but the
DeltaNet's scales by 1 + w. Pre-norm residual blocks. Images and video are not served: a multimodal checkpoint's
vision tower is passed over, as is the multi-token-prediction head.
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
from models.layers.fused_layer import FusedDecoderLayer, FusedDeltaLayer
from models.layers.fused_moe import SparseMoeBlock, is_sparse_layer
from models.layers.gated_delta_net import GatedDeltaNet
from models.layers.layernorm import RMSNorm
from models.layers.mlp import SwiGLUMLP
from models.layers.rotary_embedding import RotaryEmbedding, rotary_dim
from models.layers.short_conv import StateMetadata
from models.layers.vocab_parallel_embedding import embedding_and_head
from models.quantization.gguf import GGUFConfig, GGUFTensor

# a multimodal checkpoint's language model, and the tensors a text server passes over
PREFIX = (re.compile(r"^model\.language_model\."), "model.")
PASSED_OVER = re.compile(r"^(model\.visual\.|visual\.|mtp\.)")


class Qwen3_5DecoderLayer(nn.Module):
    """input_layernorm -> Gated DeltaNet or gated attention -> residual; post_attention_layernorm -> SwiGLU MLP
    -> residual."""

    def __init__(self, config, shape: ModelShape, backend, tp, quant_config, layer: int, tiled_heads: bool):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.is_linear = config.layer_types[layer] == "linear_attention"
        self.input_layernorm = RMSNorm(hidden, eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, tp, quant_config, tiled_heads)
        else:
            self.self_attn = SelfAttention(
                shape,
                backend,
                False,
                tp,
                eps,
                quant_config,
                rotary_dim=rotary_dim(config, shape.head_dim),
                output_gate=True,
            )
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = (  # Qwen3.5-MoE: routed experts and a gated shared expert in every layer
            SparseMoeBlock(config, tp, quant_config)
            if is_sparse_layer(config, layer)
            else SwiGLUMLP(hidden, config.intermediate_size, tp, quant_config)
        )
        # the layer in one C call for decode steps (models/layers/fused_layer.py: FusedDeltaLayer for a DeltaNet
        # layer, FusedDecoderLayer for gated attention): built at the first step, once the weights are loaded; False
        # where the layer has something the C entry point lacks
        self.fused: FusedDeltaLayer | FusedDecoderLayer | bool | None = None

    def forward(self, residual, x, rope, cache, meta):
        """As Lfm2DecoderLayer.forward: a DeltaNet layer's cache and meta are its state tensor and StateMetadata."""
        if self.fused is None:
            self.fused = (FusedDeltaLayer.build(self) if self.is_linear else FusedDecoderLayer.build(self)) or False
        if self.fused:
            out = self.fused(residual, x, cache, meta) if self.is_linear else self.fused(residual, x, rope, cache, meta)
            if out is not None:
                return out
        h = self.input_layernorm(residual, x)
        x = self.linear_attn(h, cache, meta) if self.is_linear else self.self_attn(h, rope, cache, meta)
        return self.mlp(self.post_attention_layernorm(residual, x))


class Qwen3_5ForCausalLM(nn.Module):
    """The Qwen3.5 decoder over the paged KV cache and per-request DeltaNet states. Shapes as LlamaForCausalLM's;
    `backend`: each layer's attention backend (None for DeltaNet layers: models.attention.make_backends).
    `state_shape`: one DeltaNet layer's state per slot (float32), for the model runner to allocate. A GGUF file's
    config says `linear_value_heads_tiled` (llama.cpp's order of the DeltaNet's value heads). Raises ValueError
    for a config this file does not build."""

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
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported by Qwen3.5 (supported: silu)")
        if not getattr(config, "attn_output_gate", True):
            raise ValueError("attn_output_gate false is not supported by Qwen3.5 (its attention is gated)")
        if getattr(config, "attention_bias", False):
            raise ValueError("attention_bias true is not supported by Qwen3.5 (its q_proj holds the output gate)")
        self.config = config
        n = config.num_hidden_layers
        tiled_heads = bool(getattr(config, "linear_value_heads_tiled", False))
        self.pp = pp = pp or PPStage.whole(n)
        self.rotary = RotaryEmbedding(config, rotary_dim(config, shape.head_dim), max_model_len)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens, self.lm_head = embedding_and_head(config, tp, quant_config, pp, self.tie_word_embeddings)
        backends = backend if isinstance(backend, list) else [backend] * n
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, shape, backends[i], tp, quant_config, i, tiled_heads)
            if pp.holds(i)
            else PPMissingLayer()
            for i in range(n)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else PPMissingLayer()
        self.quantized = quant_config is not None
        self.supports_cuda_graphs = False  # the DeltaNet layers loop over the step's sequences on the host
        linear = next((m for m in self.modules() if isinstance(m, GatedDeltaNet)), None)
        self.state_shape = (linear.state_size,) if linear is not None else (0,)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        attn_metadata: list[AttentionMetadata | StateMetadata],
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As LlamaForCausalLM.forward; a DeltaNet layer's entries of kv_caches and attn_metadata are its state
        tensor and the step's StateMetadata."""
        return run_layers(self, input_ids, positions, kv_caches, attn_metadata, residual, self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As LlamaForCausalLM.load_weights. A multimodal checkpoint's `model.language_model.` is the model; its vision
        tower and MTP head are passed over. q_proj's rows, per head its queries then its gates, go to qkv_proj's
        first and fourth parts; in_proj_qkv and in_proj_z to the DeltaNet's in_proj_qkvz, in_proj_b and in_proj_a
        to its in_proj_ba. The DeltaNet's A_log, dt_bias, convolution and norm stay float32 whatever the model dtype.
        Then the weight w of every RMSNorm but the DeltaNet's becomes 1 + w."""
        first = self.layers[self.pp.start_layer].input_layernorm.weight
        if self.quantized:
            keep_norms_float32(self)
        for module in self.modules():  # float32 whatever the dtype: a bfloat16 A_log would move every decay
            if isinstance(module, GatedDeltaNet):
                for param in (module.A_log, module.dt_bias, module.conv1d.weight, module.norm.weight):
                    param.data = param.data.float()
        heads, head_dim = self.config.num_attention_heads, self.config.head_dim

        def renamed():
            for name, tensor in weights:
                name = PREFIX[0].sub(PREFIX[1], name)
                if PASSED_OVER.match(name):
                    continue
                if name.endswith("self_attn.q_proj.weight"):  # [heads * 2 * head_dim, hidden]: per head q, gate
                    rows = torch.arange(heads * 2 * head_dim).view(heads, 2, head_dim)
                    for part, half in (("q_proj", 0), ("q_gate_proj", 1)):
                        index = rows[:, half].reshape(-1)
                        picked = tensor.select_rows(index) if isinstance(tensor, GGUFTensor) else tensor[index]
                        yield name.replace("q_proj", part), picked
                    continue
                yield name.replace(".in_proj_qkv.", ".in_proj_qkvz."), tensor

        skip = "lm_head.weight" if self.tie_word_embeddings else None
        load_checkpoint(self, self.config, renamed(), first.dtype, skip=skip)
        for name, param in self.named_parameters():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
                param.data += 1
        self.rotary.compute_table(first.device)
