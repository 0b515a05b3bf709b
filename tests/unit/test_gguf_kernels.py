"""The GGUF kernels (models/kernels/csrc/gguf_linear.c) against gguf-py's numpy dequantize, for every
supported type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K..Q6_K, IQ4_XS, MXFP4), on random blocks: exact
dequantization (blocks and R16), the portable path to float rounding, and the R16 VNNI kernels (their six types)
within the bound their int16 activations allow, or on int8 activations to float rounding."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from models.kernels import cpu_kernels, ops
from models.quantization import gguf as gguf_quant
from models.quantization.gguf import (
    Q8_TYPES,
    QUANTIZED_TYPES,
    R16_COPY_HEAD_MIN_ROWS,
    R16_COPY_MIN_ROWS,
    R16_TYPES,
    GGUFTensor,
)
from tests.gguf_blocks import amx_rows, random_blocks

SUPER_BLOCK_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)  # K-quants meet int8 activations per 256 (llama.cpp's Q8_K), both kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")


def vnni() -> bool:
    return bool(cpu_kernels.load().gguf_r16_isa())


def r16_int8(qtype: T) -> bool:
    """Whether the CPU runs R16 weights of `qtype` on int8 activations: every R16 type with AVX512-VNNI, all but
    Q8_0 with AVX2 alone (gguf_r16_avx2.c)."""
    return bool(cpu_kernels.load().gguf_r16_takes(int(qtype), 1))


def reference(raw: torch.Tensor, qtype: T, cols: int) -> np.ndarray:
    return quants.dequantize(raw.numpy(), qtype).reshape(raw.shape[0], cols)


def shape(qtype: T) -> tuple[int, int]:
    """37 rows (not a multiple of R16's 16) and 3 blocks (not a multiple of the 64-value step)."""
    return 37, 3 * GGML_QUANT_SIZES[qtype][0]


def int16_bound(x: torch.Tensor, w: np.ndarray, y_ref: np.ndarray) -> np.ndarray:
    """The most the int16 activations (per 32, scale amax / 32767, round to nearest) can move each output,
    plus bfloat16 rounding of the output: [M, N]."""
    xb = x.double().numpy().reshape(x.shape[0], -1, 32)
    step = np.abs(xb).max(-1) / 32767  # [M, blocks]
    absw = np.abs(w).reshape(w.shape[0], -1, 32).sum(-1)  # [N, blocks]
    return 0.5 * step @ absw.T * 1.001 + np.abs(y_ref) * 2.0**-8 + 1e-6


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_dequantize_is_exact(qtype):
    rows, cols = shape(qtype)
    raw = random_blocks(qtype, rows, cols)
    ref = reference(raw, qtype, cols)
    assert np.array_equal(ops.gguf_dequantize(raw, qtype, cols).numpy(), ref)
    ids = torch.tensor([36, 0, 17, 16, 5], dtype=torch.int64)
    assert np.array_equal(ops.gguf_dequantize_rows(raw, qtype, cols, ids, False, torch.float32).numpy(), ref[ids])
    bf = ops.gguf_dequantize(raw, qtype, cols, torch.bfloat16)
    assert torch.equal(bf, torch.from_numpy(ref).bfloat16())


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K, T.Q4_K, T.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("r16", [False, True])
@pytest.mark.parametrize("n", [1, 3, 11])
def test_refine_top_in_one_call(qtype, r16, n):
    """An LM head's top REFINE_TOP logits of each row rescored in one C call (ops.gguf_refine_top: the rows from
    the blocks, or from R16) equal the torch path's (ops.refine_top over gguf-py's dequantized rows) to float32
    rounding, the top chosen the same and every other logit left as it was; rows past 8 over threads."""
    if r16 and not vnni():
        pytest.skip("the CPU has no AVX512-VNNI (R16 kernels)")
    vocab, cols = 300, 2 * GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, vocab, cols, seed=3)
    w = torch.from_numpy(reference(raw, qtype, cols))
    torch.manual_seed(0)
    hidden = torch.randn(n, cols)
    out = hidden @ w.T + torch.randn(n, vocab) * 0.5  # the quantized product's error, roughly
    expect, top = out.clone(), ops.top_indices(out, ops.REFINE_TOP)  # the candidates: the noisy logits' best
    ops.refine_top(expect, hidden, lambda top: w[top])
    data = ops.gguf_repack_r16(raw, qtype, cols) if r16 else raw
    assert ops.gguf_refine_top(out, hidden, data, qtype, r16)
    torch.testing.assert_close(out, expect, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.gather(1, top), (hidden @ w.T).gather(1, top), atol=1e-4, rtol=1e-5)  # exact
    untouched = torch.ones_like(out, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(out[untouched], expect[untouched])


@pytest.mark.parametrize("qtype", R16_TYPES, ids=lambda t: t.name)
def test_r16_repack_is_lossless(qtype):
    rows, cols = shape(qtype)
    raw = random_blocks(qtype, rows, cols, seed=1)
    if not r16_int8(qtype):
        assert ops.gguf_repack_r16(raw, qtype, cols, int8=True) is None  # nothing would run it
        pytest.skip(f"the CPU has no R16 kernel for {qtype.name}")
    r16 = ops.gguf_repack_r16(raw, qtype, cols, int8=True)
    assert r16 is not None and r16.shape[0] == 3  # ceil(37 / 16) groups
    # the same bytes, up to 3% more for the K-quants' expanded scales, plus the padding rows
    assert r16.numel() <= 1.03 * raw[0].numel() * 48
    ids = torch.arange(rows - 1, -1, -1)
    got = ops.gguf_dequantize_rows(r16, qtype, cols, ids, True, torch.float32).numpy()
    assert np.array_equal(got, reference(raw, qtype, cols)[ids.numpy()])


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 7, 8, 9, 64])
def test_linear_float32_is_the_float_product(qtype, M):
    rows, cols = shape(qtype)
    raw = random_blocks(qtype, rows, cols, seed=M)
    w = reference(raw, qtype, cols)
    x = torch.randn(M, cols, generator=torch.Generator().manual_seed(M))
    y_ref = x.double().numpy() @ w.T.astype(np.float64)
    y = ops.gguf_linear(x, raw, qtype, rows, cols, r16=False).double().numpy()
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-5 * np.abs(y_ref).max())


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("path", ["portable", "r16"])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 64])
def test_linear_bfloat16(qtype, path, M):
    """bfloat16 activations: the portable path is the float product rounded to bfloat16; R16 stays within
    what quantizing the activations to int16 per 32 can move, and rounding the output."""
    if path != "portable" and not vnni():
        pytest.skip("the CPU has no AVX512-VNNI (R16 kernels)")
    if path == "r16" and qtype not in R16_TYPES:
        assert ops.gguf_repack_r16(random_blocks(qtype, 16, shape(qtype)[1]), qtype, shape(qtype)[1]) is None
        return  # kept as blocks: the portable case covers it
    rows, cols = shape(qtype)
    raw = random_blocks(qtype, rows, cols, seed=100 + M)
    w = reference(raw, qtype, cols)
    x = torch.randn(M, cols, generator=torch.Generator().manual_seed(M)).bfloat16()
    y_ref = x.double().numpy() @ w.T.astype(np.float64)
    if path == "r16":
        with amx_rows(0):  # the VNNI kernel at every row count (AMX multiplies int8 activations: test_gguf_amx.py)
            y = ops.gguf_linear(x, ops.gguf_repack_r16(raw, qtype, cols), qtype, rows, cols, r16=True)
    else:
        y = ops.gguf_linear(x, raw, qtype, rows, cols, r16=False)
    err = np.abs(y.double().numpy() - y_ref)
    bound = np.abs(y_ref) * 2.0**-8 + 1e-5 if path == "portable" else int16_bound(x, w, y_ref)
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    if path == "r16":  # the output may be a strided view: one projection's columns of a fused output
        wide = torch.zeros(M, rows + 10, dtype=torch.bfloat16)
        with amx_rows(0):
            ops.gguf_linear(
                x, ops.gguf_repack_r16(raw, qtype, cols), qtype, rows, cols, r16=True, out=wide[:, 5 : 5 + rows]
            )
        assert torch.equal(wide[:, 5 : 5 + rows], y) and not wide[:, :5].any() and not wide[:, 5 + rows :].any()


