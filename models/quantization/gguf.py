"""GGUF's quantized weights kept as the file holds them (llama.cpp's ggml block formats).

A `GGUFTensor` is one 2-D weight of a GGUF file: its rows are whole ggml blocks (32 or 256 weights
each), so a row range is a byte range and rows can be permuted or stacked without touching a block.
Layers (models/layers/linear.py) built with a `GGUFConfig` hold such weights and compute with the
kernels of models/kernels/csrc/gguf_linear.c; vLLM's GGUF support (vllm/model_executor/layers/
quantization/gguf.py) has the same shape: a config that hands each layer its method.
"""

import functools
import logging
import os
import sys
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.kernels import cpu_kernels, ops

logger = logging.getLogger(__name__)

# ggml types whose blocks the C kernels (models/kernels/csrc/gguf_linear.c) compute with: every one on the portable
# path, exactly as gguf-py dequantizes them
QUANTIZED_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_XS,
    GGMLQuantizationType.MXFP4,
)
# of those, the ones the AVX512-VNNI kernel has a repacked (R16) layout for; the others keep their blocks (the
# portable kernel for a few rows, dequantize + GEMM for more) on every CPU
R16_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.MXFP4,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
# floating-point types, converted to the model dtype at load
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# rows of x up to which the portable kernel beats dequantize-then-GEMM on weights kept as blocks
PORTABLE_MAX_ROWS = 8
# a Q8_0 weight over this many bytes keeps its blocks for the AVX2 int8 kernel (float32 and bfloat16 activations
# alike), every other repacks for the AVX512-VNNI kernel: at one row a large weight streams from DRAM, and the VNNI
# kernel on int8 activations read large Q8_0 weights at 26-30 GB/s against the blocks' 36-45 (the default model's
# 30 MB LM head; gpt-oss-20b's 615 MB one, bfloat16 activations, read faster from its blocks too), the other R16
# types as fast as or faster than their blocks (Q4_K 32-39 GB/s against 29-37, Q6_K 32-37 against 28-34,
# prefetching whole records), and 1.3-2.5x faster from a few rows; the Llama-3.2-1B shape's batch-1 decode took
# 17-24 ms all repacked against 23-28 with its >8 MiB weights on blocks (AMD EPYC with AVX512-VNNI, 2 threads:
# docs/benchmarks.md); on AMD's CPUs only (q8_0_blocks_at_one_row). An LM head's copy, measured since with the
# current kernels, takes its one-row products too (R16_COPY_HEAD_MIN_ROWS)
R16_Q8_0_MAX_BYTES = 8 << 20
# such a weight also gets an R16 copy for steps of at least this many rows: the blocks' AVX2 kernel ran the default
# model's LM head at 64 rows at 90 GMAC/s against the VNNI kernel's 255 (a W64 decode step's LM head 23 -> 9 ms), for
# the copy's bytes (30 MB there) kept beside the blocks
R16_COPY_MIN_ROWS = 4
# an LM head's (or tied embedding's) copy from one row: a product over the vocabulary read whole each step, where the
# repacked layout streamed faster than the blocks at one row too. The default model's 30 MB head on a Zen 5 EPYC
# (AVX512-VNNI, 2 threads), the two forms alternating every 8 steps of one engine at batch 1: a step 3.70 -> 3.57 and
# 4.57 -> 4.40 ms (docs/benchmarks.md); a Q8_0 layer weight keeps its blocks at one row, since the 1B shape as Q8_0
# read its layer weights over R16_Q8_0_MAX_BYTES faster from them
R16_COPY_HEAD_MIN_ROWS = 1
# the AVX2 int8 kernel (8 rows of x at a time over L1-sized weight tiles) takes every row count, prompts included, as
# llama.cpp runs them on int8 activations: at 512 rows it ran Qwen3.5-2B's Q4_K and Q6_K shapes 1.2-1.7x faster than
# dequantizing the weight for torch's float32 GEMM, and was even with that on the default model's Q4_1 shapes (AVX2
# EPYC, 2 threads)
# the types whose blocks the AVX2 kernel multiplies with int8 activations (llama.cpp's arithmetic) by default;
# with MINIVLLM_GGUF_ACTIVATIONS=float they take the exact float32 portable kernel. IQ4_NL and MXFP4 (gpt-oss's
# experts) take their values through a byte-shuffle table
Q8_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.MXFP4,
)


