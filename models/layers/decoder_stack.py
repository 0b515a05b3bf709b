"""The loop every pre-norm decoder here runs over its pipeline stage's layers, shared by the hybrid models (LFM2,
Qwen3.5) whose layers differ in kind but not in how they join the residual stream."""

import torch
from torch import nn


def run_layers(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list,
    attn_metadata: list,
    residual: torch.Tensor | None,
    final_norm: nn.Module,
) -> torch.Tensor:
    """Hidden states [T, hidden] of one step's tokens (input_ids, positions: int64 [T]) through `model`'s layers of
    its stage (`model.pp`, `model.layers`, `model.embed_tokens`, `model.rotary`). Each layer is called as
    layer(residual, x, rope, cache, meta) with its entries of kv_caches and attn_metadata (an attention layer's KV
    cache and AttentionMetadata, a recurrent layer's state tensor and StateMetadata) and returns its output, not yet
    added to the float32 residual stream. On a stage but the first, `residual` (float32 [T, hidden]) is the previous
    stage's stream; a stage but the last returns its stream rather than `final_norm`'s output."""
    if model.pp.is_first:
        residual = model.embed_tokens(input_ids).float()
    x, rope = None, model.rotary(positions)
    layers = model.layers[model.pp.start_layer : model.pp.end_layer]
    for layer, cache, meta in zip(layers, kv_caches, attn_metadata):
        x = layer(residual, x, rope, cache, meta)
    return final_norm(residual, x) if model.pp.is_last else residual.add_(x)