@pytest.mark.skipif(not vnni(), reason="the CPU has no AVX512-VNNI (R16 kernels)")
@pytest.mark.parametrize("int8", [False, True], ids=["int16", "int8"])
def test_r16_bfloat16_output_is_its_float32_output_rounded(int8):
    """The R16 kernel's bfloat16 output is its own float32 output rounded to nearest even, as torch rounds, bit for
    bit (the kernels round with integer ops: no AVX512-BF16 needed). 1M outputs hold ties (low 16 bits 0x8000) of
    both parities, so a round-half-up also fails."""
    qtype, rows, cols, M = T.Q8_0, 16384, 64, 64
    data = ops.gguf_repack_r16(random_blocks(qtype, rows, cols, seed=7), qtype, cols)
    x = torch.randn(M, cols, generator=torch.Generator().manual_seed(7)).bfloat16()
    y32 = torch.empty(M, rows)
    with amx_rows(0):
        ops.gguf_linear(x, data, qtype, rows, cols, r16=True, out=y32, int8_activations=int8)
        y16 = ops.gguf_linear(x, data, qtype, rows, cols, r16=True, int8_activations=int8)
    bits = y32.view(torch.int32)
    ties = (bits & 0xFFFF) == 0x8000
    assert ties.sum() >= 4 and (ties & (bits & 0x10000).bool()).any() and (ties & ~(bits & 0x10000).bool()).any()
    assert torch.equal(y16.view(torch.int16), y32.bfloat16().view(torch.int16))


