"""Embeddings from the generation engine (LLM.embed): the pooled final hidden state equals
transformers' last hidden state, with chunked prefill, prefix-cache hits and mean pooling."""

import pytest
import torch

from engine import SamplingParams
from tests.conftest import make_llm

TEXTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 3,
    "Hello",
]


@pytest.fixture(scope="module")
def hf_hidden(llm, hf_model_dir):
    """transformers' final hidden states (after the last norm), float32 [len, hidden], per text."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model(torch.tensor([llm.tokenizer.encode(t)]), output_hidden_states=True).hidden_states[-1][0]
            for t in TEXTS
        ]


def cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0))


@pytest.mark.slow
def test_last_token_pooling_matches_transformers_through_chunks_and_cache_hits(hf_hidden):
    llm = make_llm(max_num_batched_tokens=32)  # the long text's prompt takes several steps
    first = llm.embed(TEXTS, use_tqdm=False)
    for out, hidden in zip(first, hf_hidden):
        assert len(out.embedding) == hidden.shape[1] == 576
        assert cosine(out.embedding, hidden[-1]) >= 0.999
        assert abs(torch.tensor(out.embedding).norm().item() - 1) < 1e-5
    again = llm.embed(TEXTS, use_tqdm=False)  # prompts in the prefix cache now: the last token is recomputed
    assert again[1].num_cached_tokens > 0
    assert all(cosine(a.embedding, b.embedding) >= 0.9999 for a, b in zip(first, again))


@pytest.mark.slow
def test_mean_pooling_computes_every_position(hf_hidden):
    llm = make_llm(pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=32)
    for _ in range(2):  # the second round would hit the prefix cache, which mean pooling must not read
        outs = llm.embed(TEXTS, use_tqdm=False)
        for out, hidden in zip(outs, hf_hidden):
            assert out.num_cached_tokens == 0
            assert cosine(out.embedding, hidden.mean(dim=0)) >= 0.999


def test_embedding_requests_beside_generation_and_bad_input(llm):
    engine = llm.engine
    engine.add_request("gen", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("emb", "Once upon a time", SamplingParams(max_tokens=0), pooling=True)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(finals["gen"].outputs[0].token_ids) == 8 and finals["gen"].embedding is None
    assert len(finals["emb"].embedding) == 576 and finals["emb"].outputs[0].token_ids == []
    with pytest.raises(ValueError, match="max_tokens 0 and n 1"):
        engine.add_request("bad", "Hi", SamplingParams(max_tokens=4), pooling=True)
    engine.add_request("aborted", "Hi there", SamplingParams(max_tokens=0), pooling=True)
    assert engine.abort_request("aborted").embedding is None
