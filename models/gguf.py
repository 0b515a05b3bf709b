"""A GGUF file read directly: the model config and the tokenizer from its metadata, the weights from a
memory map, quantized tensors kept as their ggml blocks (no Hugging Face directory is written).

The header (metadata and tensor table) is parsed by transformers' GGUF reader, which skips the
vocabulary strings it is not asked for: gguf-py's `GGUFReader` decodes all of them in Python (2.5 s
for SmolLM2's 49k tokens and merges, on every start), transformers' reader takes 16 ms. The tokenizer
is transformers' GGUF tokenizer conversion (0.5 s). Tensor names and the q/k row order follow llama.cpp's
converter (convert_hf_to_gguf.py), which this module undoes.
"""

import functools
import json
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType

from models.layers.fused_moe import SWIGLU_ALPHA, SWIGLU_LIMIT
from models.quantization.gguf import FLOAT_TYPES, QUANTIZED_TYPES, GGUFTensor

# general.architecture -> transformers architecture (and its config class)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
}
# architectures whose q/k rows llama.cpp's converter interleaves (LlamaModel.permute), undone at load
PERMUTED = ("llama", "smollm3", "granite")
# architectures whose norms the converter stores as 1 + w (Gemma's scale); w is given back to the model
NORM_SHIFTED = ("gemma2", "gemma3", "qwen35", "qwen35moe")
# Qwen3.5's architectures, dense and MoE
QWEN35 = ("qwen35", "qwen35moe")
# GGUF tensor name (after blk.N.) -> Hugging Face name (after model.layers.N.)
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # an MoE layer's router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # every expert's, stacked [E, rows, cols] (models/layers/fused_moe.py)
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # Qwen2-MoE's shared expert and its gate
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Llama 3.1's rope scaling as llama.cpp's converter writes it: the divisor of each rotary frequency
ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's per-dimension divisors of the frequencies (Phi-3's 128k models, Phi-3.5, Phi-4-mini): into the config
ROPE_FACTORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
# Gemma's names of its four norms per layer (ffn_norm is the pre-feedforward one there)
GEMMA_TENSORS = LAYER_TENSORS | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 4's: its per-layer-embedding gate, projection and norm, and each layer's output scale (no .weight in ours)
GEMMA4_TENSORS = GEMMA_TENSORS | {
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",  # the 26B-A4B's router and experts (gate and up in one tensor), their norms
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.down_proj",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}
# Gemma 4's per-layer parameters without .weight: each layer's output scale, its router's scales
GEMMA4_PARAMETERS = {
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",  # llama.cpp scales each expert's output; the same
}
GEMMA4_MODEL_TENSORS = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
# Phi-3's fused projections: q, k, v rows in one tensor, and the gate rows then the up rows in ffn_up
PHI3_TENSORS = LAYER_TENSORS | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# gpt-oss's: the norm before the MoE is the converter's post_attention_norm; its sinks (`sinks` in the model)
GPT_OSS_TENSORS = LAYER_TENSORS | {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"}
# LFM2's: its pre-norms, MLP and short convolutions under their checkpoint names
LFM2_TENSORS = LAYER_TENSORS | {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
}
# Qwen3.5's: the norm before its MLP, its gated attention (q_proj: per head the queries then the gates), and the
# Gated DeltaNet's projections, convolution, decay (ssm_a: A = -exp(A_log)), time-step bias and gated norm
QWEN35_TENSORS = LAYER_TENSORS | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# per-layer parameters whose GGUF names have no .weight / .bias of the Hugging Face kind
QWEN35_PARAMETERS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
MODEL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "token_embd_norm.weight": "model.embedding_norm.weight",  # LFM2's final norm
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


@functools.lru_cache(maxsize=4)
def read_header(path: str):
    """The file's metadata and tensor table (transformers' `GgufHeader`, with `.metadata`), validated:
    every tensor's bytes lie inside the file. Raises ValueError naming the file for anything malformed."""
    from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata

    _teach_transformers_block_sizes()
    try:
        header = GgufHeader.from_file(path)
        metadata, _ = read_gguf_metadata(path)
    except ValueError as e:
        raise ValueError(_unsupported_tensor(path) or f"{path}: not a GGUF file this server can read: {e}") from None
    except Exception as e:  # struct.error / IndexError on a cut header
        raise ValueError(f"{path}: truncated or corrupt GGUF header ({e.__class__.__name__}: {e})") from None
    size = Path(path).stat().st_size
    for info in header.tensors:
        if header.data_start + info.offset + info.nbytes > size:
            raise ValueError(
                f"{path}: truncated: tensor {info.name} ends at byte "
                f"{header.data_start + info.offset + info.nbytes}, the file has {size}"
            )
    arch = metadata["general.architecture"]
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return header, metadata


@functools.cache
def _teach_transformers_block_sizes() -> None:
    """transformers' reader sizes each tensor from its own table of the types it can dequantize, which lacks
    Q5_0 and Q5_1 (a file holding them is refused as a whole): the sizes of the types our kernels compute with
    are added to it, from gguf-py's GGML_QUANT_SIZES."""
    from gguf import GGML_QUANT_SIZES
    from transformers.integrations.gguf import dequant

    for qtype in QUANTIZED_TYPES:
        dequant.GGML_BLOCK.setdefault(int(qtype), GGML_QUANT_SIZES[qtype])
        dequant.GGML_NAME.setdefault(int(qtype), qtype.name)


def _unsupported_tensor(path: str) -> str | None:
    """The first tensor of a type we cannot load, named, for the error message (gguf-py's reader, slow but
    only on this error path); None when the file has none or gguf-py cannot read it either."""
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(path).tensors
    except Exception:  # noqa: BLE001 - the caller reports the original error
        return None
    for t in tensors:
        if t.tensor_type not in QUANTIZED_TYPES + FLOAT_TYPES:
            kinds = ", ".join(k.name for k in QUANTIZED_TYPES + FLOAT_TYPES)
            return f"{path}: tensor {t.name} has ggml type {t.tensor_type.name}, not supported (supported: {kinds})"
    return None


def _key(path: str, metadata: dict, name: str, default=None):
    """`{arch}.{name}` from the metadata; raises ValueError naming the file when missing and no default."""
    key = f"{metadata['general.architecture']}.{name}"
    if key in metadata:
        return metadata[key]
    if default is None:
        raise ValueError(f"{path}: metadata key {key} is missing")
    return default


@dataclass
class GGUFModelConfig:
    """The config fields the engine reads, as a transformers config names them (a plain dataclass:
    transformers' config classes take seconds to import, a third of a warm start)."""

    architectures: list[str]
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    rope_parameters: dict = field(default_factory=dict)
    attention_bias: bool = False
    # the architectures' own fields (their transformers names), neutral by default
    hidden_act: str = "silu"
    no_rope_layers: list[int] | None = None  # SmolLM3
    embedding_multiplier: float = 1.0  # Granite
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    sliding_window: int | None = None  # Gemma 2/3, Phi-3
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2
    final_logit_softcapping: float | None = None
    num_experts: int | None = None  # mixtures of experts (Qwen3-MoE; Mixtral, which llama.cpp calls llama)
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] | None = None  # dense layers among MoE ones (their tensors say which)
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE
    swiglu_limit: float | None = None  # gpt-oss
    swiglu_alpha: float | None = None
    norm_eps: float | None = None  # LFM2 (its MLP width already adjusted in the file: no block_* fields)
    conv_L_cache: int | None = None
    conv_bias: bool = False
    linear_conv_kernel_dim: int | None = None  # Qwen3.5's Gated DeltaNet
    linear_key_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_value_head_dim: int | None = None
    linear_value_heads_tiled: bool = False  # llama.cpp's order of the value heads (GatedDeltaNet's tiled_heads)
    per_layer_config: list | None = None  # Gemma 4: each layer's head_dim and num_key_value_heads
    num_kv_shared_layers: int = 0
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int | None = None
    enable_moe_block: bool = False  # Gemma 4's 26B-A4B
    top_k_experts: int | None = None


def load_gguf_config(path: str) -> GGUFModelConfig:
    """The model config from the file's metadata, as llama.cpp's converter wrote it from the model's
    config.json. Raises ValueError naming the file and what is missing or unsupported."""
    header, md = read_header(path)
    arch = md["general.architecture"]
    heads = _key(path, md, "attention.head_count")
    hidden = _key(path, md, "embedding_length")
    names = {info.name for info in header.tensors}
    vocab = md.get(f"{arch}.vocab_size") or next(i.shape[0] for i in header.tensors if i.name == "token_embd.weight")
    rope = _rope_fields(path, md)
    if ROPE_FREQS in names and arch != "gemma4":  # Llama 3.1+: the converter's per-dimension frequency divisors
        rope["freq_factors"] = _float_tensor(header, ROPE_FREQS).tolist()
    if ROPE_FACTORS["long_factor"] in names:  # LongRoPE: the short set up to the original context, then the long
        rope |= {key: _float_tensor(header, name).tolist() for key, name in ROPE_FACTORS.items()}
        rope |= {
            "rope_type": "longrope",
            "original_max_position_embeddings": _key(path, md, "rope.scaling.original_context_length"),
            "attention_factor": md.get(f"{arch}.rope.scaling.attn_factor"),
        }
    layers = _layer_count(path, md)
    head_dim = _key(path, md, "attention.key_length", hidden // heads)
    rope_dims = md.get(f"{arch}.rope.dimension_count", head_dim)
    if arch in QWEN35 or arch == "phi3":  # rotate-half over the leading rope_dims of each head (Phi-4-mini: 3/4)
        rope["partial_rotary_factor"] = rope_dims / head_dim
    elif rope_dims != head_dim and arch != "gemma4":  # Gemma 4's global layers: proportional rope (its fields)
        raise ValueError(
            f"{path}: rope.dimension_count {rope_dims} < head_dim {head_dim} (partial rotary) is not supported"
        )
    extra = {}
    if arch == "smollm3":  # llama.cpp's rule (no metadata): no rotary on every fourth layer
        extra["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(layers)]
    elif arch == "granite":
        extra = dict(
            attention_multiplier=md.get(f"{arch}.attention.scale"),
            embedding_multiplier=md.get(f"{arch}.embedding_scale", 1.0),
            residual_multiplier=md.get(f"{arch}.residual_scale", 1.0),
            logits_scaling=md.get(f"{arch}.logit_scale", 1.0),
        )
    elif arch == "phi3":  # one window for every layer (0: none, Phi-4)
        extra["sliding_window"] = md.get("phi3.attention.sliding_window") or None
    elif arch == "gemma2":
        extra = _gemma2_fields(md, layers, hidden, heads, head_dim)
    elif arch == "gemma3":
        extra = _gemma3_fields(path, md, layers, hidden, heads, head_dim, rope)
    elif arch == "gemma4":
        extra = _gemma4_fields(path, header, md, layers, rope)
    elif arch == "lfm2":  # a layer with no KV heads is a short convolution; the MLP width is the adjusted one
        extra = dict(
            layer_types=["conv" if n == 0 else "full_attention" for n in md["lfm2.attention.head_count_kv"]],
            norm_eps=_key(path, md, "attention.layer_norm_rms_epsilon"),
            conv_L_cache=_key(path, md, "shortconv.l_cache"),
        )
    elif arch in QWEN35:  # the DeltaNet's sizes under llama.cpp's ssm names; its value heads in tiled order
        value_heads = _key(path, md, "ssm.time_step_rank")
        extra = dict(
            layer_types=[
                "linear_attention" if r else "full_attention" for r in md[f"{arch}.attention.recurrent_layers"][:layers]
            ],
            linear_conv_kernel_dim=_key(path, md, "ssm.conv_kernel"),
            linear_key_head_dim=_key(path, md, "ssm.state_size"),
            linear_num_key_heads=_key(path, md, "ssm.group_count"),
            linear_num_value_heads=value_heads,
            linear_value_head_dim=_key(path, md, "ssm.inner_size") // value_heads,
            linear_value_heads_tiled=True,
        )
    elif arch == "gpt-oss":  # llama.cpp's rules: the window on every other layer from the first, fixed SwiGLU clamp
        window = md.get("gpt-oss.attention.sliding_window")
        extra = dict(
            sliding_window=window or None,
            layer_types=["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(layers)],
            swiglu_limit=SWIGLU_LIMIT,
            swiglu_alpha=SWIGLU_ALPHA,
        )
    if md.get(f"{arch}.expert_count"):  # llama.cpp's MoE layers: softmax routing, top-k renormalised but in qwen2moe
        extra |= dict(
            num_experts=md[f"{arch}.expert_count"],
            num_experts_per_tok=_key(path, md, "expert_used_count"),
            moe_intermediate_size=md.get(f"{arch}.expert_feed_forward_length"),
            norm_topk_prob=bool(md.get(f"{arch}.expert_weights_norm", arch != "qwen2moe")),
            shared_expert_intermediate_size=md.get(f"{arch}.expert_shared_feed_forward_length"),
            mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
        )
    fields = dict(
        architectures=[ARCHITECTURES[arch]],
        model_type={
            "gemma3": "gemma3_text",
            "gemma4": "gemma4_text",
            "gpt-oss": "gpt_oss",
            "qwen35": "qwen3_5_text",
            "qwen35moe": "qwen3_5_moe_text",
        }.get(arch, arch),
        hidden_act="gelu_pytorch_tanh" if arch.startswith("gemma") else "silu",
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=md.get(f"{arch}.feed_forward_length") or _key(path, md, "expert_feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=_max(_key(path, md, "attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_key(path, md, "attention.layer_norm_rms_epsilon"),
        max_position_embeddings=_key(path, md, "context_length"),
        vocab_size=vocab,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        rope_parameters=extra.pop("rope_parameters", rope),
        attention_bias=arch in ("qwen2", "qwen2moe", "gpt-oss"),
    )
    return GGUFModelConfig(**fields | extra)


def _layer_count(path: str, md: dict) -> int:
    """The decoder's layers: block_count less the multi-token-prediction blocks the converter appends after them
    (`nextn_predict_layers`: Qwen3.5's MTP head, which this server does not run)."""
    return _key(path, md, "block_count") - md.get(f"{md['general.architecture']}.nextn_predict_layers", 0)


def _max(count: int | list[int]) -> int:
    """A per-layer count (LFM2's KV heads, 0 on its conv layers) as the model's."""
    return max(count) if isinstance(count, list) else count


def _rope_fields(path: str, md: dict) -> dict:
    """The rope parameters (transformers' names) of the file's `rope.*` keys: the base, and linear or YaRN scaling
    (YaRN's ramp ends rounded outwards, transformers' default, but for gpt-oss, whose config says not to). Raises
    ValueError naming another scaling type or a YaRN key this server does not apply."""
    arch = md["general.architecture"]
    scaling = md.get(f"{arch}.rope.scaling.type", "none")
    rope = {"rope_type": "default", "rope_theta": _key(path, md, "rope.freq_base", 10000.0)}
    if scaling == "linear":
        rope |= {"rope_type": "linear", "factor": _key(path, md, "rope.scaling.factor")}
    elif scaling == "yarn":
        if md.get(f"{arch}.rope.scaling.yarn_ext_factor", 1.0) != 1.0:
            raise ValueError(f"{path}: rope.scaling.yarn_ext_factor other than 1 is not supported")
        rope |= {
            "rope_type": "yarn",
            "factor": _key(path, md, "rope.scaling.factor"),
            "original_max_position_embeddings": _key(path, md, "rope.scaling.original_context_length"),
            "beta_fast": md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0),
            "attention_factor": md.get(f"{arch}.rope.scaling.yarn_attn_factor"),
            "truncate": arch != "gpt-oss",
        }
    elif scaling not in ("none", ""):
        raise ValueError(f"{path}: rope scaling {scaling!r} is not supported (supported: linear, yarn)")
    return rope


def _gemma2_fields(md: dict, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 2's fields as llama.cpp reads them: the window on every other layer from the first, the soft caps,
    1 / sqrt(head_dim) as the attention scale (hidden / heads for the 46-layer 27B model)."""
    window = md.get("gemma2.attention.sliding_window")
    return dict(
        sliding_window=window or None,
        layer_types=["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(layers)],
        query_pre_attn_scalar=hidden // heads if layers == 46 else head_dim,
        attn_logit_softcapping=md.get("gemma2.attn_logit_softcapping"),
        final_logit_softcapping=md.get("gemma2.final_logit_softcapping"),
    )


def _gemma3_fields(path: str, md: dict, layers: int, hidden: int, heads: int, head_dim: int, rope: dict) -> dict:
    """Gemma 3's fields as llama.cpp reads them: the sliding window on 5 of every 6 layers (or the file's
    sliding_window_pattern), the sliding layers' own rope base, 1 / sqrt(head_dim) as the attention scale
    (hidden / heads for the 62-layer 27B model)."""
    window = md.get("gemma3.attention.sliding_window")
    pattern = md.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    scalar = hidden // heads if layers == 62 else head_dim
    local = {"rope_type": "default", "rope_theta": md.get("gemma3.rope.freq_base_swa", 10000.0)}
    return dict(
        sliding_window=window or None,
        layer_types=["sliding_attention" if window and s else "full_attention" for s in sliding],
        query_pre_attn_scalar=scalar,
        rope_parameters={"sliding_attention": local, "full_attention": rope},
    )


def _gemma4_fields(path: str, header, md: dict, layers: int, rope: dict) -> dict:
    """Gemma 4's fields as llama.cpp's converter writes them: the sliding layers' head_dim (key_length_swa) and
    the global layers' (key_length) with each layer's KV heads, the window pattern, the shared-K/V layers, the
    per-layer embeddings' width, the MLP widths (twice on the shared layers: use_double_wide_mlp), the experts
    beside them (the 26B-A4B: expert_count), values taken
    from the keys where a global layer has no attn_v, the sliding layers' rope base, and the global layers'
    proportional rope as the `rope_freqs` divisors say it (1 on the turning pairs, 1e30 on the others)."""
    names = {info.name for info in header.tensors}
    sliding = [bool(x) for x in md["gemma4.attention.sliding_window_pattern"]][:layers]
    dims = (_key(path, md, "attention.key_length_swa"), _key(path, md, "attention.key_length"))
    kv = _key(path, md, "attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    ff = _key(path, md, "feed_forward_length")
    ff = ff if isinstance(ff, list) else [ff] * layers
    shared = md.get("gemma4.attention.shared_kv_layers", 0)
    first_global = sliding.index(False)
    divisors = _float_tensor(header, ROPE_FREQS) if ROPE_FREQS in names else torch.ones(dims[1] // 2)
    full = {"rope_type": "proportional", "rope_theta": rope["rope_theta"]}
    full["partial_rotary_factor"] = 2 * int((divisors == 1).sum()) / dims[1]
    local = {"rope_type": "default", "rope_theta": md.get("gemma4.rope.freq_base_swa", 10000.0)}
    ple = md.get("gemma4.embedding_length_per_layer_input", 0)
    ple_vocab = next((i.shape[0] for i in header.tensors if i.name == "per_layer_token_embd.weight"), None)
    return dict(
        head_dim=dims[0],
        num_key_value_heads=kv[0],
        per_layer_config=[
            SimpleNamespace(head_dim=dims[not s], num_key_value_heads=k) for s, k in zip(sliding, kv[:layers])
        ],
        sliding_window=md.get("gemma4.attention.sliding_window"),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        num_kv_shared_layers=shared,
        attention_k_eq_v=f"blk.{first_global}.attn_v.weight" not in names,
        intermediate_size=ff[0],
        use_double_wide_mlp=bool(shared) and ff[layers - 1] == 2 * ff[0],
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=ple_vocab,
        final_logit_softcapping=md.get("gemma4.final_logit_softcapping"),
        rope_parameters={"sliding_attention": local, "full_attention": full},
        enable_moe_block=bool(md.get("gemma4.expert_count")),
        top_k_experts=md.get("gemma4.expert_used_count"),
    )


def _float_tensor(header, name: str) -> torch.Tensor:
    """An F32 tensor of the file, read whole (a small one: rope_freqs). Raises ValueError for another type."""
    from transformers.integrations.gguf.reader import load_gguf_state_dict

    info = next(i for i in header.tensors if i.name == name)
    if info.ggml_type != GGMLQuantizationType.F32:
        raise ValueError(f"tensor {name} has ggml type {info.ggml_type}, F32 expected")
    data = load_gguf_state_dict(header)[name].data
    return torch.from_numpy(np.frombuffer(np.array(data).tobytes(), dtype=np.float32).copy()).reshape(info.shape)


def load_gguf_tokenizer(path: str, cache: Path | None = None):
    """The file's tokenizer (`tokenizer.ggml.*`, chat template included) as a transformers fast tokenizer,
    through transformers' GGUF tokenizer conversion (~0.75 s for a 49k vocabulary). With `cache` (a
    directory per file) the converted tokenizer is written there once (tokenizer.json and the
    constructor's arguments) and read back on later starts (~0.1 s). Raises ValueError for a bad file."""
    from transformers import PreTrainedTokenizerFast

    read_header(path)  # a clear error for a bad file before transformers' own
    if cache is not None and (cache / "tokenizer_args.json").exists():
        args = json.loads((cache / "tokenizer_args.json").read_text())
        return PreTrainedTokenizerFast(tokenizer_file=str(cache / "tokenizer.json"), name_or_path=path, **args)
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    args = tokenizer_config | extra
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent))
        backend.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_args.json").write_text(json.dumps(args))  # written last: it marks the entry complete
        try:
            tmp.rename(cache)  # atomic: a concurrent start either wins or finds `cache` complete
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=path, **args)


def _hf_name(path: str, name: str, arch: str) -> str:
    if name in MODEL_TENSORS:
        return MODEL_TENSORS[name]
    if arch == "gemma4" and name in GEMMA4_MODEL_TENSORS:
        return GEMMA4_MODEL_TENSORS[name]
    names = {"phi3": PHI3_TENSORS, "gpt-oss": GPT_OSS_TENSORS, "lfm2": LFM2_TENSORS}.get(arch, LAYER_TENSORS)
    names = QWEN35_TENSORS if arch in QWEN35 else names
    names = GEMMA_TENSORS if arch.startswith("gemma") else names
    names = GEMMA4_TENSORS if arch == "gemma4" else names
    if arch == "gemma4" and (m := re.fullmatch(r"blk\.(\d+)\.(.+)", name)) and m[2] in GEMMA4_PARAMETERS:
        return f"model.layers.{m[1]}.{GEMMA4_PARAMETERS[m[2]]}"
    if arch in QWEN35 and (m := re.fullmatch(r"blk\.(\d+)\.(ssm_a|ssm_dt\.bias)", name)):
        return f"model.layers.{m[1]}.{QWEN35_PARAMETERS[m[2]]}"
    m = re.fullmatch(r"blk\.(\d+)\.([\w.]+)\.(weight|bias)", name)
    if m is None or m[2] not in names:
        raise ValueError(f"{path}: tensor {name} is not one this server knows how to load")
    return f"model.layers.{m[1]}.{names[m[2]]}.{m[3]}"


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (`LlamaModel.permute`: each head's rotary
    halves interleaved) for a [rows, ...] projection of `heads` heads: the Hugging Face rotate-half order."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def iter_gguf_weights(path: str, quantized: bool) -> Iterator[tuple[str, torch.Tensor | GGUFTensor]]:
    """(Hugging Face parameter name, tensor) for every tensor of the file, in file order.

    Float tensors come as float32 [out, in] (torch order), except that with `quantized` a matrix keeps its
    F16/BF16 (as a checkpoint's bfloat16 tensors do; GGUFLinearMethod serves it 16-bit). Quantized ones come as
    `GGUFTensor`s of their raw blocks when `quantized`, else dequantized to float32 (gguf-py's
    dequantize). Data is copied out of the memory map, so nothing keeps the file mapped. q/k rows are
    put back in the Hugging Face order where the converter permuted them (PERMUTED), and Gemma's norms back
    to w where it stored 1 + w. Raises ValueError naming the file and tensor for a type or name that cannot be
    loaded.
    """
    from gguf.quants import dequantize
    from transformers.integrations.gguf.reader import load_gguf_state_dict

    header, md = read_header(path)
    heads = {"attn_q": _key(path, md, "attention.head_count")}
    heads["attn_k"] = _max(_key(path, md, "attention.head_count_kv", heads["attn_q"]))
    arch = md["general.architecture"]
    permute, shifted = arch in PERMUTED, arch in NORM_SHIFTED
    raw = load_gguf_state_dict(header)
    mtp = tuple(f"blk.{i}." for i in range(_layer_count(path, md), _key(path, md, "block_count")))
    for info in header.tensors:
        if info.name == ROPE_FREQS or info.name in ROPE_FACTORS.values():  # read into the config, not weights
            continue
        if info.name.startswith(mtp):  # the multi-token-prediction blocks: passed over
            continue
        name = _hf_name(path, info.name, arch)
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            qtype = None
        if qtype not in QUANTIZED_TYPES + FLOAT_TYPES:
            kinds = ", ".join(t.name for t in QUANTIZED_TYPES + FLOAT_TYPES)
            raise ValueError(
                f"{path}: tensor {info.name} has ggml type "
                f"{qtype.name if qtype else info.ggml_type}, not supported (supported: {kinds})"
            )
        data = raw[info.name].data  # uint8 view of the mapped file
        rows = int(np.prod(info.shape[:-1]))  # an MoE layer's stacked experts [E, rows, cols]: E * rows
        if qtype in FLOAT_TYPES:
            w = (
                torch.from_numpy(np.array(data))
                .view(
                    {
                        GGMLQuantizationType.F32: torch.float32,
                        GGMLQuantizationType.F16: torch.float16,
                        GGMLQuantizationType.BF16: torch.bfloat16,
                    }[qtype]
                )
                .reshape(info.shape)
            )
            if not quantized or qtype == GGMLQuantizationType.F32 or len(info.shape) < 2:
                w = w.float()
        elif quantized:
            w = GGUFTensor(qtype, torch.from_numpy(np.array(data).reshape(rows, -1)), info.shape[-1])
        else:
            w = torch.from_numpy(dequantize(np.asarray(data).reshape(rows, -1), qtype)).reshape(info.shape)
        kind = info.name.split(".")[-2] if info.name.startswith("blk.") else ""
        if kind in ("ffn_gate_inp", "ffn_gate_inp_shexp") and isinstance(w, GGUFTensor):  # routers stay float
            w = w.dequantize_rows(torch.arange(w.rows), torch.float32)
        if kind == "ffn_gate_inp_shexp":  # llama.cpp stores the shared expert's gate as a vector
            w = w.reshape(1, -1)
        if permute and kind in heads:
            order = _unpermute(rows, heads[kind])
            w = w.select_rows(order) if isinstance(w, GGUFTensor) else w[order]
        if shifted and name.endswith("norm.weight") and ".linear_attn." not in name:  # the converter's 1 + w back
            w = w - 1
        if name.endswith(".A_log"):  # the converter's A = -exp(A_log) back to A_log
            w = torch.log(-w)
        yield name, w
