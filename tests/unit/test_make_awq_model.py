"""scripts/make_awq_model.py: the random AWQ checkpoint vLLM-CPU's int4 path runs as a benchmark peer."""

import json

import pytest
import torch
from safetensors import safe_open

from scripts.make_awq_model import LINEARS, make_awq


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_the_default_models_shape_as_autoawq_writes_it(hf_model_dir, tmp_path):
    """Every decoder linear of the default model's directory becomes AutoAWQ's GEMM-packed qweight [in, out / 8],
    qzeros [in / group, out / 8] (int32, eight 4-bit codes each) and float16 scales [in / group, out], group 64 (128
    does not divide its hidden size 576); the other tensors are the source's bit for bit; config.json names the
    scheme as AutoAWQ does."""
    src = _tensors(f"{hf_model_dir}/model.safetensors")
    out = make_awq(hf_model_dir, tmp_path / "awq")
    awq = _tensors(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
    }
    linear = [k for k in src if k.endswith(".weight") and k.split(".")[-2] in LINEARS]
    assert len(linear) == 7 * config["num_hidden_layers"]
    for k in linear:
        rows, cols = src[k].shape
        prefix = k.removesuffix(".weight")
        assert k not in awq
        assert awq[f"{prefix}.qweight"].shape == (cols, rows // 8) and awq[f"{prefix}.qweight"].dtype == torch.int32
        assert awq[f"{prefix}.qzeros"].shape == (cols // 64, rows // 8) and awq[f"{prefix}.qzeros"].dtype == torch.int32
        assert awq[f"{prefix}.scales"].shape == (cols // 64, rows) and awq[f"{prefix}.scales"].dtype == torch.float16
    for k in set(src) - set(linear):
        assert torch.equal(awq[k], src[k]), k


def test_a_group_that_does_not_divide_the_inputs_is_refused(hf_model_dir, tmp_path):
    """--group-size 128 against the default model's 576-wide inputs: a clear exit, no directory written."""
    with pytest.raises(SystemExit, match="no group size"):
        make_awq(hf_model_dir, tmp_path / "awq", wanted_group=128)
    assert not (tmp_path / "awq").exists()
