"""Prompt logprobs (SamplingParams.prompt_logprobs) against Hugging Face transformers in float32: cold and
prefix-cached prompts, chunked prefill, n > 1, preemption, prompt-only requests (max_tokens 0), and the
bound on the logits held at once."""

import pytest
import torch
from conftest import make_llm

from engine import SamplingParams
from engine.sample import prompt_logprobs as pl

TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


@pytest.fixture(scope="module")
def small_chunks():
    """Chunked prefill: a 32-token step budget, so the long prompt takes several steps."""
    return make_llm(max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(small_chunks, hf_model_dir):
    """HF log-softmax over the vocabulary at every position of the prompts used here, by token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_model_dir, dtype=torch.float32).eval()
    tok = small_chunks.tokenizer
    prompts = {"short": tok.encode("Hello world"), "long": tok.encode(TEXT * 3)}
    with torch.inference_mode():
        return {
            name: (ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1))
            for name, ids in prompts.items()
        }


def assert_matches(entries, ids, ref, k):
    """Entries equal HF's: None first, then each token's logprob and rank, and the top-k ids (up to
    near-ties) with their logprobs."""
    assert len(entries) == len(ids) and entries[0] is None
    for pos, entry in enumerate(entries[1:]):
        row = ref[pos]
        assert entry.token_id == ids[pos + 1]
        assert entry.logprob == pytest.approx(row[ids[pos + 1]].item(), abs=2e-4)
        assert abs(entry.rank - (int((row > row[ids[pos + 1]]).sum()) + 1)) <= 1  # +-1 for near-ties
        assert len(entry.top_logprobs) == k
        for (token, logprob), expected in zip(entry.top_logprobs, row.topk(k).values.tolist()):
            assert logprob == pytest.approx(expected, abs=2e-4) and row[token].item() == pytest.approx(
                logprob, abs=2e-4
            )


@pytest.mark.slow
def test_cold_then_cached_prompt(small_chunks, reference):
    ids, ref = reference["long"]
    llm = small_chunks
    llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False)  # the prompt's blocks are now cached
    assert llm.engine.engine_core.kv.pool.cached
    for _ in range(2):  # cached prompt; then cached again after the first scored run
        out = llm.generate(ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
        assert out.num_cached_tokens == 0  # recomputed, not read from the cache
        assert_matches(out.prompt_logprobs, ids, ref, 3)
    # Without prompt logprobs the same prompt still hits the cache
    out = llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.num_cached_tokens > 0 and out.prompt_logprobs is None


def test_batched_with_others_n_and_prompt_only(small_chunks, reference):
    (short, short_ref), (long, long_ref) = reference["short"], reference["long"]
    llm = small_chunks
    llm.reset_prefix_cache()
    outs = llm.generate(
        [long, short, long, short],
        [
            SamplingParams(max_tokens=0, prompt_logprobs=0),
            SamplingParams(max_tokens=8, temperature=0.8, seed=1, n=3, prompt_logprobs=2),
            SamplingParams(max_tokens=5),
            SamplingParams(max_tokens=0, prompt_logprobs=1, n=2),
        ],
        use_tqdm=False,
    )
    assert_matches(outs[0].prompt_logprobs, long, long_ref, 0)
    assert [(c.token_ids, c.finish_reason) for c in outs[0].outputs] == [([], "length")]
    assert_matches(outs[1].prompt_logprobs, short, short_ref, 2)
    assert len(outs[1].outputs) == 3 and all(len(c.token_ids) == 8 for c in outs[1].outputs)
    assert outs[2].prompt_logprobs is None
    assert_matches(outs[3].prompt_logprobs, short, short_ref, 1)
    assert [c.token_ids for c in outs[3].outputs] == [[], []]


@pytest.mark.slow
def test_survives_preemption(reference):
    """A KV cache of 4 blocks (64 tokens) for two 36-token sequences: one is preempted and recomputed,
    and each one's prompt logprobs stay exact."""
    ids, ref = reference["long"]
    ids, ref = ids[:24], ref[:24]
    llm = make_llm(kv_cache_memory=4 * 737280, max_num_batched_tokens=32)
    assert llm.engine.engine_core.executor.runner.num_blocks == 4
    params = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([ids] * 2, params, use_tqdm=False)
    assert llm.engine.engine_core.scheduler.num_preemptions > 0
    for out in outs:
        assert_matches(out.prompt_logprobs, ids, ref, 1)


@pytest.mark.slow
def test_logits_are_reduced_in_slices(small_chunks, reference, monkeypatch):
    """A long prompt in one step: logits never exist for more than SLICE_ROWS positions at once."""
    ids, ref = reference["long"]
    llm = make_llm(max_num_batched_tokens=2048)
    monkeypatch.setattr(pl, "SLICE_ROWS", 16)
    rows = []
    model = llm.engine.engine_core.executor.runner.model
    original = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: rows.append(h.shape[0]) or original(h))
    out = llm.generate(ids, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    assert max(rows) == 16 and sum(rows) == len(ids) - 1
    assert_matches(out.prompt_logprobs, ids, ref, 2)


def test_validation():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