# MINIVLLM_GGUF_KERNEL: which kernel family quantized linears take. auto: AMX tiles from amx_min_rows() rows where the
# probe passes, else the AVX512-VNNI kernel on repacked weights (bfloat16 activations, and float32 ones unless
# MINIVLLM_GGUF_ACTIVATIONS=float) or the AVX2 int8 / portable kernels on blocks; vnni: never AMX; amx: AMX tiles for
# every row count of repacked weights (refused at load where AMX cannot run); avx2: the AVX2 int8 kernel on the
# file's blocks, no repacking (what a CPU without AVX512-VNNI runs); portable: the exact float32 kernel on blocks, no
# repacking, no int8 activations (the reference). The AMX kernel (models/kernels/csrc/gguf_amx.c) dequantizes the
# weights to bfloat16 tiles: W4A16, as vLLM-CPU's AMX kernel for int4 checkpoints computes
GGUF_KERNELS = ("auto", "portable", "vnni", "amx", "avx2")
# MINIVLLM_GGUF_ACTIVATIONS's values (activations_mode)
ACTIVATION_MODES = ("int8", "int16", "float")
# rows of x from which repacked weights take the AMX tiles by default: at 8 the tiles and the VNNI kernel were even,
# at 16 the tiles 1.75-2.6x faster, on every shape of the default model and the 1B shape (an Emerald Rapids Xeon, 2
# threads: docs/benchmarks.md); fewer rows are memory-bound and keep the VNNI kernel
AMX_MIN_ROWS = 16
# the same against the VNNI kernel on int8 activations (the default, r16_int8), twice the int16 one's rate: on the
# pool's AMX Xeon (2 threads, scripts/bench_amx.py, every shape of the default model and the 1B shape) the tiles ran
# at 0.66-1.16x its speed at 16 rows over two runs, 0.88-1.13x at 20, 1.01-1.24x at 24 and 1.17-1.46x at 28
AMX_MIN_ROWS_INT8 = 24
# why gguf_amx_probe() refused the tiles, by its status
AMX_REFUSALS = {
    0: "the CPU has no AMX-BF16 (or no AVX512-BF16 or AVX512-VBMI)",
    -1: "the OS does not enable the AMX tile state (XCR0)",
    -2: "Linux refused the AMX tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM)",
    -3: "the first AMX tile instruction raised SIGILL",
    -4: "the first AMX tile instruction gave a wrong result",
}


@functools.cache
def gguf_kernel() -> str:
    """MINIVLLM_GGUF_KERNEL (read once per process): one of GGUF_KERNELS. Raises ValueError for another value."""
    mode = os.environ.get("MINIVLLM_GGUF_KERNEL", "auto")
    if mode not in GGUF_KERNELS:
        raise ValueError(f"MINIVLLM_GGUF_KERNEL={mode!r}: expected one of {', '.join(GGUF_KERNELS)}")
    return mode


