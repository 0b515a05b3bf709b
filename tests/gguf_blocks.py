"""Random ggml blocks of every quantized type our kernels read, for the kernel and model tests: random bytes
(every byte pattern is a valid block) with float16 scales in a sane range, so the weights look like a
model's."""

import contextlib

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from models.kernels import cpu_kernels
from models.quantization.gguf import amx_min_rows, amx_tiles


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, row_bytes] of random blocks whose float16 scales are sane (random bytes elsewhere)."""
    rng = np.random.default_rng(seed)
    bw, bb = GGML_QUANT_SIZES[qtype]
    nb = rows * cols // bw
    raw = rng.integers(0, 256, size=(nb, bb), dtype=np.uint8)

    def put(offset, low, high):
        raw[:, offset : offset + 2] = rng.uniform(low, high, (nb, 1)).astype(np.float16).view(np.uint8)

    if qtype in (T.Q4_0, T.Q8_0, T.Q5_0, T.IQ4_NL, T.IQ4_XS):
        put(0, -0.02, 0.02)
    elif qtype in (T.Q4_1, T.Q5_1):
        put(0, 0, 0.02), put(2, -0.1, 0.1)
    elif qtype in (T.Q4_K, T.Q5_K):
        put(0, 0, 0.002), put(2, 0, 0.002)
    elif qtype == T.Q6_K:
        put(208, -0.002, 0.002)
    elif qtype == T.Q2_K:
        put(80, 0, 0.002), put(82, 0, 0.002)
    elif qtype == T.Q3_K:
        put(108, -0.002, 0.002)
    elif qtype == T.MXFP4:  # E8M0 scales 2^-13 .. 2^-4 (and 0 and 1, ggml's subnormal scales, in a few blocks)
        raw[:, 0] = rng.integers(115, 124, size=nb)
        raw[:2, 0] = (0, 1)
    return torch.from_numpy(raw.reshape(rows, -1))


@contextlib.contextmanager
def amx_rows(min_rows: int):
    """R16 products take the AMX tiles from `min_rows` rows of x (0: never) inside the block; the process's own
    setting (models/quantization/gguf.py amx_tiles) after it."""
    lib = cpu_kernels.load()
    assert lib.gguf_amx_enable(min_rows) == 0
    try:
        yield
    finally:
        lib.gguf_amx_enable(amx_min_rows() if amx_tiles() else 0)
