"""Self-attention over the paged KV cache, the layer every decoder architecture here shares."""

import torch
from torch import nn

from models.attention.base import AttentionBackend, AttentionMetadata
from models.config import ModelShape
from models.distributed.group import TPGroup
from models.kernels import ops
from models.layers.layernorm import HeadRMSNorm
from models.layers.linear import ColumnParallelLinear, RowParallelLinear
from models.quantization.gguf import GGUFConfig


class SelfAttention(nn.Module):
    """A decoder's self-attention: fused q/k/v projection (column-parallel), optional per-head q/k RMSNorm
    (Qwen3, Gemma 3), rotary positions (unless `use_rope` is False: SmolLM3's NoPE layers), the paged
    attention backend (which holds the layer's scale, sliding window and soft cap), o_proj (row-parallel)."""

    def __init__(
        self,
        shape: ModelShape,
        backend: AttentionBackend,
        bias: bool,
        tp: TPGroup | None,
        qk_norm_eps: float | None = None,
        quant_config: GGUFConfig | None = None,
        use_rope: bool = True,
    ):
        super().__init__()
        self.use_rope = use_rope  # SmolLM3 leaves every fourth layer without positions (NoPE)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        # q, k and v projections fused into one matmul; the loader stacks the checkpoint's three.
        self.qkv_proj = ColumnParallelLinear.qkv(shape, bias, tp, quant_config)
        self.o_proj = RowParallelLinear(shape.total_num_heads * self.head_dim, shape.hidden_size, tp, quant_config)
        self.backend = backend
        # Qwen3 normalises each query and key head before the rotation
        self.q_norm = HeadRMSNorm(self.head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = HeadRMSNorm(self.head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Grouped-query self-attention (Ainslie et al. 2023) with rotary positions (Su et al. 2021).

        x: this step's normed hidden states [T, hidden] in the model dtype (float32 in a quantized model);
        q, k and v are in the KV cache's dtype, the output in x's; rope: float32 (cos, sin)
        [T, head_dim // 2] of each token's position; kv_cache: this layer's (k_cache, v_cache) in the
        backend's layout; meta: the step's attention metadata. The new tokens' K/V are written to the
        cache at `meta.slot_mapping` by the backend, which then attends causally over each sequence's
        cached prefix and its new tokens. Returns [T, hidden] (summed over ranks by o_proj under
        tensor parallelism).
        """
        # q, k, v in the attention dtype (the model's; a quantized cache's storage is not one to compute in)
        dtype = self.backend.dtype or kv_cache[0].dtype
        qkv = self.qkv_proj(x, out_dtype=dtype).view(x.shape[0], -1, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)  # views of qkv
        if self.q_norm is not None:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.use_rope:
            ops.rotary_(qkv[:, : self.num_heads + self.num_kv_heads], *rope)  # q and k in place, in one go
        o = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(o.view(-1, self.q_size), out_dtype=x.dtype)
