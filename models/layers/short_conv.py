"""LFM2's gated short convolution (Liquid AI 2025, "LFM2"; after Hyena, Poli et al. 2023): a recurrent layer whose
whole memory of the past is its last L - 1 inputs, kept per request in a state slot beside the paged KV cache
(engine.core.kv_cache_spec.MambaSpec).

    B, C, x = in_proj(h)            three [T, hidden] chunks
    u = B * x
    y_t = sum_j w_j u_{t - L + 1 + j}   depthwise causal convolution over each sequence (kernel L, the
                                        positions before the sequence's first token read its state)
    out = out_proj(C * y)

A sequence's state is u at its last L - 1 positions, zeros before its first token; a step reads it (prefill
chunks after the first, decodes) and leaves it updated, so chunked prefill and decode carry it forward.
"""

from dataclasses import dataclass

import torch
from torch import nn

from models.distributed.group import TPGroup
from models.layers.linear import ColumnParallelLinear, RowParallelLinear, _rank_size
from models.quantization.gguf import GGUFConfig


@dataclass
class StateMetadata:
    """Where each sequence of one step keeps the state of the recurrent layers (what the model runner hands them
    instead of AttentionMetadata).

    query_start_loc_cpu: the offsets of each sequence's tokens in the flat batch ([B + 1]; decodes first, as in
    AttentionMetadata); num_decodes: the leading sequences with one token; state_indices: int64 [B], each
    sequence's state slot; has_initial_state: [B] whether it has computed tokens before this step (else its
    state starts at zeros).
    """

    query_start_loc_cpu: list[int]
    num_decodes: int
    state_indices: torch.Tensor
    has_initial_state: list[bool]

    def after_decodes(self) -> "StateMetadata":
        """The same step's sequences past its decodes (their tokens from query_start_loc_cpu[num_decodes] on)."""
        n, qsl = self.num_decodes, self.query_start_loc_cpu
        return StateMetadata([q - qsl[n] for q in qsl[n:]], 0, self.state_indices[n:], self.has_initial_state[n:])


class CausalConv1d(nn.Module):
    """The depthwise convolution's weight [channels of this rank, 1, L] (a checkpoint's Conv1d layout). With
    `parts`, the channels are groups stacked in the checkpoint (the Gated DeltaNet's q | k | v), each split over
    the ranks."""

    def __init__(self, channels: int, kernel: int, tp: TPGroup | None, parts: list[int] | None = None):
        super().__init__()
        self.rank, self.size = _rank_size(tp)
        self.parts = parts or [channels]
        self.weight = nn.Parameter(torch.empty(channels // self.size, 1, kernel).uniform_(-1, 1) / kernel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        loaded, rows, start = loaded.reshape(-1, 1, param.shape[-1]), [], 0
        for n in self.parts:
            rows.append(loaded.narrow(0, start + self.rank * (n // self.size), n // self.size))
            start += n
        param.data.copy_(torch.cat(rows))


class ShortConv(nn.Module):
    """LFM2's conv layer: x [T, hidden] -> [T, hidden] in x's dtype. Under tensor parallelism each rank holds a
    slice of the channels (in_proj's three chunks column-parallel, out_proj row-parallel). Its state, per slot:
    float32 [L - 1, hidden / ranks] (the model's `state_shape`, which the model runner allocates)."""

    def __init__(
        self, hidden_size: int, kernel: int, bias: bool, tp: TPGroup | None, quant_config: GGUFConfig | None = None
    ):
        super().__init__()
        if bias:
            raise ValueError("conv_bias true is not supported (LFM2's convolutions have none)")
        self.in_proj = ColumnParallelLinear.merged(hidden_size, [hidden_size] * 3, False, tp, quant_config)
        self.conv = CausalConv1d(hidden_size, kernel, tp)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, tp, quant_config)

    def forward(self, x: torch.Tensor, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """x: the step's normed hidden states [T, hidden]; state: this layer's float32 [slots, L - 1, channels],
        read and updated at `meta.state_indices`."""
        b, c, u = self.in_proj(x).float().chunk(3, dim=-1)
        y = causal_conv1d(b * u, self.conv.weight.float()[:, 0].T, state, meta)
        return self.out_proj((c * y).to(x.dtype))


def causal_conv1d(u: torch.Tensor, w: torch.Tensor, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
    """The depthwise causal convolution of each sequence of a step: u float32 [T, C], w float32 [L, C] (tap j
    weighs the input L - 1 - j positions back) -> y float32 [T, C]. `state` float32 [slots, L - 1, C] holds each
    sequence's last L - 1 inputs (read where `meta.has_initial_state`, else zeros; left updated at
    `meta.state_indices`). LFM2's short convolution and the Gated DeltaNet's convolution over q, k, v."""
    kernel = w.shape[0]
    y = torch.empty_like(u)
    qsl, nd = meta.query_start_loc_cpu, meta.num_decodes
    if nd:  # decodes, batched: [nd, L, C] = the state then the new input
        slots = meta.state_indices[:nd]
        window = torch.cat((state[slots], u[:nd, None]), dim=1)
        window[~torch.tensor(meta.has_initial_state[:nd]), :-1] = 0
        y[:nd] = (window * w).sum(1)
        state[slots] = window[:, 1:]
    for i in range(nd, len(qsl) - 1):
        start, end, slot = qsl[i], qsl[i + 1], meta.state_indices[i]
        past = state[slot] if meta.has_initial_state[i] else u.new_zeros(kernel - 1, u.shape[1])
        seq = torch.cat((past, u[start:end]))  # [L - 1 + n, C]
        n = end - start
        y[start:end] = sum(w[j] * seq[j : j + n] for j in range(kernel))
        state[slot] = seq[-(kernel - 1) :]
    return y
