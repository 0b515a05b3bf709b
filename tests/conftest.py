"""Shared fixtures: engines on the real default model, the Hugging Face reference, leak checks."""

import hashlib
import json
import os

import pytest
import torch

from models.cache_dir import CACHE_DIR
from models.loader import export_hf_directory, file_key
from tests.engines import ENGINES, assert_no_leak, make_llm  # noqa: F401 (the tests import them from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests that compare greedy tokens with transformers' on a GGUF's dequantized weights check how the file is
# read, so they run the exact float32 kernels (servers the tests start inherit it). The default int8-activation
# arithmetic (llama.cpp's) is judged as quantized arithmetic is: by lm-eval against float32
# (tests/server/test_lm_eval.py) and by its kernel against a simulation of llama.cpp's (test_gguf_kernels.py).
os.environ.setdefault("MINIVLLM_GGUF_ACTIVATIONS", "float")


@pytest.fixture(autouse=True)
def _check_no_leaks():
    yield
    for llm in list(ENGINES):
        assert_no_leak(llm.engine)


@pytest.fixture(scope="session")
def llm():
    return make_llm()


def _workload():
    with open(os.path.join(ROOT, "scripts", "data", "workload.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def prompts(llm) -> list[list[int]]:
    """Eight varied prompts as token ids: plain and chat, 5 to 400 tokens."""
    tok = llm.tokenizer

    def chat(msgs):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    work = _workload()
    long_prompt = next(r for r in work if r["num_prompt_tokens"] >= 400)["prompt_token_ids"][:400]
    mid_prompt = next(r for r in work if 140 <= r["num_prompt_tokens"] <= 220)["prompt_token_ids"]
    out = [
        tok.encode("The capital of France is"),
        chat([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
        chat(
            [
                {"role": "system", "content": "You are a helpful poet."},
                {"role": "user", "content": "Write a haiku about the ocean."},
            ]
        ),
        mid_prompt,
        chat(
            [
                {"role": "user", "content": "Name three fruits."},
                {"role": "assistant", "content": "Apple, banana and cherry."},
                {"role": "user", "content": "Now three vegetables, please."},
            ]
        ),
        tok.encode("1, 2, 3, 4, 5,"),
        long_prompt,
    ]
    assert min(map(len, out)) <= 6 and max(map(len, out)) >= 400
    return out


@pytest.fixture(scope="session")
def hf_model_dir(llm) -> str:
    """The default model as a Hugging Face directory (its GGUF weights dequantized by transformers)."""
    return export_hf_directory(llm.model_dir)


@pytest.fixture(scope="session")
def hf_reference(llm, prompts, hf_model_dir):
    """Greedy tokens of Hugging Face transformers `generate` (float32) for `prompts`, 32 new tokens
    each, with the gap between the top-two logits at every step (to judge near-ties). Kept in CACHE_DIR, keyed
    by the model file, the prompts and the transformers and torch versions: the same inputs give the same
    reference, and computing it takes a test run 15 s."""
    import transformers
    from transformers import AutoModelForCausalLM

    key = hashlib.sha256(
        json.dumps([file_key(llm.model_dir), prompts, transformers.__version__, torch.__version__]).encode()
    ).hexdigest()[:32]
    cached = CACHE_DIR / "test-reference" / f"{key}.json"
    if cached.exists():
        return [tuple(r) for r in json.loads(cached.read_text())]
    model = AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids) :].tolist()
            gaps = [float(t.topk(2).values[0, 0] - t.topk(2).values[0, 1]) for t in out.logits]
            refs.append((tokens, gaps))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(refs))
    return refs


def assert_greedy_matches(
    ours: list[int], ref: tuple[list[int], list[float]], tol: float = 1e-3, ignore_eos: bool = False
) -> None:
    """Our greedy tokens equal the reference's, except that a divergence is accepted at a step where
    the reference's top-two logits are within `tol` (after which the sequences may differ).
    With `ignore_eos`, ours may go on past the reference's EOS."""
    tokens, gaps = ref
    for step, (a, b) in enumerate(zip(ours, tokens)):
        if a != b:
            assert gaps[step] < tol, f"diverged at step {step}: ours {a}, reference {b} (gap {gaps[step]:.4g})"
            return
    assert len(ours) == len(tokens) or (ignore_eos and len(ours) > len(tokens)), (
        f"ours has {len(ours)} tokens, the reference {len(tokens)}"
    )
