"""The C layer ops (residual-add + RMSNorm, rotary, SiLU-and-mul, the sigmoid gate, the small-batch bfloat16 linear)
against the torch computations they replace, on random data of the model's shapes."""

import pytest
import torch
import torch.nn.functional as F

import engine  # noqa: F401  (imports the engine before the model package, as the runner does)
from models.kernels import cpu_kernels, ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _kernels_built():
    assert cpu_kernels.load() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype, with_delta):
    torch.manual_seed(0)
    residual = torch.randn(7, 576)
    delta = torch.randn(7, 576, dtype=dtype) if with_delta else None
    weight = torch.randn(576, dtype=dtype)
    expect_residual = residual + (delta.float() if with_delta else 0)
    expect = (weight.float() * F.rms_norm(expect_residual, (576,), eps=1e-5)).to(dtype)
    out = ops.add_rms_norm(residual, delta, weight, 1e-5)
    assert out.dtype == dtype
    torch.testing.assert_close(residual, expect_residual)  # updated in place, in float32
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_rms_norm_by_the_kernel_equals_torch(dtype, monkeypatch):
    """Qwen3's q/k norms (HeadRMSNorm) run as one add_rms_norm call over the [T * heads, head_dim] rows: the same
    as transformers' float32 norm of each head, on a strided view of a fused qkv (the kernel's path really ran)."""
    from models.layers.layernorm import HeadRMSNorm

    torch.manual_seed(0)
    norm = HeadRMSNorm(128, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    q = torch.randn(5, 6 * 128, dtype=dtype)[:, : 4 * 128].view(5, 4, 128)
    expect = F.rms_norm(q.float(), (128,), norm.weight.float(), 1e-6).to(dtype)
    calls, real = [], ops.add_rms_norm
    monkeypatch.setattr(ops, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    out = norm(q)
    assert calls and out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_a_strided_view(dtype):
    torch.manual_seed(0)
    qkv = torch.randn(5, 9 + 3 + 3, 64, dtype=dtype)
    v_before = qkv[:, 12:].clone()
    cos, sin = torch.randn(5, 32), torch.randn(5, 32)
    x = qkv[:, :12]
    x1, x2 = x.float().chunk(2, dim=-1)
    expect = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), dim=-1)
    ops.rotary_(x, cos, sin)
    torch.testing.assert_close(x.float(), expect, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, 12:], v_before)  # the v heads are left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_rotates_each_heads_leading_features_only(dtype, monkeypatch):
    """Partial rotary (Qwen3.5's first quarter, Phi-4-mini's three quarters): the kernel on the leading 16 of each
    64-feature head of a fused qkv view (token and head strides) against the float32 formula, the other features and
    the v heads left alone, through the C kernel (not torch's fallback)."""
    torch.manual_seed(0)
    qkv = torch.randn(5, 9 + 3 + 3, 64, dtype=dtype)
    before = qkv.clone()
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    x = qkv[:, :12, :16]
    x1, x2 = x.float().chunk(2, dim=-1)
    expect = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), dim=-1)
    monkeypatch.setattr(torch, "cat", None)  # the fallback's: the kernel must take this view
    ops.rotary_(x, cos, sin)
    monkeypatch.undo()
    torch.testing.assert_close(x.float(), expect, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, :12, 16:], before[:, :12, 16:]) and torch.equal(qkv[:, 12:], before[:, 12:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate(dtype):
    """Qwen3.5's output gate x * sigmoid(gate) in place, the gate a strided part of a fused projection, against
    torch's ops (the sigmoid rounded to the dtype, then the product), gates from 1e-2 to ~300 of both signs (past
    -88, where exp overflows float32)."""
    torch.manual_seed(0)
    x = torch.randn(6, 512, dtype=dtype)
    fused = torch.randn(6, 3 * 512, dtype=dtype)
    fused[:, 1024:] *= torch.logspace(-2, 2.5, 512, dtype=dtype) * torch.tensor([1.0, -1.0]).repeat(256).to(dtype)
    gate = fused[:, 1024:]
    expect = x * torch.sigmoid(gate)
    out = ops.sigmoid_gate(x, gate)
    assert out.data_ptr() == x.data_ptr() and out.dtype == dtype
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expect.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    """Gate values of every size, past -88 too (where exp(-gate) overflows float32: it came out as NaN under
    -ffast-math)."""
    torch.manual_seed(0)
    gate_up = torch.randn(6, 2 * 1536, dtype=dtype)
    gate_up[:, :1536] *= torch.logspace(-2, 2.5, 1536, dtype=dtype)  # |gate| up to ~300
    expect = F.silu(gate_up[:, :1536].float()) * gate_up[:, 1536:].float()
    torch.testing.assert_close(ops.silu_and_mul(gate_up).float(), expect, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype):
    """Gemma's GeGLU in C against torch's gelu(approximate="tanh"), over gates from 1e-2 to ~300 of both signs."""
    torch.manual_seed(1)
    gate_up = torch.randn(5, 2 * 1152, dtype=dtype)
    gate_up[:, :1152] *= torch.logspace(-2, 2.5, 1152, dtype=dtype)
    expect = F.gelu(gate_up[:, :1152].float(), approximate="tanh") * gate_up[:, 1152:].float()
    out = ops.gelu_tanh_and_mul(gate_up)
    torch.testing.assert_close(out.float(), expect, atol=TOL[dtype], rtol=TOL[dtype])
    with ops.torch_ops():
        torch.testing.assert_close(ops.gelu_tanh_and_mul(gate_up).float(), expect, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(960, 576), (577, 1536), (7, 100)])
def test_small_batch_bf16_linear(m, n, k):
    """Row counts around the 4x4 tiles, N not a multiple of 4, K not a multiple of 32."""
    torch.manual_seed(m)
    x = torch.randn(m, k + 8, dtype=torch.bfloat16)[:, :k]  # rows with a stride, as views give
    w, b = torch.randn(n, k, dtype=torch.bfloat16) / k**0.5, torch.randn(n, dtype=torch.bfloat16)
    for bias in (None, b):
        expect = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        torch.testing.assert_close(ops.linear(x, w, bias).float(), expect, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("wdtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("n,k", [(1536, 8960), (577, 1539), (3, 5)])
def test_half_weight_linear_is_the_float32_product(wdtype, m, n, k):
    """A GGUF F16 / BF16 matrix kept 16-bit against float32 activations: the float32 product with the weight's
    exact values (the kernel up to SMALL_M rows, in tiles of 4 x 2 with K not a multiple of 8; torch beyond)."""
    torch.manual_seed(m)
    x = torch.randn(m, k + 8)[:, :k]  # rows with a stride, as views give
    w = (torch.randn(n, k) / k**0.5).to(wdtype)
    out = ops.linear_half(x, w)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out, F.linear(x, w.float()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, v", [(1, 49152), (3, 151936), (2, 1000), (2, 70), (1, 5)])
def test_top_indices_are_topks(n, v):
    """top_indices finds each row's k largest, as torch.topk does, with the C kernel's one pass and the torch
    path's two: vocabularies that are and are not whole spans, fewer spans than k, fewer values than k; the k
    largest crowded in one span, and rising to the end (every span holds a new one)."""
    torch.manual_seed(v)
    x = torch.randn(n, v)
    x[0, :8] += 100  # the top 8 in the first span
    if n > 1:
        x[-1] = torch.arange(v, dtype=torch.float32)
    want = x.topk(min(8, v), dim=-1).indices.sort(-1).values
    got = ops.top_indices(x, 8)
    with ops.torch_ops():
        by_torch = ops.top_indices(x, 8)
    for out in (got, by_torch):
        assert out.shape == want.shape and torch.equal(out.sort(-1).values, want)


@pytest.mark.parametrize("n, v", [(64, 49152), (1, 49152), (3, 130), (2, 64), (2, 65), (4, 1)])
def test_argmax_is_torchs(n, v):
    """The C argmax (greedy sampling's: top_k_float with k = 1) is torch.argmax's, the first of equal maxima
    included: random rows, a maximum repeated in two spans of 64 and within one, a row of equal values, a maximum at
    the last index."""
    torch.manual_seed(v)
    x = torch.randn(n, v)
    if v > 70:
        x[0, [5, 64, 69]] = 50.0  # ties within a span and across spans
        x[-1, -1] = 60.0
    if n > 2:
        x[1] = 3.0
    lib = cpu_kernels.load()
    out = torch.empty(n, 1, dtype=torch.int64)
    lib.top_k_float(x.data_ptr(), n, v, 1, out.data_ptr(), 2)
    assert torch.equal(out[:, 0], x.argmax(dim=-1))
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))


def test_bf16_logits_refine_the_top_candidates():
    """A bfloat16 LM head's top logits are float32-exact (the greedy choice is the float32 one); the
    others keep the GEMM's bfloat16 rounding."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 576, dtype=torch.bfloat16), torch.randn(3000, 576, dtype=torch.bfloat16)
    exact = F.linear(hidden.float(), weight.float())
    out = ops.logits(hidden, weight)
    assert out.dtype == torch.float32
    top = exact.topk(ops.REFINE_TOP, dim=-1).indices
    torch.testing.assert_close(out.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=1e-5)
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(out, exact, atol=0.3, rtol=1e-2)  # the rest: bfloat16-rounded
