"""Self-attention over the paged KV cache, the layer every decoder architecture here shares."""

import torch
from torch import nn

from models.attention.base import AttentionBackend, AttentionMetadata
from models.config import ModelShape
from models.distributed.group import TPGroup
from models.kernels import ops
from models.layers.layernorm import HeadRMSNorm
from models.layers.linear import ColumnParallelLinear, RowParallelLinear, _rank_size
from models.quantization.gguf import GGUFConfig


class SelfAttention(nn.Module):
    """A decoder's self-attention: fused q/k/v projection (column-parallel), optional per-head q/k RMSNorm
    (Qwen3, Gemma 3), rotary positions (unless `use_rope` is False: SmolLM3's NoPE layers), the paged
    attention backend (which holds the layer's scale, sliding window and soft cap), o_proj (row-parallel; with a
    bias where `o_bias`: gpt-oss). `rotary_dim`: the leading features of each head that rotate (all by default;
    partial rotary, Qwen3.5); `output_gate`: the output multiplied by sigmoid of a gate that q_proj also projects
    (Qwen3.5; qkv_proj's fourth part). With `sinks` the layer learns a logit per query head (`self.sinks`, float32
    [num_heads] of this rank) that joins each softmax (gpt-oss's attention sinks); raises ValueError when the
    backend does not take them."""

    def __init__(
        self,
        shape: ModelShape,
        backend: AttentionBackend,
        bias: bool,
        tp: TPGroup | None,
        qk_norm_eps: float | None = None,
        quant_config: GGUFConfig | None = None,
        use_rope: bool = True,
        o_bias: bool = False,
        sinks: bool = False,
        rotary_dim: int | None = None,
        output_gate: bool = False,
    ):
        super().__init__()
        self.use_rope = use_rope  # SmolLM3 leaves every fourth layer without positions (NoPE)
        self.rotary_dim = rotary_dim or shape.head_dim  # Qwen3.5 rotates the first quarter of each head
        self.output_gate = output_gate
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        # q, k and v projections fused into one matmul; the loader stacks the checkpoint's three.
        self.qkv_proj = ColumnParallelLinear.qkv(shape, bias, tp, quant_config, gate=output_gate)
        self.o_proj = RowParallelLinear(
            shape.total_num_heads * self.head_dim, shape.hidden_size, tp, quant_config, bias=o_bias
        )
        self.backend = backend
        if sinks and not backend.supports_sinks:
            raise ValueError(
                f"attention sinks (gpt-oss) are not built for the {type(backend).__name__}; "
                "use attention_backend cpu or torch_native"
            )
        self.head_start = _rank_size(tp)[0] * self.num_heads  # this rank's first query head
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if sinks else None
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
        heads = [self.num_heads, self.num_kv_heads, self.num_kv_heads] + [self.num_heads] * self.output_gate
        q, k, v, *gate = qkv.split(heads, dim=1)  # views of qkv
        if self.q_norm is not None:
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.use_rope:  # q and k in place, in one go
            ops.rotary_(qkv[:, : self.num_heads + self.num_kv_heads, : self.rotary_dim], *rope)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.sinks)
        o = o.reshape(-1, self.q_size)
        if gate:  # Qwen3.5: each feature of the attention output gated by sigmoid of its own projection
            o = ops.sigmoid_gate(o, gate[0].flatten(1))
        return self.o_proj(o, out_dtype=x.dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Copies this rank's heads of the checkpoint's sinks (float32 [total heads]) into `param`."""
        param.data.copy_(loaded.reshape(-1)[self.head_start : self.head_start + self.num_heads])