@functools.cache
def amx_tiles() -> bool:
    """Whether repacked (R16) weights take the AMX kernel (models/kernels/csrc/gguf_amx.c) in this process:
    probes the CPU once (CPUID, the OS's tile state, Linux's tile-data permission requested for the process, one
    tile op checked under a SIGILL guard) and turns the tiles on from amx_min_rows() rows (every row count with
    MINIVLLM_GGUF_KERNEL=amx; never with MINIVLLM_GGUF_ACTIVATIONS=float unless forced so: the tiles round the
    weights to bfloat16). Where the probe fails on a CPU that has AMX, logs one line naming why and keeps the
    VNNI kernel. Raises ValueError when MINIVLLM_GGUF_KERNEL=amx and AMX cannot run, naming why."""
    mode, lib = gguf_kernel(), cpu_kernels.load()
    if lib is None or mode in ("portable", "vnni", "avx2") or (mode == "auto" and activations_mode() == "float"):
        if lib is not None:
            lib.gguf_amx_enable(0)
        return False
    status = lib.gguf_amx_probe()
    if status != 1:
        reason = AMX_REFUSALS.get(status, f"probe status {status}")
        if mode == "amx":
            raise ValueError(f"MINIVLLM_GGUF_KERNEL=amx: {reason}")
        if status != 0:
            logger.warning("AMX tiles not used: %s; quantized linears run on AVX512-VNNI", reason)
        return False
    return lib.gguf_amx_enable(1 if mode == "amx" else amx_min_rows()) == 0


def amx_min_rows() -> int:
    """Rows of x from which R16 weights take the AMX tiles by default: AMX_MIN_ROWS_INT8 where the VNNI kernel
    below them runs on int8 activations (r16_int8), else AMX_MIN_ROWS."""
    return AMX_MIN_ROWS_INT8 if r16_int8() else AMX_MIN_ROWS


def activations_mode() -> str:
    """MINIVLLM_GGUF_ACTIVATIONS: "int8" (default), "int16" or "float" (read by the cached int8_activations,
    r16_int8 and amx_tiles, so once per process). int8: every quantized kernel quantizes the activations to int8
    per 32, as llama.cpp; int16: the VNNI kernel on repacked weights keeps int16 activations (the blocks' AVX2
    kernel int8); float: the exact float32 kernel on blocks (bfloat16 activations still take the VNNI kernel, on
    int16). Raises ValueError for another value."""
    mode = os.environ.get("MINIVLLM_GGUF_ACTIVATIONS", "int8")
    if mode not in ACTIVATION_MODES:
        raise ValueError(f"MINIVLLM_GGUF_ACTIVATIONS={mode!r}: expected one of {', '.join(ACTIVATION_MODES)}")
    return mode


@functools.cache
def r16_int8() -> bool:
    """Whether the AVX512-VNNI kernel on repacked (R16) weights quantizes the activations to int8 per 32
    (gguf_r16_linear_i8: vpdpbusd, 64 multiply-adds per instruction, llama.cpp's Q8_0 activations) rather than
    int16 (vpdpwssd, 32): with MINIVLLM_GGUF_ACTIVATIONS=int8, the default (read once). 1.4-1.8x faster from 64
    rows and 1.3-1.5x at one row; perplexity in docs/benchmarks.md. Raises ValueError for a bad value."""
    return activations_mode() == "int8"


@functools.cache
def int8_activations() -> bool:
    """Whether few-row products on Q8_TYPES blocks quantize the activations to int8 per 32 (the AVX2 kernel, as
    llama.cpp computes): on a CPU with AVX2 unless MINIVLLM_GGUF_ACTIVATIONS=float (read once), which keeps the
    exact float32 kernel for comparison. 4.5x faster batch-1 decode on an AVX2-only EPYC at the default model's
    float32 perplexity (docs/benchmarks.md). Raises ValueError for another value of the variable."""
    if activations_mode() == "float" or gguf_kernel() == "portable":
        return False
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.gguf_q8_isa())


@functools.cache
def q8_0_blocks_at_one_row() -> bool:
    """Whether a Q8_0 weight over R16_Q8_0_MAX_BYTES keeps its blocks (the AVX2 int8 kernel at one row, an R16 copy
    for more): on AMD's CPUs, whose one-row reads of large Q8_0 weights were faster from the blocks (the EPYCs of
    R16_Q8_0_MAX_BYTES's note). Intel's read the R16 layout faster, so there every Q8_0 weight repacks: on an Intel
    Xeon with AVX512-VNNI (family 6 model 207, no AVX512-BF16, 2 threads) the default model's 30 MB LM head at one
    row took 0.82 ms repacked against 1.48 ms from its blocks, and batch-1 decode ~10% less time a token
    (docs/benchmarks.md). From /proc/cpuinfo's vendor_id, read once; a CPU that names no vendor keeps the blocks."""
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        vendor = ""
    return vendor != "GenuineIntel"


