"""Copying a Hugging Face checkpoint's tensors into a model built of these layers: the checkpoint's q/k/v and
gate/up projections stacked into one parameter each (or split, where the checkpoint holds them fused, as
Phi-3's does), and each parallel layer's `weight_loader` keeping this rank's part."""

from typing import Iterable

import torch
from torch import nn

from models.distributed.pipeline import PPMissingLayer
from models.layers.fused_moe import SparseMoeBlock, expert_shard
from models.layers.layernorm import RMSNorm
from models.quantization.gguf import GGUFTensor

# checkpoint name -> (our parameter, shard index) for the stacked projections
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    # Qwen3.5: the attention's output gate (the second half of each head of its q_proj), the DeltaNet's projections
    "q_gate_proj": ("qkv_proj", 3),
    "in_proj_z": ("in_proj_qkvz", 3),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}
# checkpoint tensors that hold them stacked already (Phi-3), LFM2's conv in_proj (B | C | x), Qwen3.5's DeltaNet
# in_proj_qkv (q | k | v, our in_proj_qkvz's first three parts)
FUSED = ("qkv_proj", "gate_up_proj", "in_proj", "in_proj_qkvz")


def split_fused(config, name: str, tensor) -> list:
    """(shard index, rows) of a fused checkpoint tensor (the full model's q | k | v, gate | up, B | C | x),
    for the layer's weight loader. Raises ValueError when its rows are not the config's sizes."""
    kind = name.split(".")[-2]
    if kind == "qkv_proj":
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        sizes = [config.num_attention_heads * d] + [config.num_key_value_heads * d] * 2
    elif kind == "in_proj":
        sizes = [config.hidden_size] * 3
    elif kind == "in_proj_qkvz":
        key = config.linear_num_key_heads * config.linear_key_head_dim
        sizes = [key, key, config.linear_num_value_heads * config.linear_value_head_dim]
    else:
        sizes = [config.intermediate_size] * 2
    if (tensor.rows if isinstance(tensor, GGUFTensor) else tensor.shape[0]) != sum(sizes):
        raise ValueError(f"{name}: {sum(sizes)} fused rows expected")
    out, start = [], 0
    for shard, size in enumerate(sizes):
        part = tensor.row_range(start, size) if isinstance(tensor, GGUFTensor) else tensor.narrow(0, start, size)
        out.append((shard, part))
        start += size
    return out


def load_checkpoint(
    model: nn.Module, config, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, skip: str | None = None
) -> None:
    """Copies every (Hugging Face name, tensor) of `weights` into `model`'s parameters (the "model." prefix
    dropped; `skip`: a name to pass over, such as a tied LM head; tensors of modules another pipeline stage
    holds are passed over too), then lets quantized layers stack their
    projections (floats among them in `dtype`). Raises KeyError for a name the model does not have and
    ValueError when a parameter stays unset."""
    params = dict(model.named_parameters())
    # a pipeline stage holds only its own layers: the others' tensors are passed over
    elsewhere = tuple(f"{n}." for n, m in model.named_modules() if isinstance(m, PPMissingLayer))
    loaded = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or name == skip:
            continue
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name of its MoE
        if name.startswith(elsewhere):
            continue
        parts = name.split(".")
        shards = [(0, tensor)]
        if (expert := expert_shard(name)) is not None:  # an MoE layer's expert weights (models/layers/fused_moe.py)
            name, shards = expert[0], [(expert[1], tensor)]
        elif len(parts) >= 2 and parts[-2] in STACKED:
            fused, shard = STACKED[parts[-2]]
            name, shards = ".".join(parts[:-2] + [fused, parts[-1]]), [(shard, tensor)]
        elif len(parts) >= 2 and parts[-2] in FUSED:
            shards = split_fused(config, name, tensor)
        param = params[name]
        loader = getattr(model.get_submodule(name.rpartition(".")[0]), "weight_loader", None)
        for shard, part in shards:
            if loader is not None:
                loader(param, part, shard)
            else:
                param.data.copy_(part)
        loaded.add(name)
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
    for module in model.modules():  # quantized layers stack their projections once all are in
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(dtype)


def keep_norms_float32(model: nn.Module) -> None:
    """Makes the residual-stream norms of a quantized model float32 (before loading).

    The quantized linears quantize their inputs themselves (int16 per 32 values), so rounding the activations
    between them to bfloat16 first only loses precision: in a quantized model the norms keep the file's
    float32 weights and emit float32, the MLP and the projections' outputs stay float32, and only attention
    (q, k, v and the KV cache) runs in the model dtype. It costs nothing measurable (the weights' bytes
    dominate) and lifts greedy agreement with float32 activations on W64's first 16 tokens from 84% to 91%.
    llama.cpp keeps float32 activations too. A mixture-of-experts router (SparseMoeBlock's `gate`, F32 in GGUF
    files) stays float32 as well, so routing decisions are made on the file's weights and the one-call layer
    (models/layers/fused_layer.py) routes as the op-by-op block does."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.data = module.weight.data.float()
        elif isinstance(module, SparseMoeBlock):
            module.gate.float()