def rounded_int8(x: torch.Tensor, group: int) -> np.ndarray:
    """x rounded as the int8 kernels do: per `group` values, scale max|x| / 127 (float32), round to nearest."""
    M = x.shape[0]
    xb = x.float().numpy().reshape(M, -1, group)  # in float32, as the kernel (ties matter)
    amax = np.abs(xb).max(-1, keepdims=True)
    scale = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    codes = np.rint(xb * scale).astype(np.float64)
    return (codes * (amax / np.float32(127)).astype(np.float64)).reshape(M, -1)


@pytest.mark.parametrize("qtype", R16_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 3, 4, 5, 8, 9, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [3, 33])
def test_r16_int8_activations(qtype, M, dtype, blocks):
    """gguf_r16_linear_i8 (vpdpbusd) is the dequantized weights' product with the activations rounded to int8 per
    32 (llama.cpp's Q8_0 activations), or per 256 against the K-quants (its Q8_K), to float rounding: the offsets
    (mins, Q4_0's -8, Q8_0's -128, Q6_K's -32) meet the rounded activations' sums. Row counts past its 8-row pass
    and a strided output included; 33 blocks take the 512-value spans of the rounding (prepare_span8) and a block
    of zeros. With AVX2 alone, the same bound for gguf_r16_avx2.c's kernels (4 rows a pass: 4, 5 and 9 rows)."""
    if not r16_int8(qtype):
        pytest.skip(f"the CPU has no R16 int8 kernel for {qtype.name}")
    rows, cols = 37, blocks * GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, rows, cols, seed=300 + M)
    w = reference(raw, qtype, cols).astype(np.float64)
    x = torch.randn(M, cols, generator=torch.Generator().manual_seed(M)).to(dtype)
    x += torch.linspace(-1, 3, cols).to(dtype)  # a nonzero mean per block, so an exact-sum offset term shows
    x[0, 32:64] = 0
    xq = rounded_int8(x, 256 if qtype in SUPER_BLOCK_TYPES else 32)
    y_ref = xq @ w.T
    r16 = ops.gguf_repack_r16(raw, qtype, cols, int8=True)
    wide = torch.zeros(M, rows + 10, dtype=dtype)
    with amx_rows(0):
        y = ops.gguf_linear(x, r16, qtype, rows, cols, r16=True, int8_activations=True)
        ops.gguf_linear(x, r16, qtype, rows, cols, r16=True, out=wide[:, 5 : 5 + rows], int8_activations=True)
    bound = 1e-5 * (np.abs(xq) @ np.abs(w.T)) + 1e-6
    if dtype == torch.bfloat16:
        bound += np.abs(y_ref) * 2.0**-8
    err = np.abs(y.double().numpy() - y_ref)
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    assert np.abs(y.double().numpy() - x.double().numpy() @ w.T).max() > 1e-3  # not the int16 path
    assert torch.equal(wide[:, 5 : 5 + rows], y) and not wide[:, :5].any() and not wide[:, 5 + rows :].any()


def test_gguf_tensor_repacks_only_where_the_cpu_can():
    """Q4_1 repacks with AVX512-VNNI, or with AVX2 where the activations are int8 (the default; not the tests'
    float32 one); Q8_0 with VNNI only."""
    raw = random_blocks(T.Q4_1, 20, 64)
    t = GGUFTensor(T.Q4_1, raw.clone(), 64)
    t.repack()
    assert t.r16 == (vnni() or (q8() and gguf_quant.r16_int8())) and t.rows == 20
    q8_0 = GGUFTensor(T.Q8_0, random_blocks(T.Q8_0, 20, 64), 64)
    q8_0.repack()
    assert q8_0.r16 == vnni()
    ids = torch.tensor([19, 3])
    assert np.array_equal(t.dequantize_rows(ids, torch.float32).numpy(), reference(raw, T.Q4_1, 64)[ids])


