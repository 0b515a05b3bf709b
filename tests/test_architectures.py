"""Each supported architecture against transformers, on tiny random models saved as HF directories:
Llama 3 (llama3 RoPE scaling, untied LM head), Qwen2 (q/k/v biases), Mistral. Plus the registry error."""
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from engine import SamplingParams
from models import get_model_class
from models.llama import rope_inv_freq
from tests.conftest import assert_greedy_matches, make_llm

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
CONFIGS = {
    "llama3": lambda: LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
}


def save_tiny_model(name: str, path, tokenizer_dir: str, **overrides):
    """Saves a random tiny `name` model (CONFIGS, with `overrides` of config fields) as a Hugging Face
    directory with the default model's tokenizer at `path`; returns the transformers model (float32)."""
    torch.manual_seed(0)
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    ref_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if name == "qwen2":  # random init leaves biases at zero; make them matter
        for layer in ref_model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
    ref_model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{f}", path)
    return ref_model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_random_model_matches_transformers(name, llm, tmp_path):
    if name == "llama3":  # the scaling really changes the frequencies we use
        plain = type("Plain", (), {"rope_theta": 500000.0})()
        assert not torch.allclose(rope_inv_freq(CONFIGS[name](), 16), rope_inv_freq(plain, 16))
    ref_model = save_tiny_model(name, tmp_path, llm.model_dir)
    ours = make_llm(model=str(tmp_path))
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)  # > 64 positions
    out = ours.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    with torch.inference_mode():
        ref = ref_model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
    tokens = ref.sequences[0, len(prompt):].tolist()
    gaps = [float(t.topk(2).values[0, 0] - t.topk(2).values[0, 1]) for t in ref.logits]
    assert_greedy_matches(out.outputs[0].token_ids, (tokens, gaps))


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        get_model_class(type("Config", (), {"architectures": ["GPT2LMHeadModel"]})())
