"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019; the layout of vLLM's parallel layers).

A column-parallel linear layer splits its output features across the N ranks and needs no
communication; the row-parallel layer after it splits its input features the same way and sums the
partial outputs with one all-reduce. Attention heads are split N ways (qkv column-parallel, o_proj
row-parallel), as is the MLP's intermediate dimension (gate_up column-, down row-parallel). (The
embedding table and the LM head, split by vocabulary rows, are vocab_parallel_embedding.py.)

With `tp` None (one rank) every layer is the plain layer it replaces, at the same cost, and starts
from the same random initialisation (scripts/gpu_check.py runs a model that loads no weights). Each
layer has a `weight_loader(param, loaded, shard_id)` that copies this rank's part of a full checkpoint
tensor into its parameter.

Built with a quantization config (models/quantization, one rank only) a layer's weights are the
method's instead: `quant_method` holds and computes with them, and `weight` is an empty placeholder
that keeps the checkpoint's parameter names.
"""

import math

import torch
from torch import nn

from models.distributed.group import TPGroup
from models.kernels import ops
from models.quantization.gguf import GGUFConfig


def _rank_size(tp: TPGroup | None) -> tuple[int, int]:
    return (tp.rank, tp.world_size) if tp is not None else (0, 1)


def _placeholder() -> nn.Parameter:
    """The `weight` of a quantized layer: its name is the checkpoint's, its data the quant method's."""
    return nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)


def _linear_parameters(out_features: int, in_features: int, bias: bool, fan_in: int):
    """weight [out_features, in_features] (and bias [out_features]) drawn as nn.Linear draws them for a
    layer of `fan_in` inputs: uniform in +-1 / sqrt(fan_in)."""
    bound = 1 / math.sqrt(fan_in)
    weight = nn.Parameter(torch.empty(out_features, in_features).uniform_(-bound, bound))
    return weight, nn.Parameter(torch.empty(out_features).uniform_(-bound, bound)) if bias else None


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b for this rank's slice of the output features; one or more projections stacked.

    x: [T, input_size] -> y: [T, sum(output_sizes)]. `output_sizes` are the per-rank sizes of the
    stacked projections (gate | up, or q | k | v) and `shard_index[i]` is which slice of projection i
    this rank holds (its rank, or for replicated KV heads the rank's head group).
    weight: [sum(output_sizes), input_size].
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        shard_index: list[int],
        quant_config: GGUFConfig | None = None,
    ):
        super().__init__()
        self.output_sizes, self.shard_index = output_sizes, shard_index
        self.quant_method = quant_config.linear_method(output_sizes, input_size) if quant_config else None
        self.weight, self.bias = _linear_parameters(sum(output_sizes), input_size, bias, input_size)
        if self.quant_method is not None:
            self.weight = _placeholder()

    @classmethod
    def merged(
        cls,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup | None,
        quant_config: GGUFConfig | None = None,
    ):
        """Stacked projections of full sizes `output_sizes` (each divisible by the ranks), each split evenly."""
        rank, size = _rank_size(tp)
        return cls(input_size, [n // size for n in output_sizes], bias, [rank] * len(output_sizes), quant_config)

    @classmethod
    def qkv(
        cls,
        shape,
        bias: bool,
        tp: TPGroup | None,
        quant_config: GGUFConfig | None = None,
        gate: bool = False,
        kv_parts: int = 2,
    ):
        """q | k | v of one rank (`shape`: models.config.ModelShape): its query heads and its (possibly
        replicated) KV head group; with `gate`, then a gate per query feature (Qwen3.5's attention output gate).
        `kv_parts`: the K/V projections after q: 2 (k, v), 1 (k alone, Gemma 4's layers whose values are their
        keys) or 0 (q alone, a layer that reads another's K/V)."""
        rank, size = _rank_size(tp)
        kv_group = rank // max(1, size // shape.total_num_kv_heads)  # ranks sharing a replicated KV head
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        sizes, index = [q] + [kv] * kv_parts + [q] * gate, [rank] + [kv_group] * kv_parts + [rank] * gate
        return cls(shape.hidden_size, sizes, bias, index, quant_config)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y in `out_dtype` (default x's): a quantized layer writes it directly (a GGUF model's float32
        activations into bfloat16 q, k, v), a float one converts."""
        if self.quant_method is None:
            y = ops.linear(x, self.weight, self.bias)
            return y if out_dtype is None else y.to(out_dtype)
        y = self.quant_method.apply(x, out_dtype)
        return y if self.bias is None else y.add_(self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        """Copies this rank's rows of checkpoint projection `shard_id` (e.g. k_proj = 1) into `param`."""
        if self.quant_method is not None and param is self.weight:
            return self.quant_method.load(shard_id, loaded)
        size = self.output_sizes[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        param.data[offset : offset + size].copy_(loaded.narrow(0, self.shard_index[shard_id] * size, size))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T: this rank's slice of the input features, one all-reduce.

    x: [T, input_size / N] (a column-parallel layer's output) -> y: [T, output_size], the same on every
    rank. weight: [output_size, input_size / N]; bias [output_size] (gpt-oss's o_proj), added once, after the sum.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TPGroup | None,
        quant_config: GGUFConfig | None = None,
        bias: bool = False,
    ):
        super().__init__()
        self.tp = tp
        rank, size = _rank_size(tp)
        self.weight, self.bias = _linear_parameters(output_size, input_size // size, bias, input_size)
        self.start = rank * (input_size // size)
        self.quant_method = quant_config.linear_method([output_size], input_size) if quant_config else None
        if self.quant_method is not None:
            self.weight = _placeholder()

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y in `out_dtype` (default x's), as ColumnParallelLinear.forward."""
        if self.quant_method is None:
            y = ops.linear(x, self.weight)
            y = y if out_dtype is None else y.to(out_dtype)
        else:
            y = self.quant_method.apply(x, out_dtype)
        y = y if self.tp is None else self.tp.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if param is self.bias:
            return param.data.copy_(loaded)
        if self.quant_method is not None:
            return self.quant_method.load(0, loaded)
        param.data.copy_(loaded.narrow(1, self.start, param.shape[1]))
