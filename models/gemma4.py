"""Gemma 4 (text) over the paged KV cache (Google DeepMind 2026, Gemma 4; transformers' modeling_gemma4.py).

Gemma 3's blocks (pre- and post-norms, GeGLU, embeddings scaled by sqrt(hidden), sliding and global layers, q/k
norms) with Gemma 4's differences:
- every RMSNorm scales by its weight w itself (not 1 + w), and the values are RMS-normalised too (no weight);
- attention scores are not scaled (the q/k norms set their size);
- the global layers have heads of their own size (`global_head_dim`) and KV heads (`num_global_key_value_heads`),
  rotate only a quarter of each head's pairs ("proportional" rope), and may take their values from the key
  projection (`attention_k_eq_v`: no v_proj);
- the last `num_kv_shared_layers` layers compute no K/V: each attends to the K/V of the last earlier layer of
  its kind (ModelShape.kv_sharing), in that layer's KV cache; with `use_double_wide_mlp` their MLPs are twice as
  wide;
- per-layer embeddings (PLE, the E2B/E4B models): a second table gives each token a small vector per layer,
  mixed with a projection of the token's embedding, that each layer gates into its residual stream at its end;
- each layer's output is multiplied by a learned `layer_scalar`;
- the 26B-A4B's layers add a mixture of experts beside the dense MLP, both fed from the residual stream: a router
  (softmax top-k of the RMS-normalised stream, renormalised, then scaled per expert) and GeGLU experts, each
  branch with norms of its own, summed before the post-feedforward norm.
"""

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from models.attention.base import AttentionBackend, AttentionMetadata
from models.config import ModelShape, layer_sliding_windows
from models.distributed.group import TPGroup
from models.distributed.pipeline import PPMissingLayer, PPStage
from models.gemma import GemmaForCausalLM, GemmaMLP, PostNorm
from models.kernels import ops
from models.layers.checkpoint import keep_norms_float32, load_checkpoint
from models.layers.fused_moe import FusedMoE, select_experts
from models.layers.layernorm import HeadRMSNorm, RMSNorm
from models.layers.linear import ColumnParallelLinear, RowParallelLinear
from models.layers.rotary_embedding import RotaryEmbedding
from models.layers.vocab_parallel_embedding import VocabParallelEmbedding, embedding_and_head
from models.quantization.gguf import GGUFConfig, GGUFTensor

# a multimodal checkpoint's language model, and the towers of the other modalities (not served)
TEXT_PREFIX = "model.language_model."
OTHER_MODALITIES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def check_gemma4_config(config) -> None:
    """Raises ValueError naming a Gemma 4 setting that is not built: bidirectional attention over every token,
    biases in the attention projections."""
    if getattr(config, "attention_bias", False):
        raise ValueError("Gemma 4 with attention_bias true is not supported")
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError("use_bidirectional_attention 'all' is not supported (causal attention only)")


class Gemma4Attention(nn.Module):
    """Gemma 4's self-attention of one layer (`shape`: its ModelShape.for_layer): q (and, unless `shared`, k and,
    unless `k_eq_v`, v) in one projection; q and k RMS-normalised per head with weights, v without; rotary
    positions on q and k; the paged backend at scale 1 (window and all set in it); o_proj. A `shared` layer
    computes no K/V: forward takes the K/V its target layer computed this step, which the backend writes again at
    the same slots (the same values) before attending, so that every backend serves it unchanged."""

    def __init__(self, config, shape: ModelShape, backend, tp, quant_config, shared: bool, k_eq_v: bool):
        super().__init__()
        eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.shared, self.eps = shared, eps
        self.kv_parts = 0 if shared else 1 if k_eq_v else 2
        self.qkv_proj = ColumnParallelLinear.qkv(shape, False, tp, quant_config, kv_parts=self.kv_parts)
        self.o_proj = RowParallelLinear(shape.total_num_heads * self.head_dim, shape.hidden_size, tp, quant_config)
        self.q_norm = HeadRMSNorm(self.head_dim, eps)
        self.k_norm = None if shared else HeadRMSNorm(self.head_dim, eps)
        self.backend = backend

    def forward(self, x, rope, kv_cache, meta, kv=None) -> tuple[torch.Tensor, tuple]:
        """x: normed hidden states [T, hidden]; rope: float32 (cos, sin) [T, head_dim // 2]; kv: a shared layer's
        (k, v) [T, kv_heads, head_dim] from its target. Returns (o [T, hidden] in x's dtype, this layer's (k, v)
        for the layers that share them)."""
        dtype = self.backend.dtype or kv_cache[0].dtype
        qkv = self.qkv_proj(x, out_dtype=dtype).view(x.shape[0], -1, self.head_dim)
        q, *own = qkv.split([self.num_heads] + [self.num_kv_heads] * self.kv_parts, dim=1)
        q = self.q_norm(q)
        ops.rotary_(q, *rope)
        if not self.shared:
            values = own[-1]  # v_proj's, or the key projection's where k = v
            v = F.rms_norm(values.float(), (self.head_dim,), eps=self.eps).to(dtype)
            k = self.k_norm(own[0])
            ops.rotary_(k, *rope)
            kv = (k, v)
        o = self.backend.forward(q, *kv, kv_cache, meta)
        return self.o_proj(o.reshape(x.shape[0], -1), out_dtype=x.dtype), kv


