"""The decoder layer's ops: the C kernels of `models/kernels/csrc/` on the CPU, Triton kernels on CUDA
(models/kernels/triton_ops.py), torch everywhere else.

Each op takes and returns plain tensors, so the model (`models/llama.py`, `models/layers/linear.py`) reads the same
on every device. On the CPU (float32 or bfloat16, kernels built) residual-add + RMSNorm, rotary, SiLU-and-mul,
GELU-and-mul and the sigmoid output gate are one C pass each instead of several torch ops, and bfloat16 linears over
few rows (decode steps up to `SMALL_M` sequences) run a weight-streaming kernel (see models/kernels/csrc/linear.c).
On CUDA with Triton (every CUDA build of torch has it) those three and the K/V cache write are one kernel each.
A missing compiler or another device takes the torch path, which computes the same thing.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F

from models.kernels import cpu_kernels

REFINE_TOP = 8  # logits re-scored in float32 per row after a bfloat16 / float16 LM head
SMALL_M = 8  # rows up to which the bfloat16 weight-streaming kernel beats torch's GEMM here (1.3-4x at 1-8 rows)
_SUFFIX = {torch.float32: "float", torch.bfloat16: "bf16"}


_fused = True  # torch_ops() turns the C and Triton kernels off, to compare them with the torch path


def _lib(x: torch.Tensor):
    """The kernel library when x can take the C path, else None."""
    if not _fused or x.device.type != "cpu" or x.dtype not in _SUFFIX:
        return None
    return cpu_kernels.load()


@functools.cache
def _triton_ops():
    try:
        from models.kernels import triton_ops
    except ImportError:  # a CUDA torch without Triton: the torch path
        return None
    return triton_ops


def _cuda(x: torch.Tensor):
    """models.kernels.triton_ops when x can take the Triton path, else None."""
    if not _fused or x.device.type != "cuda" or not x.is_floating_point():
        return None
    return _triton_ops()


def kernels_enabled() -> bool:
    """False within torch_ops() (every op on the torch path), else True."""
    return _fused


@contextlib.contextmanager
def torch_ops():
    """Within the block every op takes the torch path (scripts/gpu_check.py measures what the kernels save;
    CUDA graphs captured inside keep the torch ops)."""
    global _fused
    old, _fused = _fused, False
    try:
        yield
    finally:
        _fused = old


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm (Zhang & Sennrich 2019) of the sum.

    residual: float32 [T, hidden], the running residual stream; delta: [T, hidden] in the model dtype
    (a sublayer's output) or None; weight: [hidden] in the model dtype. Returns the normalised
    [T, hidden] in the model dtype.
    """
    contiguous = residual.is_contiguous() and (delta is None or delta.is_contiguous())
    if contiguous and residual.dtype == torch.float32 and (tri := _cuda(weight)) is not None:
        return tri.add_rms_norm(residual, delta, weight, eps)
    lib = _lib(weight)
    if lib is None or not contiguous:
        if delta is not None:
            residual += delta
        return weight * F.rms_norm(residual, residual.shape[-1:], eps=eps).to(weight.dtype)
    out = torch.empty(residual.shape, dtype=weight.dtype)
    getattr(lib, f"add_rms_norm_{_SUFFIX[weight.dtype]}")(
        residual.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        residual.shape[0],
        residual.shape[1],
        eps,
        torch.get_num_threads(),
    )
    return out


