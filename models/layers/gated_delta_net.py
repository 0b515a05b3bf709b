"""The Gated DeltaNet layer (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta
Rule"), Qwen3.5's linear attention: a recurrent layer whose memory of the past is, per value head, a matrix
S [d_k, d_v] kept per request in a state slot beside the paged KV cache (engine.core.kv_cache_spec.MambaSpec), with
the last L - 1 inputs of its short convolution over q, k and v.

    q, k, v = silu(causal_conv1d(in_proj_qkv(h)))     per head; q and k L2-normed, q scaled by d_k^-1/2
    beta_t = sigmoid(b_t)                             how much of the new value is written
    g_t = -exp(A_log) softplus(a_t + dt_bias)         the decay (log space, <= 0)
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T      the gated delta rule
    o_t = S_t^T q_t
    out = out_proj(rmsnorm(o) * w * silu(z))          z = in_proj_z(h), per value head

Decodes take the recurrence a token at a time, batched (the C kernel csrc/recurrent.c, the convolution and the
gated norm with it; this file's torch path is its reference and fallback); a prefill is computed in chunks of 64
tokens (the chunkwise form of the paper's section 3, as flash-linear-attention computes it): within a chunk the
delta rule's updates are one triangular solve (the UT transform, WY representation), across chunks the state is carried.
Key heads may be fewer than value heads: each serves num_v_heads / num_k_heads of them, consecutive ones in a
Hugging Face checkpoint, every num_k_heads-th one in llama.cpp's files (`tiled_heads`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from models.distributed.group import TPGroup
from models.kernels import ops
from models.layers.layernorm import HeadRMSNorm
from models.layers.linear import ColumnParallelLinear, RowParallelLinear, _rank_size
from models.layers.short_conv import CausalConv1d, StateMetadata, causal_conv1d
from models.quantization.gguf import GGUFConfig

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (flash-linear-attention's L2 norm of q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """One token of each of B sequences: q, k float32 [B, H, d_k] (normed, q scaled); v [B, H, d_v]; g, beta
    [B, H]; state [B, H, d_k, d_v]. Returns (o [B, H, d_v], the new state)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """One sequence of n tokens: q, k float32 [H, n, d_k] (normed, q scaled); v [H, n, d_v]; g, beta [H, n];
    state [H, d_k, d_v] before its first token. Returns (o [H, n, d_v], the state after its last token).

    Per chunk of C tokens, with G the cumulative decay inside it and D_ij = exp(G_i - G_j) for j <= i:
    the chunk's corrected values U = T (beta V) and decayed keys W = T (beta K exp(G)), T = (I + strictly
    lower((beta K K^T) * D))^-1, so that with the state S entering the chunk
    V' = U - W S,  O = (Q exp(G)) S + ((Q K^T) * D) V',  S <- exp(G_C) S + (K exp(G_C - G))^T V'."""
    heads, n, dk = k.shape
    pad = -n % chunk
    if pad:  # zero keys, values and decays (exp(0) = 1) past the end leave the state as it was
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.reshape(heads, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, -1, chunk).cumsum(-1), beta.reshape(heads, -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, N, C, C]
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # the solves read its strictly lower triangle, ones on the diagonal
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * g.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(q.shape[1]):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q[:, i] @ state + attn[:, i] @ v_new
        state = state * g[:, i, -1].exp()[:, None, None] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, v.shape[-1])[:, :n], state


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer: x [T, hidden] -> [T, hidden] in x's dtype. Under tensor parallelism each
    rank holds a slice of the key and value heads (the projections column-parallel, out_proj row-parallel).

    Its state per slot is float32 [state_size] (the model's `state_shape`, which the model runner allocates): the
    convolution's last L - 1 inputs [L - 1, conv channels of this rank] then the delta rule's matrices
    [value heads of this rank, d_k, d_v]. `tiled_heads`: value head j reads key head j mod num_k_heads (llama.cpp's
    order of a GGUF file's value heads) rather than j // (num_v_heads / num_k_heads). Raises ValueError when the
    heads do not split over the ranks or the key heads do not divide the value heads."""

    def __init__(self, config, tp: TPGroup | None, quant_config: GGUFConfig | None = None, tiled_heads=False):
        super().__init__()
        size = _rank_size(tp)[1]
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        if nv % nk or nk % size or nv % size:
            raise ValueError(
                f"linear_num_value_heads {nv} must be a multiple of linear_num_key_heads {nk}, and both of the "
                f"tensor-parallel ranks ({size})"
            )
        self.tiled_heads = tiled_heads
        if tiled_heads and size > 1:
            raise ValueError("a GGUF file's Gated DeltaNet heads are not split over tensor-parallel ranks")
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.nk, self.nv = nk // size, nv // size
        self.kernel = config.linear_conv_kernel_dim
        key, value = nk * self.dk, nv * self.dv
        self.in_proj_qkvz = ColumnParallelLinear.merged(
            config.hidden_size, [key, key, value, value], False, tp, quant_config
        )
        self.in_proj_ba = ColumnParallelLinear.merged(config.hidden_size, [nv, nv], False, tp, quant_config)
        self.conv1d = CausalConv1d(2 * key + value, self.kernel, tp, parts=[key, key, value])
        self.conv_dim = self.conv1d.weight.shape[0]
        self.A_log = nn.Parameter(torch.zeros(self.nv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv), requires_grad=False)
        self.norm = HeadRMSNorm(self.dv, config.rms_norm_eps)  # over each value head, then gated by silu(z)
        self.out_proj = RowParallelLinear(value, config.hidden_size, tp, quant_config)
        self.head_start = _rank_size(tp)[0] * self.nv

    @property
    def state_size(self) -> int:
        """float32 elements of one slot's state: the convolution's, then the delta rule's."""
        return (self.kernel - 1) * self.conv_dim + self.nv * self.dk * self.dv

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """This rank's heads of A_log or dt_bias (float32 [linear_num_value_heads])."""
        param.data.copy_(loaded.reshape(-1)[self.head_start : self.head_start + self.nv])

    def forward(self, x: torch.Tensor, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """x: the step's normed hidden states [T, hidden]; state: this layer's float32 [slots, state_size], read and
        updated at `meta.state_indices` (zeros where a sequence has no computed token yet). The decodes take the C
        kernel where it runs (ops.gated_delta_net_decode_), the rest this file's torch path."""
        qkv, z = self.in_proj_qkvz(x, out_dtype=torch.float32).split([self.conv_dim, self.nv * self.dv], dim=-1)
        b, a = self.in_proj_ba(x, out_dtype=torch.float32).chunk(2, dim=-1)
        o, nd = None, meta.num_decodes
        if nd:
            slots = meta.state_indices[:nd]
            if not all(meta.has_initial_state[:nd]):
                state[slots[~torch.tensor(meta.has_initial_state[:nd])]] = 0
            weights = (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps)
            heads = (self.nk, self.dk, self.tiled_heads)
            o = ops.gated_delta_net_decode_(state, slots, qkv[:nd], z[:nd], a[:nd], b[:nd], *weights, *heads)
        done = 0 if o is None else nd
        if done < x.shape[0]:
            rest = meta.after_decodes() if done else meta
            tail = self.torch_forward(qkv[done:], z[done:], a[done:], b[done:], state, rest)
            o = tail if o is None else torch.cat([o, tail])
        return self.out_proj(o.to(x.dtype))

    def torch_forward(self, qkv, z, a, b, state, meta: StateMetadata) -> torch.Tensor:
        """The layer between its projections in torch ops: qkv [T, C], z [T, nv * dv], a and b [T, nv] (float32) ->
        the gated norm's output [T, nv * dv], the states at `meta.state_indices` updated."""
        t, conv_elems = qkv.shape[0], (self.kernel - 1) * self.conv_dim
        conv_state = state[:, :conv_elems].view(-1, self.kernel - 1, self.conv_dim)
        ssm_state = state[:, conv_elems:].view(-1, self.nv, self.dk, self.dv)
        qkv = F.silu(causal_conv1d(qkv, self.conv1d.weight.float()[:, 0].T, conv_state, meta))
        q, k, v = qkv.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        q = l2norm(q.view(t, self.nk, self.dk)) * self.dk**-0.5
        k = l2norm(k.view(t, self.nk, self.dk))
        if self.nv != self.nk:  # each key head serves nv / nk value heads
            r = self.nv // self.nk
            q, k = (x.repeat(1, r, 1) if self.tiled_heads else x.repeat_interleave(r, dim=1) for x in (q, k))
        v = v.view(t, self.nv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        o = torch.empty_like(v)
        qsl, nd = meta.query_start_loc_cpu, meta.num_decodes
        if nd:  # one token each, batched
            slots = meta.state_indices[:nd]
            s = ssm_state[slots]
            s[~torch.tensor(meta.has_initial_state[:nd])] = 0
            o[:nd], ssm_state[slots] = recurrent_gated_delta_rule(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], s)
        for i in range(nd, len(qsl) - 1):
            start, end, slot = qsl[i], qsl[i + 1], meta.state_indices[i]
            s = ssm_state[slot] if meta.has_initial_state[i] else v.new_zeros(self.nv, self.dk, self.dv)
            seq = [x[start:end].transpose(0, 1) for x in (q, k, v, g, beta)]
            out, ssm_state[slot] = chunk_gated_delta_rule(*seq, s)
            o[start:end] = out.transpose(0, 1)
        return (self.norm(o) * F.silu(z.view(t, self.nv, self.dv))).view(t, -1)