class Gemma4Router(nn.Module):
    """Gemma 4's expert router: the residual stream RMS-normalised (no weight), scaled by `scale` and
    hidden ** -0.5, projected to the experts' logits (float32), softmax, the top-k renormalised and then multiplied
    by each chosen expert's `per_expert_scale`. h [T, hidden] -> (weights float32 [T, k], expert ids [T, k])."""

    def __init__(self, config):
        super().__init__()
        hidden, experts = config.hidden_size, config.num_experts
        self.proj = nn.Linear(hidden, experts, bias=False, dtype=torch.float32)
        self.scale = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(experts), requires_grad=False)
        self.top_k, self.eps = config.top_k_experts, config.rms_norm_eps

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.rms_norm(h.float(), h.shape[-1:], eps=self.eps) * self.scale.float() * h.shape[-1] ** -0.5
        weights, ids = select_experts(F.linear(x, self.proj.weight.float()), self.top_k, True)
        return weights * self.per_expert_scale.float()[ids], ids


class Gemma4DecoderLayer(nn.Module):
    """Pre- and post-norms around attention and the GeGLU MLP (and beside it the experts, in the 26B-A4B), then
    (with PLE) the layer's per-layer input gated in, then the whole residual stream scaled by `layer_scalar`."""

    def __init__(self, config, shape: ModelShape, backend, tp, quant_config, index: int):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.kind = config.layer_types[index]
        shared = bool(shape.kv_sharing) and shape.kv_sharing[index] is not None
        k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and self.kind == "full_attention"
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(config, shape.for_layer(index), backend, tp, quant_config, shared, k_eq_v)
        self.post_attention_layernorm = PostNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        wide = shared and getattr(config, "use_double_wide_mlp", False)
        self.mlp = GemmaMLP(config, tp, quant_config, config.intermediate_size * (2 if wide else 1))
        self.post_feedforward_layernorm = PostNorm(hidden, eps)
        self.moe = bool(getattr(config, "enable_moe_block", False))
        if self.moe:  # the 26B-A4B: experts beside the dense MLP
            self.router = Gemma4Router(config)
            inter = config.moe_intermediate_size
            self.experts = FusedMoE(config.num_experts, hidden, inter, tp, quant_config, activation="gelu_tanh")
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = PostNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = PostNorm(hidden, eps)
        self.ple_dim = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if self.ple_dim:  # replicated on every rank: they are small
            self.per_layer_input_gate = ColumnParallelLinear.merged(hidden, [self.ple_dim], False, None, quant_config)
            self.per_layer_projection = RowParallelLinear(self.ple_dim, hidden, None, quant_config)
            self.post_per_layer_input_norm = PostNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, h, ple, rope, kv_cache, meta, kv=None):
        """h: the float32 residual stream [T, hidden], updated in place; ple: this layer's per-layer input
        [T, ple_dim] (None without PLE); kv: a shared layer's target's (k, v). Returns this layer's (k, v)."""
        x, kv = self.self_attn(self.input_layernorm(h), rope, kv_cache, meta, kv)
        x = self.mlp(self.pre_feedforward_layernorm(h, self.post_attention_layernorm(x)))
        if self.moe:  # the experts of the same stream, summed with the MLP's output
            weights, ids = self.router(h)
            y = self.experts(self.pre_feedforward_layernorm_2(h), weights, ids)
            x = self.post_feedforward_layernorm_1(x) + self.post_feedforward_layernorm_2(y)
        h.add_(self.post_feedforward_layernorm(x))
        if self.ple_dim:
            dtype = self.input_layernorm.weight.dtype  # the linears' input dtype (float32 in a quantized model)
            gate = F.gelu(self.per_layer_input_gate(h.to(dtype)), approximate="tanh") * ple
            h.add_(self.post_per_layer_input_norm(self.per_layer_projection(gate.to(dtype))))
        h.mul_(self.layer_scalar)
        return kv