def gated_delta_net_decode_(state, slots, qkv, z, a, b, conv_w, A_log, dt_bias, norm_w, eps, nk, dk, tiled):
    """One token of each of B sequences through a Gated DeltaNet layer between its projections, by the C kernel
    (csrc/recurrent.c), in place on their state slots: state float32 [slots, state_size] (the convolution's last
    K - 1 inputs [K - 1, C], then [nv, dk, dv] matrices), slots int64 [B]; qkv [B, C], z [B, nv * dv], a and b
    [B, nv] (the projections' outputs); conv_w [C, 1, K]; A_log, dt_bias [nv]; norm_w [dv]; `tiled`: value head h
    reads key head h mod nk. Returns the gated norm's output float32 [B, nv * dv], or None where the C path does not
    take it (no compiler, torch_ops(), heads over 1024 wide): the caller's torch path then."""
    lib = _lib(state)
    nv, dv = a.shape[1], z.shape[1] // a.shape[1]
    if lib is None or state.dtype != torch.float32 or state.stride(1) != 1 or max(dk, dv) > 1024:
        return None
    qkv, z, a, b, conv_w, A_log, dt_bias, norm_w = (
        x.float().contiguous() for x in (qkv, z, a, b, conv_w, A_log, dt_bias, norm_w)
    )
    slots = slots.to(torch.int64).contiguous()
    out = torch.empty_like(z)
    lib.gated_delta_net_decode(
        state.data_ptr(), state.stride(0), slots.data_ptr(), qkv.shape[0],
        *(x.data_ptr() for x in (qkv, z, a, b, conv_w)), conv_w.shape[-1],
        *(x.data_ptr() for x in (A_log, dt_bias, norm_w)), eps, nk, nv, dk, dv, int(tiled),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, heads, rot] in place by its tokens' angles, rotate-half RoPE (Su et al. 2021).

    x may be a view with a token stride (the q and k heads of the fused qkv output) and a head stride (the first
    `rot` features of each head: partial rotary, Phi-4-mini, Qwen3.5); cos, sin: float32 [T, rot // 2].
    """
    dense = x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]
    if dense and cos.is_contiguous() and sin.is_contiguous() and (tri := _cuda(x)) is not None:
        return tri.rotary_(x, cos, sin)
    lib = _lib(x)
    if lib is None or x.stride(-1) != 1 or not (cos.is_contiguous() and sin.is_contiguous()):
        c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return
    getattr(lib, f"rotary_{_SUFFIX[x.dtype]}")(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        x.stride(0),
        x.stride(1),
        x.shape[2],
        cos.data_ptr(),
        sin.data_ptr(),
        torch.get_num_threads(),
    )


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) in x's dtype (the sigmoid rounded to it first, as torch's ops round it): Qwen3.5's gated
    attention output (Qiu et al. 2025). x [T, n] contiguous, gate [T, n] with any token stride (a part of the fused
    qkv output); on the CPU one C pass that overwrites x and returns it (the one-call layer calls the same kernel,
    decoder_layer.c, so both compute the same bits); elsewhere torch ops into a new tensor."""
    lib = _lib(x)
    if lib is None or gate.dtype != x.dtype or not x.is_contiguous() or gate.stride(-1) != 1 or x.dim() != 2:
        return x * torch.sigmoid(gate)
    getattr(lib, f"sigmoid_gate_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), x.stride(0), gate.data_ptr(), gate.stride(0), x.shape[0], x.shape[1], torch.get_num_threads()
    )
    return x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up (SwiGLU, Shazeer 2020) of gate_up [T, 2 * inter] = [gate | up]; returns [T, inter]."""
    if gate_up.is_contiguous() and (tri := _cuda(gate_up)) is not None:
        return tri.silu_and_mul(gate_up)
    return _act_and_mul(gate_up, "silu", F.silu)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate) (tanh approximation, Hendrycks & Gimpel 2016) * up: GeGLU (Shazeer 2020), Gemma's MLP, of
    gate_up [T, 2 * inter] = [gate | up]; returns [T, inter]. The C kernel on the CPU, torch ops elsewhere."""
    return _act_and_mul(gate_up, "gelu_tanh", lambda gate: F.gelu(gate, approximate="tanh"))


def _act_and_mul(gate_up: torch.Tensor, name: str, act) -> torch.Tensor:
    """act(gate) * up through the C kernel `{name}_and_mul_*` where it applies, else torch's `act`."""
    lib = _lib(gate_up)
    inter = gate_up.shape[-1] // 2
    if lib is None or not gate_up.is_contiguous():
        gate, up = gate_up.split(inter, dim=-1)
        return act(gate) * up
    out = gate_up.new_empty(gate_up.shape[0], inter)
    getattr(lib, f"{name}_and_mul_{_SUFFIX[gate_up.dtype]}")(
        gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], inter, torch.get_num_threads()
    )
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes this step's K and V [T, kv_heads, head_dim] into the paged caches [num_blocks, block_size,
    kv_heads, head_dim] at slot_mapping (int64 [T], block id * block_size + offset): PagedAttention's cache
    write (vLLM's reshape_and_cache), one Triton kernel on CUDA, two index_copy_s elsewhere."""
    dense = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k, v))
    if dense and k_cache.is_contiguous() and v_cache.is_contiguous() and (tri := _cuda(k)) is not None:
        return tri.write_kv(k, v, k_cache, v_cache, slot_mapping)
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, hidden] (no residual), computed in float32, returned in x's dtype: a sublayer's
    output normalised before it joins the residual stream (Gemma's post-norms)."""
    return (F.rms_norm(x.float(), x.shape[-1:], eps=eps) * weight.float()).to(x.dtype)


def _small_rows_lib(x: torch.Tensor, weight: torch.Tensor):
    """The C kernels' library where x [M, K] (M <= SMALL_M, rows contiguous) and a contiguous weight suit the
    weight-streaming linears of csrc/linear.c, else None."""
    if x.dim() == 2 and x.shape[0] <= SMALL_M and x.stride(-1) == 1 and weight.is_contiguous():
        return _lib(x)
    return None


def linear_half(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K]^T, weight float16 or bfloat16 (a GGUF file's F16 / BF16 matrix kept
    16-bit) -> float32 [M, N]: the product with the weight's exact values, float32 sums.

    Up to SMALL_M rows on the CPU the C kernel streams the 16-bit weight, widening it in registers (half the
    bytes of a float32 copy; models/kernels/csrc/linear.c); otherwise, or where the kernel cannot run, torch on
    a transient float32 copy (prompts are compute-bound, the copy is a small part of them).
    """
    if x.dtype == torch.float32 and (lib := _small_rows_lib(x, weight)) is not None:
        y = x.new_empty(x.shape[0], weight.shape[0])
        if (
            lib.linear_half(
                x.data_ptr(),
                x.stride(0),
                weight.data_ptr(),
                int(weight.dtype == torch.bfloat16),
                y.data_ptr(),
                x.shape[0],
                weight.shape[0],
                weight.shape[1],
                torch.get_num_threads(),
            )
            == 0
        ):
            return y
    return F.linear(x, weight.to(x.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], as F.linear.

    Raises nothing new: shapes torch would reject are handed to torch.
    """
    if x.dtype == torch.bfloat16 and (lib := _small_rows_lib(x, weight)) is not None:
        y = x.new_empty(x.shape[0], weight.shape[0])
        if (
            lib.linear_bf16(
                x.data_ptr(),
                x.stride(0),
                weight.data_ptr(),
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                x.shape[0],
                weight.shape[0],
                weight.shape[1],
                torch.get_num_threads(),
            )
            == 0
        ):
            return y
    return F.linear(x, weight, bias)


def moe_route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A mixture-of-experts router in one C call (layer_ops.c moe_route_float): logits x [T, hidden] W^T (+ bias)
    for W float32 [E, hidden], softmax over the experts, the top_k most probable (descending) -> (weights float32
    [T, top_k], renormalised to sum 1 where `renormalize`; ids int64 [T, top_k]), as select_experts computes them
    from torch's logits to float rounding. The one-call decoder layer (decoder_layer.c) routes with the same
    function, so both choose the same experts. None (the caller's torch path) for a tensor the kernel does not
    take: not float32 and contiguous on the CPU, or top_k over 64."""
    lib = _lib(x)
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if lib is None or not 0 < top_k <= min(64, weight.shape[0]):
        return None
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu" for t in tensors):
        return None
    weights = torch.empty(x.shape[0], top_k)
    ids = torch.empty(x.shape[0], top_k, dtype=torch.int64)
    lib.moe_route_float(
        x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), None if bias is None else bias.data_ptr(),
        weight.shape[0], top_k, int(renormalize), ids.data_ptr(), weights.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return weights, ids


TOP_SPAN = 64  # logits per span in top_indices' first pass


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of x [N, V]: int64 [N], the first of equal maxima, as torch.argmax(x, dim=-1) gives it. A
    contiguous float32 x on the CPU takes the C top-k kernel with k = 1 (layer_ops.c top_k_float: of equal values the
    first seen; torch's argmax took 0.86 ms over a batch-64 step's logits, a fiftieth of the step, this 0.1), other
    tensors torch's. A row holding a NaN gets one of its indices (torch's argmax: the NaN's)."""
    lib = _lib(x)
    if lib is None or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or not x.shape[1]:
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], 1, dtype=torch.int64)
    lib.top_k_float(x.data_ptr(), x.shape[0], x.shape[1], 1, out.data_ptr(), torch.get_num_threads())
    return out[:, 0]


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The column indices [N, k] of each row's k largest values of x [N, V] (float), in no set order; ties may
    resolve either way. Two passes: each span of TOP_SPAN values' max, then the k largest values within the k spans
    of the largest maxima, which hold them (a span outside those has k spans of larger maxima above it, so k values
    larger than its own). torch.topk over a 49,152-token vocabulary took 120 us a row on a 2-core EPYC, a twentieth
    of the default model's batch-1 step; this about 25 alone, but ~150 between the engine's kernels (eight small
    torch ops). A contiguous float32 x on the CPU with k <= 64 takes the C kernel's one pass instead (layer_ops.c
    top_k_float: spans of 64 skipped whole while their maximum is under the k-th largest). Raises nothing; k is
    capped at V."""
    n, v = x.shape
    k = min(k, v)
    lib = _lib(x)
    if lib is not None and x.dtype == torch.float32 and x.is_contiguous() and 0 < k <= 64:
        out = torch.empty(n, k, dtype=torch.int64)
        lib.top_k_float(x.data_ptr(), n, v, k, out.data_ptr(), torch.get_num_threads())
        return out
    spans = -(-v // TOP_SPAN)
    if spans <= k or x.device.type != "cpu":
        return x.topk(k, dim=-1).indices
    if v % TOP_SPAN:
        x = torch.nn.functional.pad(x, (0, spans * TOP_SPAN - v), value=float("-inf"))
    best = x.view(n, spans, TOP_SPAN).amax(-1).topk(k, dim=-1).indices  # [N, k] spans
    columns = (best[:, :, None] * TOP_SPAN + torch.arange(TOP_SPAN)).view(n, -1)  # [N, k * TOP_SPAN]
    return columns.gather(1, x.gather(1, columns).topk(k, dim=-1).indices)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 logits [N, V] of hidden [N, hidden] against the LM head / tied embedding weight [V, hidden].

    In bfloat16 the GEMM rounds its float32 sums to 8 significant bits: logits near 16 move by up to
    0.06, enough to flip a greedy choice between near-tied tokens (a third of the greedy runs of the
    benchmark workload differed from float32 in their first 16 tokens). The GEMM still runs in the
    model dtype; then each row's REFINE_TOP highest logits, which hold the greedy choice and the
    reported top logprobs, are recomputed as exact float32 dot products. On CUDA the GEMM writes its float32
    sums directly (cuBLAS, torch.mm's out_dtype): every logit exact, without the re-scoring's five kernels.
    """
    half = weight.dtype in (torch.bfloat16, torch.float16)
    if _fused and half and hidden.is_cuda and hidden.dtype == weight.dtype and _float_out_mm(hidden.device):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    out = linear(hidden, weight).float()
    if half:
        refine_top(out, hidden, lambda top: weight[top].float())
    return out


