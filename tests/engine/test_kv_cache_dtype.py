"""--kv-cache-dtype on the default model: a quantized KV cache holds more tokens in the same memory, keeps
perplexity near the unquantized cache's (scripts/perplexity.py's method on a short text), and its blocks are
prefix-cached like any others."""

import pytest

from engine import SamplingParams
from scripts.perplexity import perplexity
from tests.conftest import make_llm

PROMPT = "The history of the printing press begins in 1440, when Johannes Gutenberg " * 6


@pytest.fixture(scope="module")
def reference():
    llm = make_llm(enable_prefix_caching=False)
    return llm.engine.engine_core.num_blocks, perplexity(llm, 256, 2048)[0]


@pytest.mark.parametrize("kv_cache_dtype, bound", [("int8", 0.005), ("fp8_e4m3", 0.03), ("fp8_e5m2", 0.06)])
def test_quantized_kv_cache(kv_cache_dtype, bound, reference):
    blocks, ppl = reference
    llm = make_llm(kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    # float32 K/V are 4 bytes a value; int8 1 + 4 / 32 (its scales), fp8 1
    ratio = 4 / (1.125 if kv_cache_dtype == "int8" else 1)
    assert abs(llm.engine.engine_core.num_blocks / blocks - ratio) < 0.01
    quantized = perplexity(llm, 256, 2048)[0]
    assert abs(quantized / ppl - 1) < bound, (quantized, ppl)


def test_quantized_blocks_are_prefix_cached():
    """The second run reads its prompt's first 96 positions from the first run's int8 blocks: the same first
    distribution, and the same greedy tokens up to a near tie (the second run's 7-token prefill takes the int8
    linears where the first's 103 took float ones, so their logits differ by rounding: a near tie, within 0.1 nats,
    may flip; one of 0.062 did once the attention's scores were summed in four chains)."""
    llm = make_llm(kv_cache_dtype="int8")
    kv = llm.engine.engine_core.kv
    prompt = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    hits = kv.prefix_cache_hits
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert kv.prefix_cache_hits - hits == (len(prompt) - 1) // 16 * 16
    assert first.token_ids[0] == again.token_ids[0]
    assert abs(first.logprobs[0].logprob - again.logprobs[0].logprob) < 0.05
    for i, (a, b) in enumerate(zip(first.token_ids, again.token_ids)):
        if a != b:  # only at a near tie of the first run's
            (_, best), (_, second) = first.logprobs[i].top_logprobs[:2]
            assert best - second < 0.1, (i, best, second)
            break
