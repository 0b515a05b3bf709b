"""The AMX kernel (models/kernels/csrc/gguf_amx.c) on R16 weights of its six types, against gguf-py's dequantized
weights in bfloat16 times the activations in bfloat16; the probe, the forcing setting and the fallback. The kernel
tests run on CPUs with AMX-BF16 (Sapphire Rapids and later; checked on an Emerald Rapids Xeon); elsewhere they
skip saying so."""

import logging

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from models.kernels import cpu_kernels, ops
from models.quantization import gguf as gguf_quant
from models.quantization.gguf import R16_TYPES
from tests.gguf_blocks import amx_rows, random_blocks

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")


def amx() -> bool:
    lib = cpu_kernels.load()
    return lib is not None and lib.gguf_amx_probe() == 1


def dequantize(raw: torch.Tensor, qtype: T, cols: int) -> np.ndarray:
    return quants.dequantize(raw.numpy(), qtype).reshape(raw.shape[0], cols).astype(np.float64)


@pytest.mark.skipif(not amx(), reason="the CPU has no AMX-BF16 (or the OS refuses its tiles)")
@pytest.mark.parametrize("qtype", R16_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [1, 2, 17, 33, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("long_k", [False, True], ids=["K", "long K"])
def test_amx_is_the_bfloat16_product(qtype, M, dtype, long_k):
    """37 weight rows (3 groups of 16: an odd number, the last partial), K of 7 blocks of 32 or 3 super-blocks, or
    (long K) 45 blocks or 5 super-blocks: passes over AMX_KC tile columns of K at a time, the last pass shorter, the
    sums carried between them in the result tiles; M
    rows of x one or two tiles of 16 at a time, the last partial. The result is gguf-py's dequantized weights rounded
    to bfloat16 against the activations in bfloat16, to float32 accumulation (a weight whose float32 value sits
    at a bfloat16 tie may round the other way: gguf-py multiplies and adds in two roundings, the kernel in one)."""
    rows = 37
    cols = (45 if long_k else 7) * 32 if GGML_QUANT_SIZES[qtype][0] == 32 else (5 if long_k else 3) * 256
    raw = random_blocks(qtype, rows, cols, seed=300 + M)
    w = quants.dequantize(raw.numpy(), qtype).reshape(rows, cols).astype(np.float64)
    x = torch.randn(M, cols, generator=torch.Generator().manual_seed(M)).to(dtype)
    x += torch.linspace(-1, 3, cols).to(dtype)  # a nonzero mean per block, so an offset term shows
    xb = x.bfloat16().double().numpy()
    wb = torch.from_numpy(w).bfloat16().double().numpy()
    y_ref = xb @ wb.T
    bound = 2.0**-9 * (np.abs(xb) @ np.abs(wb.T)) + 1e-6
    if dtype == torch.bfloat16:
        bound += np.abs(y_ref) * 2.0**-8
    r16 = ops.gguf_repack_r16(raw, qtype, cols)
    with amx_rows(1):
        y = ops.gguf_linear(x, r16, qtype, rows, cols, r16=True).double().numpy()
    err = np.abs(y - y_ref)
    assert (err <= bound).all(), f"max excess {(err - bound).max()}"
    # into a strided view: one projection's columns of a fused output
    wide = torch.full((M, rows + 9), 7.0, dtype=dtype)
    with amx_rows(1):
        ops.gguf_linear(x, r16, qtype, rows, cols, r16=True, out=wide[:, 5 : 5 + rows])
    assert torch.equal(wide[:, 5 : 5 + rows], torch.from_numpy(y).to(dtype))
    assert (wide[:, :5] == 7).all() and (wide[:, 5 + rows :] == 7).all()


CACHED = (gguf_quant.gguf_kernel, gguf_quant.amx_tiles, gguf_quant.int8_activations)


def test_forcing_setting_and_fallback(monkeypatch, caplog):
    """MINIVLLM_GGUF_KERNEL=amx refuses to load where the probe fails, naming why; the default falls back to the
    VNNI kernel with one log line (a failed probe simulated); vnni and portable never turn the tiles on; another
    value is refused."""
    lib = cpu_kernels.load()
    real_probe = lib.gguf_amx_probe

    def fresh(env: dict[str, str]) -> None:
        for name in ("MINIVLLM_GGUF_KERNEL", "MINIVLLM_GGUF_ACTIVATIONS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        for fn in CACHED:
            fn.cache_clear()

    try:
        monkeypatch.setattr(lib, "gguf_amx_probe", lambda: -2)  # Linux refused the tile-data permission
        fresh({"MINIVLLM_GGUF_KERNEL": "amx"})
        with pytest.raises(ValueError, match="permission"):
            gguf_quant.amx_tiles()
        fresh({})
        with caplog.at_level(logging.WARNING, logger="models.quantization.gguf"):
            assert gguf_quant.amx_tiles() is False
        assert [r.getMessage() for r in caplog.records if "AMX" in r.getMessage()] == [
            "AMX tiles not used: Linux refused the AMX tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM); "
            "quantized linears run on AVX512-VNNI"
        ]
        monkeypatch.setattr(lib, "gguf_amx_probe", real_probe)
        for mode in ("vnni", "portable", "avx2"):
            fresh({"MINIVLLM_GGUF_KERNEL": mode})
            assert gguf_quant.amx_tiles() is False
        fresh({"MINIVLLM_GGUF_KERNEL": "portable", "MINIVLLM_GGUF_ACTIVATIONS": "int8"})
        assert gguf_quant.int8_activations() is False
        fresh({"MINIVLLM_GGUF_KERNEL": "tiles"})
        with pytest.raises(ValueError, match="expected one of auto, portable, vnni, amx"):
            gguf_quant.amx_tiles()
        fresh({"MINIVLLM_GGUF_KERNEL": "amx"})
        if amx():
            assert gguf_quant.amx_tiles() is True
        else:
            with pytest.raises(ValueError, match="MINIVLLM_GGUF_KERNEL=amx: "):
                gguf_quant.amx_tiles()
    finally:
        monkeypatch.undo()
        for fn in CACHED:
            fn.cache_clear()
        gguf_quant.amx_tiles()  # the process's own setting again