def refine_top(out: torch.Tensor, hidden: torch.Tensor, rows) -> None:
    """Each row's REFINE_TOP highest logits of `out` (float32 [N, V], in place) recomputed as exact float32 dot
    products of hidden [N, D] with their LM head rows: `rows(top)` gives them, float32 [N, k, D] for the int64
    indices top [N, k]."""
    if out.shape[0]:
        top = top_indices(out, REFINE_TOP)
        out.scatter_(1, top, torch.bmm(rows(top), hidden.float()[:, :, None])[:, :, 0])


def gguf_refine_top(out: torch.Tensor, hidden: torch.Tensor, data: torch.Tensor, qtype: int, r16: bool) -> bool:
    """refine_top for an LM head of GGUF blocks `data` (R16 where `r16`) in one C call (gguf_linear.c
    gguf_refine_top: each row's top-k, their rows dequantized, their float32 dot products with hidden float32
    [N, D]); False, nothing done, where it does not apply (no kernels, not float32 CPU tensors)."""
    lib = _lib(hidden)
    if lib is None or hidden.dtype != torch.float32 or not (hidden.is_contiguous() and out.is_contiguous()):
        return False
    n, v = out.shape
    return (
        lib.gguf_refine_top(
            hidden.data_ptr(), n, hidden.shape[1], data.data_ptr(), int(qtype), int(r16), out.data_ptr(), v,
            min(REFINE_TOP, v), torch.get_num_threads(),
        )
        == 0
    )  # fmt: skip