@dataclass
class GGUFTensor:
    """A quantized 2-D weight standing for a float [rows, cols] matrix (torch order: out, in).

    qtype: its GGMLQuantizationType. data: uint8 [rows, row_bytes] of ggml blocks as in the file, or
    after `repack()` the R16 layout of the VNNI kernel (`r16` True; uint8 [ceil(rows / 16), 16 * row_bytes],
    models/kernels/csrc/gguf_linear.c), lossless either way.
    """

    qtype: GGMLQuantizationType
    data: torch.Tensor
    cols: int
    rows: int = -1
    r16: bool = False
    r16_copy: torch.Tensor | None = None  # add_r16_copy: the blocks' R16 form, for steps of copy_min_rows rows
    copy_min_rows: int = R16_COPY_MIN_ROWS  # R16_COPY_HEAD_MIN_ROWS for an LM head's (GGUFEmbeddingMethod)

    def __post_init__(self):
        if self.rows < 0:
            self.rows = self.data.shape[0]

    @staticmethod
    def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
        """Bytes of one row of `cols` weights. Raises ValueError when cols is not a whole number of blocks."""
        block, nbytes = GGML_QUANT_SIZES[qtype]
        if cols % block:
            raise ValueError(f"{qtype.name} rows of {cols} weights are not whole blocks of {block}")
        return cols // block * nbytes

    def row_range(self, start: int, count: int) -> "GGUFTensor":
        """Rows start .. start + count - 1 (a fused checkpoint tensor's part, an expert of a stacked MoE tensor):
        whole blocks, so a byte range; after `repack`, whole 16-row groups. Raises ValueError for a range that
        splits a repacked group (rows are interleaved there)."""
        if self.r16:
            if start % 16 or (count % 16 and start + count != self.rows):
                raise ValueError(f"rows {start}..{start + count - 1} split a repacked tensor's 16-row groups")
            return GGUFTensor(self.qtype, self.data[start // 16 : (start + count + 15) // 16], self.cols, count, True)
        return GGUFTensor(self.qtype, self.data[start : start + count], self.cols)

    def select_rows(self, rows: torch.Tensor) -> "GGUFTensor":
        """The rows `rows` (int64, any order: a permutation or a subset), each row's blocks copied whole. Raises
        ValueError after `repack` (rows are interleaved then)."""
        if self.r16:
            raise ValueError("rows of a repacked tensor are interleaved")
        return GGUFTensor(self.qtype, self.data[rows].contiguous(), self.cols)

    def repack(self) -> None:
        """Repacks to R16 where the CPU and the type allow it for r16_int8()'s activations (AVX512-VNNI: every R16
        type; AVX2 alone: int8 activations, all but Q8_0), unless MINIVLLM_GGUF_KERNEL=portable or avx2 (the
        blocks' AVX2 kernel; else keeps the blocks)."""
        if self.r16 or gguf_kernel() in ("portable", "avx2"):
            return
        packed = ops.gguf_repack_r16(self.data, self.qtype, self.cols, r16_int8())
        if packed is not None:
            self.data, self.r16 = packed, True

    def add_r16_copy(self) -> None:
        """Keeps an R16 copy beside the blocks (where the CPU and the type allow it) for matmuls of at least
        copy_min_rows rows."""
        if not self.r16 and gguf_kernel() not in ("portable", "avx2"):
            self.r16_copy = ops.gguf_repack_r16(self.data, self.qtype, self.cols, r16_int8())

    @property
    def int8(self) -> bool:
        """Whether products quantize the activations to int8: repacked weights where r16_int8(), blocks of
        Q8_TYPES (the AVX2 int8 kernel) where int8_activations()."""
        return r16_int8() if self.r16 else self.qtype in Q8_TYPES and int8_activations()

    @property
    def kernel_rows(self) -> int:
        """Rows of x up to which blocks take the C kernel rather than dequantizing for torch's GEMM (every row
        count for the int8 and R16 kernels)."""
        return sys.maxsize if self.int8 or self.r16 else PORTABLE_MAX_ROWS

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, cols] @ W^T -> [M, rows] in x's dtype (into `out` if given). Q8_TYPES blocks take the AVX2 int8
        kernel where int8_activations(), at every M; other blocks (float32 activations, or a CPU without VNNI) the
        portable kernel for up to PORTABLE_MAX_ROWS rows, and for more the weight dequantized once for torch's GEMM,
        which is faster then."""
        if self.r16_copy is not None and x.shape[0] >= self.copy_min_rows:
            return ops.gguf_linear(x, self.r16_copy, self.qtype, self.rows, self.cols, True, out, r16_int8())
        if self.r16 or x.shape[0] <= self.kernel_rows:
            return ops.gguf_linear(x, self.data, self.qtype, self.rows, self.cols, self.r16, out, self.int8)
        y = ops.linear(x, ops.gguf_dequantize(self.data, self.qtype, self.cols, x.dtype))
        return y if out is None else out.copy_(y)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (int64 [n]) as floats [n, cols] in `dtype`."""
        return ops.gguf_dequantize_rows(self.data, self.qtype, self.cols, ids, self.r16, dtype)


class GGUFLinearMethod:
    """One linear layer's weights as GGUF blocks: the layer's stacked projections (q | k | v, gate | up,
    or one), each loaded whole from its own GGUF tensor (quantized, or float for F32/F16/BF16 tensors).

    After loading, consecutive projections of one type are stacked into one segment, so a Q4_K_M layer
    whose v is Q6_K runs two kernel calls and a uniform layer one. apply: x [M, input_size] (float32 or
    bfloat16) -> y [M, sum(output_sizes)] in `out_dtype` (default x's). vLLM's counterpart: GGUFLinearMethod.
    """

    def __init__(self, output_sizes: list[int], input_size: int):
        self.output_sizes, self.input_size = output_sizes, input_size
        self.shards: dict[int, GGUFTensor | torch.Tensor] = {}
        self.segments: list[tuple[int, GGUFTensor | torch.Tensor]] = []  # (first output column, weight)

    def load(self, shard_id: int, loaded: "GGUFTensor | torch.Tensor") -> None:
        """Takes projection `shard_id` whole. Raises ValueError when its shape is not the layer's."""
        rows, cols = (loaded.rows, loaded.cols) if isinstance(loaded, GGUFTensor) else tuple(loaded.shape)
        if (rows, cols) != (self.output_sizes[shard_id], self.input_size):
            raise ValueError(
                f"weight of shape [{rows}, {cols}] for a projection of "
                f"[{self.output_sizes[shard_id]}, {self.input_size}]"
            )
        self.shards[shard_id] = loaded

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        """Stacks the loaded projections into segments (float ones in `dtype`, but F16 and BF16 ones kept 16-bit
        under float32: half the bytes, the same values) and repacks the quantized ones for the R16 kernels where the
        CPU has them (AVX512-VNNI: int8 activations per 32, or int16 with MINIVLLM_GGUF_ACTIVATIONS=int16; AVX2
        alone: gguf_r16_avx2.c's, int8 activations, every R16 type but Q8_0; Q8_0 weights over R16_Q8_0_MAX_BYTES
        keep their blocks on AMD's CPUs (q8_0_blocks_at_one_row) for the AVX2 int8 kernel, faster there at one row,
        with an R16 copy for steps of R16_COPY_MIN_ROWS rows), except with MINIVLLM_GGUF_ACTIVATIONS=float, which
        keeps the blocks for the exact float32 kernel (bfloat16 activations repack all the same); probes AMX
        (amx_tiles). Raises ValueError when a projection is missing, for a bad MINIVLLM_GGUF_ACTIVATIONS or
        MINIVLLM_GGUF_KERNEL, or for MINIVLLM_GGUF_KERNEL=amx where AMX cannot run (read here, at load, rather than
        at a request's first step)."""
        int8_activations()
        r16_int8()
        amx_tiles()
        missing = [i for i in range(len(self.output_sizes)) if i not in self.shards]
        if missing:
            raise ValueError(f"projections {missing} of a stacked layer were not in the file")
        start = 0
        for i in range(len(self.output_sizes)):
            w = self.shards.pop(i)
            if not isinstance(w, GGUFTensor) and not (dtype == torch.float32 and w.dtype in HALF_DTYPES):
                w = w.to(dtype)  # F16 / BF16 under float32 activations stay 16-bit: ops.linear_half
            last = self.segments[-1][1] if self.segments else None
            if isinstance(w, GGUFTensor) and isinstance(last, GGUFTensor) and last.qtype == w.qtype:
                last.data = torch.cat([last.data, w.data])
            elif isinstance(w, torch.Tensor) and isinstance(last, torch.Tensor) and last.dtype == w.dtype:
                self.segments[-1] = (self.segments[-1][0], torch.cat([last, w]))
            else:
                self.segments.append((start, w))
            start += self.output_sizes[i]
        for _, w in self.segments:
            if isinstance(w, GGUFTensor):
                w.rows = w.data.shape[0]
                large_q8 = (
                    w.qtype == GGMLQuantizationType.Q8_0
                    and w.data.nbytes > R16_Q8_0_MAX_BYTES
                    and q8_0_blocks_at_one_row()
                )
                if large_q8 and activations_mode() != "float":
                    w.add_r16_copy()
                elif dtype == torch.bfloat16 or activations_mode() != "float":
                    w.repack()

    @property
    def nbytes(self) -> int:
        return sum(
            w.data.nbytes + (0 if w.r16_copy is None else w.r16_copy.nbytes) if isinstance(w, GGUFTensor) else w.nbytes
            for _, w in self.segments
        )

    def formats(self) -> set[str]:
        return {
            w.qtype.name if isinstance(w, GGUFTensor) else str(w.dtype).removeprefix("torch.") for _, w in self.segments
        }

    def apply(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if len(self.segments) == 1 and out_dtype in (None, x.dtype):
            return _matmul(x, self.segments[0][1])
        y = x.new_empty(x.shape[0], sum(self.output_sizes), dtype=out_dtype or x.dtype)
        for start, w in self.segments:
            rows = w.rows if isinstance(w, GGUFTensor) else w.shape[0]
            _matmul(x, w, y[:, start : start + rows])
        return y


def _matmul(x: torch.Tensor, w: "GGUFTensor | torch.Tensor", out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T into `out` (or a new tensor)."""
    if isinstance(w, GGUFTensor):
        return w.matmul(x, out)
    if x.dtype == torch.float32 and w.dtype in HALF_DTYPES:  # an F16 / BF16 weight kept 16-bit
        y = ops.linear_half(x, w)
    else:
        y = ops.linear(x.to(w.dtype), w)  # a float weight (F16/BF16/F32 in the file) in the model dtype
    return y.to(x.dtype) if out is None else out.copy_(y)


class GGUFEmbeddingMethod:
    """A token embedding (and LM head, tied or not) as GGUF blocks: [vocab, hidden] rows.

    embedding: ids int64 [T] -> [T, hidden] in `dtype`, the looked-up rows dequantized. logits:
    hidden [N, hidden] -> float32 [N, vocab] through the quantized kernel, then each row's
    REFINE_TOP best rescored exactly in float32 against their dequantized rows (as ops.logits does for
    a bfloat16 head): int8 activations may reorder near ties, the exact rescoring keeps the greedy
    choice and the reported logprobs those of the float weights.
    """

    def __init__(self, vocab_size: int, hidden_size: int):
        self.linear = GGUFLinearMethod([vocab_size], hidden_size)
        self.dtype = torch.float32

    def load(self, loaded: "GGUFTensor | torch.Tensor") -> None:
        self.linear.load(0, loaded)

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        """The linear method's (GGUFLinearMethod), its weight's R16 copy, where it has one, taken for logits from
        R16_COPY_HEAD_MIN_ROWS rows (the embedding's rows are read from the blocks)."""
        self.linear.process_weights_after_loading(dtype)
        self.dtype = dtype
        if isinstance(self.weight, GGUFTensor):
            self.weight.copy_min_rows = R16_COPY_HEAD_MIN_ROWS

    @property
    def weight(self) -> "GGUFTensor | torch.Tensor":
        return self.linear.segments[0][1]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized rows [len(ids), hidden] of token ids (int64 [T])."""
        w = self.weight
        return w[ids].to(dtype) if isinstance(w, torch.Tensor) else w.dequantize_rows(ids, dtype)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids, self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.linear.apply(hidden).float()
        w = self.weight
        if isinstance(w, GGUFTensor) and ops.gguf_refine_top(out, hidden, w.data, w.qtype, w.r16):
            return out
        ops.refine_top(out, hidden, lambda top: self.rows(top.flatten(), torch.float32).view(*top.shape, -1))
        return out


class GGUFMoEMethod:
    """A mixture-of-experts layer's expert weights as the GGUF file holds them: gate, up and down of every expert,
    one tensor per projection (llama.cpp's `ffn_{gate,up,down}_exps`): a GGUFTensor of E * rows rows (expert e's
    rows a byte range) or, from an F32/F16/BF16 file, a float [E, rows, cols] tensor. `shapes`: each
    projection's (rows, cols) for one expert. models/layers/fused_moe.py computes with it; vLLM's counterpart is
    GGUFMoEMethod."""

    def __init__(self, num_experts: int, shapes: list[tuple[int, int]]):
        self.num_experts, self.shapes = num_experts, shapes
        self.blocks: list = [None] * len(shapes)

    def load(self, proj: int, loaded: "GGUFTensor | torch.Tensor") -> None:
        """Takes projection `proj` (0 gate, 1 up, 2 down) for every expert. Raises ValueError on another shape."""
        if isinstance(loaded, GGUFTensor):
            got = (loaded.rows // self.num_experts, loaded.cols)
        else:
            got = tuple(loaded.shape[-2:])
            loaded = loaded.reshape(self.num_experts, *got)
        if got != self.shapes[proj]:
            raise ValueError(f"expert projection {proj}: {self.shapes[proj]} per expert expected, got {got}")
        self.blocks[proj] = loaded

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        """Float experts into `dtype`; quantized ones repacked for the AVX512-VNNI kernel (R16) where the CPU has it,
        every projection's type has the layout and each expert is whole 16-row groups, as a linear's are, except
        with MINIVLLM_GGUF_ACTIVATIONS=float (the exact float32 kernel on blocks). All three or none: the one-call
        MoE kernel (ops.gguf_moe) takes one layout. Raises ValueError when a projection was not in the file."""
        if any(b is None for b in self.blocks):
            raise ValueError("a quantized MoE layer is missing an expert projection")
        self.blocks = [b if isinstance(b, GGUFTensor) else b.to(dtype) for b in self.blocks]
        quantized = all(isinstance(b, GGUFTensor) and b.qtype in R16_TYPES for b in self.blocks)
        if quantized and activations_mode() != "float" and all(rows % 16 == 0 for rows, _ in self.shapes):
            for b in self.blocks:
                b.repack()

    @property
    def segments(self) -> list[tuple[int, "GGUFTensor | torch.Tensor"]]:
        """The weights, as GGUFLinearMethod lists its own (weight_summary, parameter_count)."""
        return [(0, b) for b in self.blocks]

    def matmul(self, x: torch.Tensor, proj: int, expert: int) -> torch.Tensor:
        """x [n, cols] @ expert `expert`'s projection `proj`^T -> [n, rows] in x's dtype."""
        w = self.blocks[proj]
        if isinstance(w, GGUFTensor):
            rows = self.shapes[proj][0]
            return w.row_range(expert * rows, rows).matmul(x)
        return ops.linear(x, w[expert].to(x.dtype))


class GGUFConfig:
    """Quantization "gguf": layers keep the file's blocks. Hands each layer its method."""

    name = "gguf"

    def linear_method(self, output_sizes: list[int], input_size: int) -> GGUFLinearMethod:
        return GGUFLinearMethod(output_sizes, input_size)

    def embedding_method(self, vocab_size: int, hidden_size: int) -> GGUFEmbeddingMethod:
        return GGUFEmbeddingMethod(vocab_size, hidden_size)

    def moe_method(self, num_experts: int, hidden_size: int, intermediate_size: int) -> GGUFMoEMethod:
        inner = (intermediate_size, hidden_size)
        return GGUFMoEMethod(num_experts, [inner, inner, (hidden_size, intermediate_size)])


def quantized_weights(module: torch.nn.Module) -> list["GGUFTensor | torch.Tensor"]:
    """The weights `module`'s quantization method holds outside its parameters (a linear's segments, an
    embedding's through its linear, an MoE layer's expert blocks): GGUFTensors, or float tensors of F32/F16/BF16
    matrices; [] for a module without one."""
    method = getattr(module, "quant_method", None)
    linear = getattr(method, "linear", method)
    return [] if linear is None else [w for _, w in linear.segments]


def weight_summary(model: torch.nn.Module) -> tuple[dict[str, int], str]:
    """Resident weight bytes of a model by format ("Q4_1 (R16)", "Q8_0", "Q8_0 (R16 copy)", "bfloat16", ...), and
    a line for the start-up log naming which layers run in which format."""
    formats: dict[str, int] = {}
    where: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        for w in quantized_weights(module):
            key = (
                f"{w.qtype.name}{' (R16)' if w.r16 else ''}"
                if isinstance(w, GGUFTensor)
                else str(w.dtype).removeprefix("torch.")
            )
            formats[key] = formats.get(key, 0) + (w.data if isinstance(w, GGUFTensor) else w).nbytes
            where.setdefault(key, set()).add(name.rpartition(".")[2])
            if isinstance(w, GGUFTensor) and w.r16_copy is not None:
                key = f"{w.qtype.name} (R16 copy)"
                formats[key] = formats.get(key, 0) + w.r16_copy.nbytes
                where.setdefault(key, set()).add(name.rpartition(".")[2])
    for name, p in model.named_parameters():
        if p.numel():  # norms, biases (quantized layers' placeholders are empty)
            key = str(p.dtype).removeprefix("torch.")
            formats[key] = formats.get(key, 0) + p.nbytes
            where.setdefault(key, set()).add(name.rpartition(".")[0].rpartition(".")[2])
    line = "; ".join(
        f"{k}: {v / 1e6:.1f} MB ({', '.join(sorted(where[k]))})"
        for k, v in sorted(formats.items(), key=lambda kv: -kv[1])
    )
    return formats, line


def parameter_count(model: torch.nn.Module) -> int:
    """Weights the model holds on this rank, a quantized matrix counted as its rows x cols (what "135M" in a
    model's size means), with float parameters (quantized layers' placeholders are empty)."""
    count = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        count += sum(w.rows * w.cols if isinstance(w, GGUFTensor) else w.numel() for w in quantized_weights(module))
    return count
