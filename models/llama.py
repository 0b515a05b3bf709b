"""The Llama family over a paged KV cache: Llama 2/3, Mistral (sliding windows), Qwen2, Qwen3 (q/k norms),
SmolLM2, SmolLM3 (no rotary on some layers), Granite (embedding, attention, residual and logits multipliers),
Phi-3 and Phi-4-mini (fused q/k/v and gate/up tensors; LongRoPE, partial rotary), and the mixtures of experts
Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss (models/layers/fused_moe.py in place of the MLP; gpt-oss adds attention
sinks, an o_proj bias, alternating sliding windows and YaRN positions).

Llama: Touvron et al. 2023; RMSNorm (Zhang & Sennrich 2019), rotary embeddings (Su et al. 2021),
grouped-query attention (Ainslie et al. 2023), SwiGLU (Shazeer 2020). Tokens of all sequences in a
step are flattened to one [T, hidden] batch; attention goes through the engine's backend, which
reads and writes the paged cache with the step's `AttentionMetadata`.
"""

import itertools
from typing import Iterable

import torch
from torch import nn

from models.attention.base import AttentionBackend, AttentionMetadata
from models.config import ModelShape
from models.distributed.group import TPGroup
from models.distributed.pipeline import PPMissingLayer, PPStage
from models.layers.attention import SelfAttention
from models.layers.checkpoint import keep_norms_float32, load_checkpoint
from models.layers.fused_layer import FusedDecoderLayer, FusedDecoderStack
from models.layers.fused_moe import SparseMoeBlock, gpt_oss_tensors, is_sparse_layer
from models.layers.layernorm import RMSNorm
from models.layers.mlp import SwiGLUMLP
from models.layers.rotary_embedding import RotaryEmbedding, rotary_dim
from models.layers.vocab_parallel_embedding import embedding_and_head
from models.quantization.gguf import GGUFConfig


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config, shape: ModelShape, backend, bias, tp, qk_norm: bool, quant_config, layer: int, qkv_bias: bool
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 = rotary, 0 = none
        self.self_attn = SelfAttention(
            shape,
            backend,
            bias,
            tp,
            config.rms_norm_eps if qk_norm else None,
            quant_config,
            use_rope=bool(no_rope[layer]) if no_rope else True,
            rotary_dim=rotary_dim(config, shape.head_dim),  # Phi-4-mini rotates 3/4 of each head
            # Llama's attention_bias covers o_proj too (gpt-oss); Qwen2's q/k/v biases (qkv_bias) do not
            o_bias=bool(getattr(config, "attention_bias", False)) and not qkv_bias,
            sinks=getattr(config, "model_type", None) == "gpt_oss",
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Qwen3-MoE and Mixtral: experts in place of the MLP (in every layer, or as the config spaces them)
        self.mlp = (
            SparseMoeBlock(config, tp, quant_config)
            if is_sparse_layer(config, layer)
            else SwiGLUMLP(config.hidden_size, config.intermediate_size, tp, quant_config)
        )
        # Granite scales each sublayer's output before it joins the residual stream
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))
        # the whole layer in one C call for small CPU steps (models/layers/fused_layer.py): built at the first
        # step, once the weights are loaded; False where the layer has something the C entry point lacks
        self.fused: FusedDecoderLayer | bool | None = None

    def forward(self, residual, x, rope, kv_cache, meta):
        """residual: the float32 stream [T, hidden], updated in place; x: the previous layer's MLP output
        (None before the first layer), already scaled by the residual multiplier. Returns this layer's MLP
        output, so scaled, not yet added."""
        if self.fused is None:
            self.fused = FusedDecoderLayer.build(self) or False
        if self.fused and (out := self.fused(residual, x, rope, kv_cache, meta)) is not None:
            return out
        x = self.self_attn(self.input_layernorm(residual, x), rope, kv_cache, meta)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x = self.mlp(self.post_attention_layernorm(residual, x))
        return x * self.residual_multiplier if self.residual_multiplier != 1.0 else x


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder over the paged KV cache.

    `forward` maps a flat step batch (input_ids, positions: int64 [T]) to hidden states
    [T, hidden_size]; `compute_logits` maps selected hidden states [N, hidden] to float32 logits
    [N, vocab] (on rank 0 only under tensor parallelism). `qkv_bias` is True for Qwen2 (and any config
    with `attention_bias`); `qk_norm` for Qwen3 (per-head RMSNorm of queries and keys); `quant_config` keeps a
    GGUF file's quantized weights in the linear layers and the embedding (models/quantization). `shape` is this
    rank's (models.config); with `tp`, this rank holds its shard of every layer (models/distributed). With
    `pp` (a pipeline stage, models/distributed/pipeline.py) it holds only that stage's layers; `forward` then
    takes the previous stage's residual stream (float32 [T, hidden]) instead of embedding the tokens, and a
    stage but the last returns its residual stream rather than the normed hidden states.
    `backend`: the attention backend of every layer, or a list with each layer's (layers with a sliding window
    have their own: models.attention.make_backends).
    """

    def __init__(
        self,
        config,
        shape: ModelShape,
        backend: AttentionBackend | list[AttentionBackend],
        max_model_len: int,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        tp: TPGroup | None = None,
        quant_config: GGUFConfig | None = None,
        pp: PPStage | None = None,
    ):
        super().__init__()
        check_config(config)
        self.config = config
        self.pp = pp = pp or PPStage.whole(config.num_hidden_layers)
        self.rotary = RotaryEmbedding(config, rotary_dim(config, shape.head_dim), max_model_len)
        bias = qkv_bias or bool(getattr(config, "attention_bias", False))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens, self.lm_head = embedding_and_head(config, tp, quant_config, pp, self.tie_word_embeddings)
        backends = backend if isinstance(backend, list) else [backend] * config.num_hidden_layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, shape, backends[i], bias, tp, qk_norm, quant_config, i, qkv_bias)
            if pp.holds(i)
            else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else PPMissingLayer()
        # MoE layers group tokens by expert with host-side counts: eager steps only (engine/worker/model_runner.py)
        self.supports_cuda_graphs = not any(isinstance(m, SparseMoeBlock) for m in self.modules())
        self.quantized = quant_config is not None
        # Granite's multipliers of the embeddings and divisor of the logits (1 elsewhere)
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))
        self.fused_stack: FusedDecoderStack | bool | None = None  # the layers in one C call (FusedDecoderStack)
        self.step_logits: tuple | None = None  # the logits (and argmax) a forward computed with its last C call

    # forward takes `logits_indices` and may compute those rows' logits with the layers (take_step_logits)
    fuses_logits = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: list[AttentionMetadata],
        residual: torch.Tensor | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of one step's tokens `input_ids` at `positions` (int64 [T]); kv_caches and
        attn_metadata: those of each layer of this pipeline stage (a layer's KV cache group's metadata); on a
        stage but the first, the previous stage's float32 `residual` [T, hidden] instead of the embeddings,
        and on a stage but the last the residual stream is returned instead of the final norm's output. Where the
        whole stage runs in one C call (FusedDecoderStack.step), the embedding, the final norm and the logits of the
        rows `logits_indices` (int64, increasing) run in it too: take_step_logits then gives those logits (and their
        argmax)."""
        # The residual stream stays float32 (see models/kernels/csrc/layer_ops.c); sublayers run in the model dtype
        # (a quantized model's linears in float32: load_weights).
        self.step_logits = None
        if self.fused_stack is None:  # every layer in one C call for small CPU steps; built at the first step
            self.fused_stack = self._build_stack() or False
        if self.fused_stack and self.fused_stack.ends is not None:
            if self.pp.is_first and not self.fused_stack.ends.embed:
                residual = self._embed(input_ids)
            done = self.fused_stack.step(input_ids, positions, residual, kv_caches, attn_metadata, logits_indices)
            if done is not None:
                hidden, logits, argmax = done
                self.step_logits = None if logits is None else (logits, argmax)
                return hidden
        if self.pp.is_first and residual is None:
            residual = self._embed(input_ids)
        x, rope = None, self.rotary(positions)
        out = self.fused_stack(residual, x, rope, kv_caches, attn_metadata) if self.fused_stack else None
        if out is not None:
            x = out
        else:  # islice: a ModuleList slice builds a new ModuleList, 30 add_module calls a step (0.15 ms at batch 1)
            layers = itertools.islice(self.layers, self.pp.start_layer, self.pp.end_layer)
            for layer, kv_cache, meta in zip(layers, kv_caches, attn_metadata):
                x = layer(residual, x, rope, kv_cache, meta)
        return self.norm(residual, x) if self.pp.is_last else residual.add_(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The float32 residual stream [T, hidden] a first stage starts from: the tokens' embeddings (Granite's
        multiplier applied)."""
        residual = self.embed_tokens(input_ids).float()
        if self.embedding_multiplier != 1.0:
            residual *= self.embedding_multiplier
        return residual

    def _build_stack(self) -> FusedDecoderStack | None:
        """The stage's layers in one C call (None where a layer has no fused form), with the model's ends where the
        call can take them: the embedding (without Granite's multiplier), the final norm and the LM head (without
        its logits divisor)."""
        stack = FusedDecoderStack.build(list(self.layers[self.pp.start_layer : self.pp.end_layer]))
        if stack is not None:
            head = self.embed_tokens if self.lm_head is None else self.lm_head
            stack.add_ends(
                self.embed_tokens if self.pp.is_first and self.embedding_multiplier == 1.0 else None,
                self.rotary,
                self.norm if self.pp.is_last else None,
                head if self.pp.is_last and self.logits_scaling == 1.0 else None,
            )
        return stack

    def take_step_logits(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The logits the last forward computed for its `logits_indices` (float32 [N, vocab], compute_logits'
        values) and their rows' argmax (int64 [N], ops.argmax's), once; None where it left them to compute_logits."""
        step, self.step_logits = self.step_logits, None
        return step

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        return logits / self.logits_scaling if logits is not None and self.logits_scaling != 1.0 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face checkpoint tensors into this model (models.layers.checkpoint: q/k/v and gate/up
        stacked, each rank keeping its part). Also computes the rotary table (not in checkpoints), so the model
        may be built on the meta device and materialized with `models.loader.materialize` (no random init of
        weights the checkpoint overwrites).

        Raises KeyError for an unknown tensor name and ValueError when a parameter stays unset.
        """
        dtype = self.layers[self.pp.start_layer].input_layernorm.weight.dtype  # the model dtype (--dtype)
        if self.quantized:
            keep_norms_float32(self)
        skip = "lm_head.weight" if self.tie_word_embeddings else None
        if getattr(self.config, "model_type", None) == "gpt_oss":
            weights = gpt_oss_tensors(weights)
        load_checkpoint(self, self.config, weights, dtype, skip=skip)
        self.rotary.compute_table(self.layers[self.pp.start_layer].input_layernorm.weight.device)


def check_config(config) -> None:
    """Raises ValueError naming a config field this model file does not build (so that a setting that would
    change the output is refused, never ignored): another activation than SiLU, MLP biases. Rope types and sliding
    windows are checked where they are built (rotary_embedding.py, models.config)."""
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported by the Llama family (supported: silu)")
    if getattr(config, "mlp_bias", False):
        raise ValueError("mlp_bias true is not supported")
