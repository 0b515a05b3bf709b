"""The default GGUF model served as the file holds it: quantized weights kept (no float copy), the
formats chosen per activation dtype, and `quantization` honoured or refused."""

import pytest
import torch

from engine import LLM
from models.gguf import read_header
from models.kernels import cpu_kernels
from models.loader import default_model_path
from tests.conftest import make_llm


def file_tensor_bytes() -> int:
    header, _ = read_header(default_model_path())
    return sum(info.nbytes for info in header.tensors)


def test_float32_keeps_the_blocks(llm):
    """Float32 activations: the file's blocks as they are, run by the exact portable kernel; resident weight
    bytes within 1.1x of the file's tensor bytes (norms are float32 in the file too)."""
    formats = llm.engine.engine_core.executor.runner.weight_bytes
    assert set(formats) == {"Q4_1", "Q8_0", "float32"}
    assert formats["Q4_1"] == 66_355_200 and formats["Q8_0"] == 30_081_024  # the file's bytes exactly
    assert sum(formats.values()) <= 1.1 * file_tensor_bytes()


@pytest.mark.skipif(
    not (cpu_kernels.load() and cpu_kernels.load().gguf_r16_isa()),
    reason="the CPU has no AVX512-VNNI for the R16 kernels",
)
def test_bfloat16_repacks_for_vnni_without_growing():
    """Bfloat16 activations: the blocks repacked for the VNNI kernel, same bytes; the norms keep the file's
    float32 (a quantized model's linears take float32 activations, models/llama.py)."""
    formats = make_llm(dtype="bfloat16").engine.engine_core.executor.runner.weight_bytes
    assert set(formats) == {"Q4_1 (R16)", "Q8_0 (R16)", "float32"}
    assert formats["Q4_1 (R16)"] == 66_355_200 and formats["Q8_0 (R16)"] == 30_081_024
    assert sum(formats.values()) <= 1.1 * file_tensor_bytes()


def test_quantization_none_dequantizes_at_load():
    llm = make_llm(quantization="none", dtype="bfloat16")
    assert set(llm.engine.engine_core.executor.runner.weight_bytes) == {"bfloat16"}
    assert llm.engine.engine_core.executor.runner.model.embed_tokens.weight.dtype == torch.bfloat16


def test_quantization_gguf_is_refused_where_it_cannot_run(hf_model_dir):
    with pytest.raises(ValueError, match="quantization gguf needs a .gguf model"):
        LLM(model=hf_model_dir, quantization="gguf", kv_cache_memory=64 << 20)
    with pytest.raises(ValueError, match="quantization gguf runs in one process"):
        LLM(quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization must be gguf or none"):
        LLM(quantization="awq")