class Gemma4ForCausalLM(nn.Module):
    """Gemma 4's text decoder (Gemma4ForCausalLM, and the language model of Gemma4ForConditionalGeneration), the
    LM head tied to the embedding unless the config says otherwise. Shapes as LlamaForCausalLM's; `backend` one
    per layer (a sharing layer gets its target's). Raises ValueError for what check_gemma4_config refuses, and
    for pipeline stages with per-layer embeddings (each stage would need the token embedding)."""

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
        check_gemma4_config(config)
        self.config = config
        n = config.num_hidden_layers
        self.pp = pp = pp or PPStage.whole(n)
        self.ple_dim = getattr(config, "hidden_size_per_layer_input", 0) or 0
        if self.ple_dim and not (pp.is_first and pp.is_last):
            raise ValueError("Gemma 4's per-layer embeddings are not built for pipeline parallelism")
        layer_sliding_windows(config)  # refuses unknown layer types
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(
                    config, shape.for_layer(config.layer_types.index(kind)).head_dim, max_model_len, kind
                )
                for kind in set(config.layer_types)
            }
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.embed_tokens, self.lm_head = embedding_and_head(config, tp, quant_config, pp, self.tie_word_embeddings)
        backends = backend if isinstance(backend, list) else [backend] * n
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, shape, backends[i], tp, quant_config, i) if pp.holds(i) else PPMissingLayer()
            for i in range(n)
        )
        self.kv_sharing = shape.kv_sharing or (None,) * n
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if pp.is_last else PPMissingLayer()
        if self.ple_dim:
            vocab, width = config.vocab_size_per_layer_input, n * self.ple_dim
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab, width, tp, quant_config)
            self.per_layer_model_projection = ColumnParallelLinear.merged(
                config.hidden_size, [width], False, None, quant_config
            )
            self.per_layer_projection_norm = PostNorm(self.ple_dim, config.rms_norm_eps)
        self.quantized = quant_config is not None
        self.normalizer = math.sqrt(config.hidden_size)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.supports_cuda_graphs = not getattr(config, "enable_moe_block", False)  # experts routed on the host

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """PLE's inputs [T, layers, ple_dim] (float32): the token's own per-layer vectors (its row of
        embed_tokens_per_layer, times sqrt(ple_dim)) and a projection of its scaled embedding `embeds` (times
        hidden ** -0.5, RMS-normalised per layer), summed and scaled by 1 / sqrt(2), as transformers'
        get_per_layer_inputs and project_per_layer_inputs."""
        shape = (input_ids.shape[0], self.config.num_hidden_layers, self.ple_dim)
        own = self.embed_tokens_per_layer(input_ids).float().view(shape) * math.sqrt(self.ple_dim)
        dtype = self.norm.weight.dtype  # the linears' input dtype (float32 in a quantized model)
        mixed = self.per_layer_model_projection(embeds.to(dtype)).float() * self.config.hidden_size**-0.5
        mixed = self.per_layer_projection_norm(mixed.view(-1, self.ple_dim)).view(shape)
        return (mixed + own) * 2**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: list[AttentionMetadata],
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As LlamaForCausalLM.forward: kv_caches and attn_metadata per layer of this stage (a sharing layer's
        are its target's)."""
        if self.pp.is_first:
            residual = self.embed_tokens(input_ids).float() * self.normalizer
        ple = self.per_layer_inputs(input_ids, residual) if self.ple_dim else None
        rope = {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        computed = {}  # this step's K/V of each layer that others share
        for i in range(self.pp.start_layer, self.pp.end_layer):
            layer, j = self.layers[i], i - self.pp.start_layer
            target = self.kv_sharing[i]
            kv = layer(
                residual,
                None if ple is None else ple[:, i],
                rope[layer.kind],
                kv_caches[j],
                attn_metadata[j],
                computed.get(target),
            )
            computed[i] = kv
        return self.norm(residual) if self.pp.is_last else residual

    compute_logits = GemmaForCausalLM.compute_logits  # the soft-capped head, Gemma 2's

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As LlamaForCausalLM.load_weights. A multimodal checkpoint's `model.language_model.` is the model, its
        other towers are passed over; so are the K/V projections and norms a sharing layer's checkpoint may
        carry (transformers ignores them too). The norms keep their weights as they are (Gemma 4 scales by w)."""
        first = self.layers[self.pp.start_layer].input_layernorm.weight
        dtype = first.dtype
        if self.quantized:
            keep_norms_float32(self)
        shared = tuple(
            f"layers.{i}.self_attn.{p}" for i, t in enumerate(self.kv_sharing) if t is not None for p in ("k_", "v_")
        )

        inter = getattr(self.config, "moe_intermediate_size", None)

        def half(tensor, i: int):  # the gate (0) or up (1) rows of every expert's fused gate_up
            if isinstance(tensor, GGUFTensor):  # E * 2 * inter rows of blocks
                rows = torch.arange(tensor.rows).view(-1, 2, inter)[:, i].reshape(-1)
                return tensor.select_rows(rows)
            return tensor[:, i * inter : (i + 1) * inter]

        def renamed():
            for name, tensor in weights:
                if name.startswith(OTHER_MODALITIES):
                    continue
                name = name.replace(TEXT_PREFIX, "model.", 1).removeprefix("model.")
                if name.startswith(shared):
                    continue
                name = name.removesuffix(".weight") if ".experts." in name else name  # a GGUF file's names
                if name.endswith(".experts.gate_up_proj"):  # every expert's [E, 2 * inter, hidden]: gate, then up
                    for i, part in enumerate(("gate_proj", "up_proj")):
                        yield name.replace("gate_up_proj", f"{part}.weight"), half(tensor, i)
                elif name.endswith(".experts.down_proj"):
                    yield name + ".weight", tensor
                else:
                    yield name, tensor

        skip = "lm_head.weight" if self.tie_word_embeddings else None
        load_checkpoint(self, self.config, renamed(), dtype, skip=skip)
        for rotary in self.rotary.values():
            rotary.compute_table(first.device)
