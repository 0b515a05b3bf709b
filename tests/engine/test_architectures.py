"""Each supported architecture against transformers, on tiny random models saved as HF directories
(scripts/make_tiny_model.py):
Llama 3 (llama3 RoPE scaling, untied LM head), Qwen2 (q/k/v biases), Mistral, Qwen3 (per-head q/k RMSNorm,
head_dim apart from hidden_size / heads). Plus the registry error."""

import pytest
import torch

from engine import SamplingParams
from models.layers.rotary_embedding import rope_inv_freq
from models.registry import get_model_class
from scripts.make_tiny_model import CONFIGS, save_tiny_model
from tests.conftest import assert_greedy_matches, make_llm


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_random_model_matches_transformers(name, llm, tmp_path):
    if name == "llama3":  # the scaling really changes the frequencies we use
        plain = type("Plain", (), {"rope_theta": 500000.0})()
        assert not torch.allclose(rope_inv_freq(CONFIGS[name](), 16), rope_inv_freq(plain, 16))
    ref_model = save_tiny_model(name, tmp_path, llm.tokenizer)
    ours = make_llm(model=str(tmp_path))
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)  # > 64 positions
    out = ours.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    with torch.inference_mode():
        ref = ref_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = ref.sequences[0, len(prompt) :].tolist()
    gaps = [float(t.topk(2).values[0, 0] - t.topk(2).values[0, 1]) for t in ref.logits]
    assert_greedy_matches(out.outputs[0].token_ids, (tokens, gaps))


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        get_model_class(type("Config", (), {"architectures": ["GPT2LMHeadModel"]})())
