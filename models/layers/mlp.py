"""The gated feed-forward of the Llama family: SwiGLU (Shazeer 2020), gate and up projections fused into one
column-parallel matmul, down row-parallel (the dense MLP of llama.py's layers, and Qwen2-MoE's shared expert)."""

import torch
from torch import nn

from models.distributed.group import TPGroup
from models.kernels import ops
from models.layers.linear import ColumnParallelLinear, RowParallelLinear
from models.quantization.gguf import GGUFConfig


class SwiGLUMLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)): x [T, hidden] -> [T, hidden] in x's dtype (summed over ranks under tensor
    parallelism, each rank holding its slice of `intermediate_size`). Parameters `gate_up_proj` and `down_proj`,
    the checkpoint's gate_proj/up_proj stacked by the loader (models/layers/checkpoint.py)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, tp: TPGroup | None, quant_config: GGUFConfig | None = None
    ):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.merged(hidden_size, [intermediate_size] * 2, False, tp, quant_config)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, quant_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
