"""Every GGUF quantization type we read, end to end: a tiny Qwen3 (hidden 256, so that the 256-weight types fit)
converted by llama.cpp's own convert_hf_to_gguf.py, its linear weights then stored as blocks of one type
(gguf-py's quantizer where it has one, Q5_0 and Q5_1; random blocks with sane scales for the others, which it
cannot make); the reference is transformers on the file's tensors dequantized by gguf-py. Greedy float32
tokens under the near-tie rule."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from models.quantization.gguf import QUANTIZED_TYPES
from scripts import llama_cpp
from scripts.make_tiny_model import save_tiny_model
from tests.conftest import assert_greedy_matches, make_llm
from tests.gguf_blocks import random_blocks

pytestmark = pytest.mark.slow
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def converted(llm, tmp_path_factory):
    """(the tiny model's HF directory, its float32 GGUF made by llama.cpp's converter)."""
    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    root = tmp_path_factory.mktemp("qwen3-256")
    save_tiny_model("qwen3", root / "hf", llm.tokenizer, hidden_size=256, intermediate_size=512, head_dim=64)
    return root / "hf", llama_cpp.convert(root / "hf", root / "f32.gguf")


def requantize(src, dst, qtype: T) -> dict[str, np.ndarray]:
    """Writes `src` again as `dst` with every linear weight in `qtype` blocks; returns those tensors as gguf-py
    dequantizes them, by GGUF name."""
    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    weights = {}
    for i, t in enumerate(reader.tensors):
        data = np.array(t.data)
        if t.name.split(".")[-2] in LINEARS:
            rows, cols = data.shape
            if qtype in (T.Q5_0, T.Q5_1):
                blocks = quantize(data.astype(np.float32), qtype)
            else:
                blocks = random_blocks(qtype, rows, cols, seed=i).numpy()
            weights[t.name] = dequantize(blocks, qtype).reshape(rows, cols)
            writer.add_tensor(t.name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _greedy_reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' 12 greedy tokens after `prompt` and each step's top-2 logit gap."""
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            min_new_tokens=12,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return ref.sequences[0, len(prompt) :].tolist(), [
        float(t.topk(2).values[0, 0] - t.topk(2).values[0, 1]) for t in ref.logits
    ]


HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_each_type_gives_the_dequantized_models_tokens(qtype, converted, llm, tmp_path):
    hf_dir, f32 = converted
    weights = requantize(f32, tmp_path / f"{qtype.name}.gguf", qtype)
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in weights.items():
            layer, kind = int(name.split(".")[1]), name.split(".")[2]
            module = ref_model.model.layers[layer].get_submodule(HF_NAMES[kind])
            module.weight.copy_(torch.from_numpy(w))
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    expected = _greedy_reference(ref_model, prompt)
    ours = make_llm(model=str(tmp_path / f"{qtype.name}.gguf"))  # float32 activations: the exact portable path
    assert qtype.name in ours.engine.engine_core.executor.runner.weight_bytes
    out = ours.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert_greedy_matches(out[0].outputs[0].token_ids, expected)


@pytest.mark.parametrize("outtype, dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_16_bit_files_are_served_16_bit(outtype, dtype, converted, llm, tmp_path):
    """A GGUF written by llama.cpp's converter in F16 (or BF16) keeps its matrices 16-bit under float32
    activations, as llama.cpp does (half the resident bytes of a float32 copy; ops.linear_half), and gives the
    tokens of transformers on the same 16-bit-rounded weights."""
    hf_dir, _ = converted
    gguf = llama_cpp.convert(hf_dir, tmp_path / f"{outtype}.gguf", outtype=outtype)
    ref_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref_model.parameters():
            if p.dim() == 2:  # the converter keeps vectors (norms) F32
                p.copy_(p.to(dtype).float())
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    expected = _greedy_reference(ref_model, prompt)
    ours = make_llm(model=str(gguf))
    formats = ours.engine.engine_core.executor.runner.weight_bytes
    assert set(formats) >= {str(dtype).removeprefix("torch.")}, formats
    assert "float32" not in formats or formats["float32"] < sum(formats.values()) / 10, formats
    out = ours.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert_greedy_matches(out[0].outputs[0].token_ids, expected)