@functools.cache
def _float_out_mm(device: torch.device) -> bool:
    """True where torch.mm takes out_dtype=float32 for bfloat16 / float16 inputs on this device (CUDA,
    torch 2.8 and later)."""
    try:
        a = torch.ones(1, 8, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _gguf_lib():
    lib = cpu_kernels.load()
    if lib is None:
        raise RuntimeError("GGUF weights need the CPU kernels (a C compiler)")
    return lib


def gguf_dequantize(data: torch.Tensor, qtype: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weights [rows, cols] (float32 or bfloat16) of ggml blocks `data` uint8 [rows, row_bytes] of
    type `qtype` (models/kernels/csrc/gguf_linear.c): in float32, bit for bit what gguf-py's dequantize gives.

    Raises RuntimeError without the kernels and ValueError for a type they do not know.
    """
    out = torch.empty(data.shape[0], cols, dtype=dtype)
    if (
        _gguf_lib().gguf_dequantize(
            int(qtype),
            data.data_ptr(),
            data.shape[0],
            cols,
            out.data_ptr(),
            int(dtype == torch.bfloat16),
            torch.get_num_threads(),
        )
        != 0
    ):
        raise ValueError(f"ggml type {qtype} with rows of {cols} weights has no kernel")
    return out


def gguf_repack_r16(data: torch.Tensor, qtype: int, cols: int, int8: bool = False) -> torch.Tensor | None:
    """ggml blocks `data` uint8 [rows, row_bytes] repacked 16 rows at a time for the R16 kernels (lossless; the
    blocks' bytes, up to 3% more for Q4_K and Q5_K, plus zero rows up to a multiple of 16): uint8 [ceil(rows / 16),
    bytes per 16 rows]. None where the CPU cannot run them on the activations meant (int16, or `int8`) or the type
    has no R16 layout (Q4_0, Q4_1, Q8_0, MXFP4, Q4_K, Q5_K and Q6_K have): AVX512-VNNI runs every R16 type on
    either, AVX2 alone the int8 activations against all but Q8_0 (gguf_r16_takes)."""
    lib = cpu_kernels.load()
    if lib is None or not lib.gguf_r16_takes(int(qtype), int(int8)):
        return None
    nbytes = lib.gguf_r16_bytes(int(qtype), data.shape[0], cols)
    if nbytes < 0:
        return None
    groups = -(-data.shape[0] // 16)
    out = torch.empty(groups, nbytes // groups, dtype=torch.uint8)
    return out if lib.gguf_repack_r16(int(qtype), data.data_ptr(), data.shape[0], cols, out.data_ptr()) == 0 else None


def gguf_dequantize_rows(
    data: torch.Tensor, qtype: int, cols: int, ids: torch.Tensor, r16: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` (int64 [n]) of a GGUF weight (ggml blocks, or R16 when `r16`) dequantized: [n, cols] in
    `dtype` (float32 or bfloat16), exact as gguf_dequantize. Raises ValueError for an unknown type."""
    if not r16:
        return gguf_dequantize(data[ids], qtype, cols, dtype)
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], cols, dtype=dtype)
    if _gguf_lib().gguf_r16_dequantize_rows(
        int(qtype),
        data.data_ptr(),
        cols,
        ids.data_ptr(),
        ids.shape[0],
        out.data_ptr(),
        int(dtype == torch.bfloat16),
        torch.get_num_threads(),
    ):
        raise ValueError(f"ggml type {qtype} has no R16 layout")
    return out


