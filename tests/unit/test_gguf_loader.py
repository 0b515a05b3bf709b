"""A GGUF file read directly (models/gguf.py): config, tokenizer and weights against transformers' own
GGUF loading of the default model, and bad files as start-up errors naming what is wrong."""

import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from models.gguf import iter_gguf_weights, load_gguf_config, load_gguf_tokenizer, read_header
from models.loader import default_model_path
from models.quantization.gguf import GGUFTensor


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.mark.slow  # transformers' GGUF loading takes seconds
def test_config_matches_transformers(gguf_path):
    from transformers import AutoConfig

    ours = load_gguf_config(gguf_path)
    ref = AutoConfig.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.architectures == ["LlamaForCausalLM"] and ours.head_dim == 64
    assert ours.rope_parameters["rope_theta"] == 100000.0


@pytest.mark.slow
def test_tokenizer_matches_transformers(gguf_path):
    from transformers import AutoTokenizer

    ours = load_gguf_tokenizer(gguf_path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    texts = ["Hello world", "  two spaces, émojis 🎉 and\nnewlines\t", "def f(x):\n    return x ** 2"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == ref.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert ours.eos_token == "<|im_end|>" and len(ours) == 49152


def test_tokenizer_cache_reads_back_the_same_tokenizer(gguf_path, tmp_path):
    """The first load converts and writes the cache entry, the second reads it: same ids, special tokens
    and chat template as the conversion."""
    cache = tmp_path / "tok"
    built = load_gguf_tokenizer(gguf_path, cache)
    assert sorted(p.name for p in cache.iterdir()) == ["tokenizer.json", "tokenizer_args.json"]
    cached = load_gguf_tokenizer(gguf_path, cache)
    assert cached.backend_tokenizer is not built.backend_tokenizer
    for text in ["Hello world", "  two spaces, émojis 🎉 and\nnewlines\t<|im_end|>", "def f(x):\n    return x"]:
        assert cached.encode(text) == built.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert cached.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == built.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert (cached.bos_token, cached.eos_token, cached.all_special_ids, len(cached)) == (
        built.bos_token,
        built.eos_token,
        built.all_special_ids,
        len(built),
    )


@pytest.mark.slow
def test_weights_match_transformers(gguf_path, hf_model_dir):
    """Dequantized, every tensor equals transformers' GGUF loading (q and k in the Hugging Face row
    order); kept quantized, every tensor's blocks dequantize to the same floats."""
    from safetensors.torch import load_file

    ref = load_file(os.path.join(hf_model_dir, "model.safetensors"))
    floats = dict(iter_gguf_weights(gguf_path, quantized=False))
    assert floats.keys() == ref.keys()
    for name, tensor in floats.items():
        assert torch.equal(tensor, ref[name]), name
    kinds = set()
    for name, tensor in iter_gguf_weights(gguf_path, quantized=True):
        if isinstance(tensor, GGUFTensor):
            kinds.add(tensor.qtype.name)
            got = dequantize(tensor.data.numpy(), tensor.qtype).reshape(tensor.rows, tensor.cols)
            assert np.array_equal(got, ref[name].numpy()), name
        else:
            assert torch.equal(tensor, ref[name]), name
    assert kinds == {"Q4_1", "Q8_0"}


def _write(path, arch="llama", qtype=GGMLQuantizationType.Q8_0, cut: int | None = None) -> str:
    """A one-layer GGUF of `arch` whose q projection is of `qtype` (cut to `cut` bytes if given)."""
    w = GGUFWriter(str(path), arch)
    for key, value in (
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 64),
        ("feed_forward_length", 128),
        ("attention.head_count", 2),
        ("attention.head_count_kv", 2),
        ("attention.layer_norm_rms_epsilon", 1e-5),
    ):
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(64, 64)).astype(np.float32)
    if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0):
        w.add_tensor("blk.0.attn_q.weight", quantize(q, qtype), raw_dtype=qtype)
    elif qtype is not None:  # a type gguf-py cannot make: random blocks of 256 weights
        rows_bytes = rng.integers(0, 256, size=(64, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        w.add_tensor("blk.0.attn_q.weight", rows_bytes, raw_dtype=qtype)
    w.add_tensor("token_embd.weight", rng.normal(size=(32, 64)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cut is not None:
        with open(path, "r+b") as f:
            f.truncate(cut)
    return str(path)


def test_a_small_written_file_loads(tmp_path):
    path = _write(tmp_path / "ok.gguf")
    weights = dict(iter_gguf_weights(path, quantized=True))
    assert isinstance(weights["model.layers.0.self_attn.q_proj.weight"], GGUFTensor)
    assert weights["model.embed_tokens.weight"].shape == (32, 64)


def test_bad_files_are_errors_naming_what_is_wrong(tmp_path, gguf_path):
    with pytest.raises(ValueError, match=r"bad_arch\.gguf.*architecture 'gpt2' is not supported"):
        read_header(_write(tmp_path / "bad_arch.gguf", arch="gpt2"))
    path = _write(tmp_path / "q5.gguf", qtype=GGMLQuantizationType.Q5_0)  # read since transformers is taught Q5_0
    assert isinstance(dict(iter_gguf_weights(path, True))["model.layers.0.self_attn.q_proj.weight"], GGUFTensor)
    path = _write(tmp_path / "iq2.gguf", qtype=GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(
        ValueError, match=r"iq2\.gguf: tensor blk\.0\.attn_q\.weight has ggml type IQ2_XXS, not supported"
    ):
        list(iter_gguf_weights(path, quantized=True))
    size = os.path.getsize(gguf_path)
    for cut in (1 << 20, size // 2, size - 1):
        truncated = tmp_path / f"cut{cut}.gguf"
        with open(gguf_path, "rb") as src, open(truncated, "wb") as dst:
            dst.write(src.read(cut))
        with pytest.raises(ValueError, match=rf"cut{cut}\.gguf: truncated"):
            read_header(str(truncated))
    not_gguf = tmp_path / "not.gguf"
    shutil.copy(__file__, not_gguf)
    with pytest.raises(ValueError, match=r"not\.gguf: not a GGUF file"):
        read_header(str(not_gguf))
