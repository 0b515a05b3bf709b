"""The decoder layer's elementwise ops as Triton kernels, one launch each: ops.py's CUDA path.

At batch 1 a Llama-3-8B decode step reads 15 GB of weights in ~3.9 ms on an H200, and torch's way of
writing residual-add + RMSNorm, the rotary embedding, the K/V cache write and SiLU-and-mul cost 31 kernels
per layer (~1,000 per step, 1-3 us each: 1.8 ms of a 6.6 ms step, docs/benchmarks.md "CUDA"). Fused, they
are 4 kernels per layer, as vLLM's `fused_add_rms_norm`, `rotary_embedding`, `reshape_and_cache` and
`silu_and_mul` CUDA ops are. Each kernel computes in float32 and rounds once to the output's dtype.

The kernels also run under Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported) on
CPU tensors: tests/unit/test_triton_ops.py checks them against the torch ops there, so CI without a GPU
keeps them right.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(res_ptr, delta_ptr, w_ptr, out_ptr, n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        r += tl.load(delta_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * n_cols + cols, r, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # as the torch path: the normalised row rounded to the weight's dtype, then scaled
    normed = (r * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm of the sum, in one pass (as ops.add_rms_norm).

    residual: float32 [T, hidden], contiguous; delta: contiguous [T, hidden] in any float dtype, or None;
    weight: [hidden]. Returns [T, hidden] in weight's dtype.
    """
    rows, cols = residual.shape
    out = torch.empty(residual.shape, dtype=weight.dtype, device=residual.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _add_rms_norm_kernel[(rows,)](
            residual,
            residual if delta is None else delta,
            weight,
            out,
            cols,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, stride_t, stride_h, n_heads, half, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    mask = (heads < n_heads)[:, None] & dmask[None, :]
    c = tl.load(cos_ptr + t * half + d, mask=dmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + t * half + d, mask=dmask, other=0.0)[None, :]
    p1 = x_ptr + t * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE of x [T, heads, head_dim] in place (as ops.rotary_): x may have any token stride
    (the q and k heads of the fused qkv output) but dense heads; cos, sin: contiguous float32
    [T, head_dim // 2]."""
    tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim, "rotary_ needs dense heads"
    if tokens and heads:
        half = head_dim // 2
        block_h = min(triton.next_power_of_2(heads), 16)
        _rotary_kernel[(tokens, triton.cdiv(heads, block_h))](
            x,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            heads,
            half,
            BLOCK_H=block_h,
            BLOCK_D=triton.next_power_of_2(half),
            num_warps=4,
        )


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt, row, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < row
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # a token's heads are dense: its [kv_heads, head_dim] is one run of `row` elements, source and cache alike
    k = tl.load(k_ptr + t * stride_kt + i, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + i, mask=mask)
    tl.store(k_cache_ptr + slot * row + i, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * row + i, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor):
    """Writes each token's K and V [T, kv_heads, head_dim] (any token stride, dense heads) into the paged
    caches (contiguous, [num_blocks, block_size, kv_heads, head_dim]) at `slots` (int64 [T], block id *
    block_size + offset): both index_copy_s of the torch path in one kernel (vLLM's reshape_and_cache)."""
    tokens, kv_heads, head_dim = k.shape
    for t in (k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, "write_kv needs dense heads"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if tokens:
        row = kv_heads * head_dim
        block = min(triton.next_power_of_2(row), 4096)
        _write_kv_kernel[(tokens, triton.cdiv(row, block))](
            k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), row, BLOCK=block, num_warps=4
        )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < inter
    gate = tl.load(x_ptr + t * 2 * inter + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * 2 * inter + inter + i, mask=mask, other=0.0).to(tl.float32)
    # as torch: SiLU rounded to the activations' dtype, then the product
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * inter + i, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of contiguous gate_up [T, 2 * inter] = [gate | up]: [T, inter] (as ops.silu_and_mul)."""
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, inter)
    if tokens:
        block = 1024
        _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