def moe_kernel(blocks: list) -> int | None:
    """gguf_moe's `r16` for an MoE layer's gate, up and down GGUFTensors: 0 for blocks on the AVX2 int8 kernel, 1
    for R16 weights on int16 activations, 2 on int8; None where the three do not share one of those (the loop
    then)."""
    if len({(b.r16, b.int8) for b in blocks}) != 1:
        return None
    r16, int8 = blocks[0].r16, blocks[0].int8
    return (2 if int8 else 1) if r16 else (0 if int8 else None)


def gguf_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    blocks: list,
    inter: int,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    swiglu_limit: float | None,
    swiglu_alpha: float,
    geglu: bool = False,
) -> torch.Tensor | None:
    """A mixture-of-experts layer's routed experts in one C call (csrc/gguf_linear.c, gguf_moe, expert by expert):
    x float32 [T, hidden], weights float32 [T, k], ids int64 [T, k]; `blocks` the gate, up and down GGUFTensors of
    every expert (E * rows rows each), all the file's blocks on the AVX2 int8 kernel (`int8`) or all repacked (R16:
    the AVX512-VNNI kernel, on int8 activations where their `int8`), each expert taking the kernel its projection
    takes alone (GGUFTensor.matmul of its row range); b13 float32 [E, 2 * inter], b2 [E, hidden] or None; the
    clamped SwiGLU where `swiglu_limit`, GELU_tanh(gate) up where `geglu` (Gemma 4), else SiLU. Returns float32
    [T, hidden] (the experts' weighted sum), or None where the C path does not take it (no compiler, another type,
    dtype or mix of layouts, a CPU without the kernel): the caller's loop then."""
    lib = _gguf_lib()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    gate, up, down = blocks
    r16 = moe_kernel(blocks)
    if r16 is None:
        return None
    x, weights, ids = x.contiguous(), weights.float().contiguous(), ids.to(torch.int64).contiguous()
    b13, b2 = (None if b is None else b.float().contiguous() for b in (b13, b2))
    out = torch.empty_like(x)
    status = lib.gguf_moe(
        x.data_ptr(), x.shape[0], x.shape[1], ids.data_ptr(), weights.data_ptr(), ids.shape[1],
        gate.data.data_ptr(), int(gate.qtype), up.data.data_ptr(), int(up.qtype), down.data.data_ptr(),
        int(down.qtype), gate.rows // inter, inter, None if b13 is None else b13.data_ptr(),
        None if b2 is None else b2.data_ptr(), swiglu_limit or 0.0, swiglu_alpha, int(geglu), r16, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out if status == 0 else None


def gguf_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    qtype: int,
    rows: int,
    cols: int,
    r16: bool,
    out: torch.Tensor | None = None,
    int8_activations: bool = False,
) -> torch.Tensor:
    """x [M, cols] (float32 or bfloat16) @ W^T for a GGUF weight W of `rows` rows: ggml blocks `data` uint8
    [rows, row_bytes] of type `qtype`, or R16 (gguf_repack_r16) when `r16`. Returns y [M, rows] in x's dtype,
    or writes into `out` (a [M, rows] view whose rows may be a wider tensor's, e.g. one projection's
    columns of a fused output).

    R16 weights run the AVX512-VNNI kernel, on activations quantized to int16 per 32 (vpdpwssd: a relative error
    near 1e-5), or with `int8_activations` to int8 per 32 (vpdpbusd, twice the multiply-adds per instruction:
    llama.cpp's Q8_0 arithmetic); blocks run the portable C kernel in float32, or with `int8_activations`
    (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks, a CPU with AVX2: gguf_q8_isa) the AVX2 kernel on
    activations quantized to int8 per 32 (per 256 for the K-quants: Q8_K), as llama.cpp computes. Raises ValueError
    for a type (or, int8, a shape or CPU) the kernels do not take.
    """
    lib = _gguf_lib()
    y = x.new_empty(x.shape[0], rows) if out is None else out
    args = (
        x.data_ptr(),
        int(x.dtype == torch.bfloat16),
        x.stride(0),
        data.data_ptr(),
        int(qtype),
        y.data_ptr(),
        int(y.dtype == torch.bfloat16),
        y.stride(0),
        x.shape[0],
        rows,
        cols,
    )
    if r16:
        fn = lib.gguf_r16_linear_i8 if int8_activations else lib.gguf_r16_linear
    else:
        fn = lib.gguf_q8_linear if int8_activations else lib.gguf_linear
    status = fn(*args, torch.get_num_threads())
    if status != 0:
        raise ValueError(f"ggml type {qtype} with rows of {cols} weights has no kernel")
    return y
