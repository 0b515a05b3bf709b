"""The decoder layer's ops: the C kernels of `engine/kernels/csrc/` on the CPU, torch everywhere else.

Each op takes and returns plain tensors, so the model (`models/llama.py`, `engine/distributed/layers.py`)
reads the same on every device. On the CPU (float32 or bfloat16, kernels built) residual-add + RMSNorm,
rotary and SiLU-and-mul are one C pass each instead of several torch ops, and bfloat16 linears over few
rows (decode steps up to `SMALL_M` sequences) run a weight-streaming kernel (see engine/kernels/csrc/linear.c);
a missing compiler or another device takes the torch path, which computes the same thing.
"""
import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernels

REFINE_TOP = 8  # logits re-scored in float32 per row after a bfloat16 / float16 LM head
SMALL_M = 8  # rows up to which the bfloat16 weight-streaming kernel beats torch's GEMM here (1.3-4x at 1-8 rows)
_SUFFIX = {torch.float32: "float", torch.bfloat16: "bf16"}


def _lib(x: torch.Tensor):
    """The kernel library when x can take the C path, else None."""
    if x.device.type != "cpu" or x.dtype not in _SUFFIX:
        return None
    return cpu_kernels.load()


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place), then RMSNorm (Zhang & Sennrich 2019) of the sum.

    residual: float32 [T, hidden], the running residual stream; delta: [T, hidden] in the model dtype
    (a sublayer's output) or None; weight: [hidden] in the model dtype. Returns the normalised
    [T, hidden] in the model dtype.
    """
    lib = _lib(weight)
    if lib is None or not residual.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        if delta is not None:
            residual += delta
        return weight * F.rms_norm(residual, residual.shape[-1:], eps=eps).to(weight.dtype)
    out = torch.empty(residual.shape, dtype=weight.dtype)
    getattr(lib, f"add_rms_norm_{_SUFFIX[weight.dtype]}")(
        residual.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
        residual.shape[0], residual.shape[1], eps, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, heads, head_dim] in place by its tokens' angles, rotate-half RoPE (Su et al. 2021).

    x may be a view with a token stride (the q and k heads of the fused qkv output); cos, sin: float32
    [T, head_dim // 2].
    """
    lib = _lib(x)
    if lib is None or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return
    getattr(lib, f"rotary_{_SUFFIX[x.dtype]}")(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.shape[2],
                                               cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up (SwiGLU, Shazeer 2020) of gate_up [T, 2 * inter] = [gate | up]; returns [T, inter]."""
    lib = _lib(gate_up)
    inter = gate_up.shape[-1] // 2
    if lib is None or not gate_up.is_contiguous():
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    out = gate_up.new_empty(gate_up.shape[0], inter)
    getattr(lib, f"silu_and_mul_{_SUFFIX[gate_up.dtype]}")(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0],
                                                           inter, torch.get_num_threads())
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], as F.linear.

    Raises nothing new: shapes torch would reject are handed to torch.
    """
    if x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= SMALL_M and x.stride(-1) == 1 \
            and weight.is_contiguous() and (lib := _lib(x)) is not None:
        y = x.new_empty(x.shape[0], weight.shape[0])
        if lib.linear_bf16(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                           y.data_ptr(), x.shape[0], weight.shape[0], weight.shape[1], torch.get_num_threads()) == 0:
            return y
    return F.linear(x, weight, bias)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 logits [N, V] of hidden [N, hidden] against the LM head / tied embedding weight [V, hidden].

    In bfloat16 the GEMM rounds its float32 sums to 8 significant bits: logits near 16 move by up to
    0.06, enough to flip a greedy choice between near-tied tokens (a third of the greedy runs of the
    benchmark workload differed from float32 in their first 16 tokens). The GEMM still runs in the
    model dtype; then each row's REFINE_TOP highest logits, which hold the greedy choice and the
    reported top logprobs, are recomputed as exact float32 dot products.
    """
    out = linear(hidden, weight).float()
    if weight.dtype in (torch.bfloat16, torch.float16) and out.shape[0]:
        top = out.topk(min(REFINE_TOP, out.shape[1]), dim=-1).indices  # [N, k]
        out.scatter_(1, top, torch.einsum("nd,nkd->nk", hidden.float(), weight[top].float()))
    return out