@pytest.mark.skipif(not vnni(), reason="the CPU has no AVX512-VNNI (R16 kernels)")
@pytest.mark.parametrize("min_rows", [R16_COPY_MIN_ROWS, R16_COPY_HEAD_MIN_ROWS], ids=["layer", "LM head"])
def test_an_r16_copy_takes_steps_of_many_rows(min_rows):
    """A Q8_0 weight that keeps its blocks (over R16_Q8_0_MAX_BYTES) gets an R16 copy: a step of its
    copy_min_rows rows or more (R16_COPY_MIN_ROWS; an LM head's R16_COPY_HEAD_MIN_ROWS) runs on the copy (its result
    is the repacked weight's, bit for bit), fewer on the blocks; both are the weight's product to int8 activations'
    rounding."""
    raw = random_blocks(T.Q8_0, 48, 256, seed=5)
    t = GGUFTensor(T.Q8_0, raw.clone(), 256, copy_min_rows=min_rows)
    t.add_r16_copy()
    assert not t.r16 and t.r16_copy is not None and torch.equal(t.data, raw)
    packed = GGUFTensor(T.Q8_0, raw.clone(), 256)
    packed.repack()
    w = torch.from_numpy(reference(raw, T.Q8_0, 256))
    # a zeroed copy shows which form a step read
    poisoned = GGUFTensor(T.Q8_0, raw.clone(), 256, r16_copy=torch.zeros_like(t.r16_copy), copy_min_rows=min_rows)
    for M in (1, R16_COPY_MIN_ROWS - 1, R16_COPY_MIN_ROWS, 64):
        x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M))
        with amx_rows(0):
            y, y_packed, y_poisoned = t.matmul(x), packed.matmul(x), poisoned.matmul(x)
        torch.testing.assert_close(y, x @ w.T, atol=0.05 * float((x.abs() @ w.abs().T).max()) / 127, rtol=0)
        if M >= min_rows:
            assert torch.equal(y, y_packed) and not y_poisoned.any()
        else:
            assert torch.equal(y, y_poisoned)


def q8() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.gguf_q8_isa())


@pytest.mark.skipif(not q8(), reason="the CPU has no AVX2")
@pytest.mark.parametrize("qtype", Q8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 3, 8, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_int8_activations(qtype, M, dtype):
    """The AVX2 kernel computes llama.cpp's arithmetic: the dequantized weights against the activations rounded
    to int8 per 32 (scale max|x| / 127, round to nearest; per 256 for Q4_K, Q5_K and Q6_K, llama.cpp's Q8_K), to
    float rounding; an offset type's (Q4_1, Q5_1, Q4_K, Q5_K, and Q6_K's 32) min meets the rounded activations' sum,
    not the exact one (that left m sum(x - xq) in every output). 21 rows run as groups of 8, 8 and 5 (Q6_K: 4 at a
    time) over tiles of weight rows; 7 blocks of 32 per row run as four at a time (q8_quad) and three alone.
    Another type is refused."""
    rows, cols = shape(qtype)
    if GGML_QUANT_SIZES[qtype][0] == 32:
        cols = 7 * 32
    raw = random_blocks(qtype, rows, cols, seed=200 + M)
    w = reference(raw, qtype, cols).astype(np.float64)
    x = torch.randn(M, cols, generator=torch.Generator().manual_seed(M)).to(dtype)
    x += torch.linspace(-1, 3, cols).to(dtype)  # a nonzero mean per block, so an exact-sum offset term shows
    xq = rounded_int8(x, 256 if qtype in SUPER_BLOCK_TYPES else 32)
    y_ref = xq @ w.T
    y = ops.gguf_linear(x, raw, qtype, rows, cols, r16=False, int8_activations=True).double().numpy()
    bound = 1e-5 * (np.abs(xq) @ np.abs(w.T)) + 1e-6
    if dtype == torch.bfloat16:
        bound += np.abs(y_ref) * 2.0**-8
    err = np.abs(y - y_ref)
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    assert np.abs(y - x.double().numpy() @ w.T).max() > 1e-3  # not the exact path
    with pytest.raises(ValueError):
        q3 = random_blocks(T.Q3_K, 4, 256)
        ops.gguf_linear(torch.zeros(1, 256), q3, T.Q3_K, 4, 256, r16=False, int8_activations=True)
