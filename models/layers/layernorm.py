"""RMSNorm (Zhang & Sennrich 2019) over the float32 residual stream, and per-head RMSNorm (Qwen3's q/k norms)."""

import torch
from torch import nn

from models.kernels import ops


class RMSNorm(nn.Module):
    """RMSNorm that first adds a sublayer's output to the float32 residual stream (in place)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        return ops.add_rms_norm(residual, delta, self.weight, self.eps)


class HeadRMSNorm(nn.Module):
    """Qwen3's RMSNorm over each head's features (q_norm, k_norm): x [T, heads, head_dim] -> the same
    shape and dtype, normalised in float32 as transformers does; one kernel call (ops.add_rms_norm over the
    [T * heads, head_dim] rows) where x and the weight share a dtype, in place of ~8 torch ops."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return ops.add_rms_norm(x.reshape(-1, x.shape[-1]).float(), None, self.weight, self.eps).view(x.shape)
        return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
