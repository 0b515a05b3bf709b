"""Greedy output equals Hugging Face transformers, alone, batched with chunked prefill, with a shared
prefix, and under preemption."""

import pytest
import torch

from engine import SamplingParams
from tests.conftest import _workload, assert_greedy_matches, make_llm

GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.mark.slow  # the batched test below holds the same reference in make test-fast
def test_each_prompt_alone_matches_hf(llm, prompts, hf_reference):
    for ids, ref in zip(prompts, hf_reference):
        out = llm.generate([ids], GREEDY, use_tqdm=False)[0]
        assert_greedy_matches(out.outputs[0].token_ids, ref)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("torch_native", marks=pytest.mark.slow)])
def test_batched_with_chunked_prefill_matches_hf(prompts, hf_reference, backend):
    # 64 tokens per step: the 400-token prompt takes 7 steps, so steps mix prefill chunks and decodes
    llm = make_llm(max_num_batched_tokens=64, enable_prefix_caching=False, attention_backend=backend)
    assert (
        type(llm.engine.engine_core.executor.runner.backend).__name__
        == {"cpu": "CPUBackend", "torch_native": "TorchNativeBackend"}[backend]
    )
    steps = []
    original = llm.engine.engine_core.executor.execute_model

    def spy(scheduler_output, grammar_output=None):
        steps.append(list(scheduler_output.num_scheduled_tokens.values()))
        return original(scheduler_output, grammar_output)

    llm.engine.engine_core.executor.execute_model = spy
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, hf_reference):
        assert_greedy_matches(out.outputs[0].token_ids, ref)
    assert all(sum(s) <= 64 for s in steps)
    assert any(1 in s and max(s) > 1 for s in steps), "no step mixed decodes with prefill chunks"


@pytest.mark.slow
def test_shared_prefix_is_cached_and_matches(llm, prompts, hf_reference):
    tok = llm.tokenizer
    prefix = prompts[7][:64]
    a, b = prefix + tok.encode(" First question?"), prefix + tok.encode(" Second one!")
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in (a, b)]
    llm.reset_prefix_cache()  # start cold
    first = llm.generate([a], GREEDY, use_tqdm=False)[0]
    second = llm.generate([b], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64
    assert first.outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert second.outputs[0].token_ids == alone[1].outputs[0].token_ids


@pytest.mark.slow
def test_preemption_keeps_greedy_output(prompts, hf_reference):
    # 27 blocks of 16 tokens = 432 tokens, just enough for the longest request alone: the eight
    # prompts (~1000 tokens with outputs) cannot all fit. vLLM's num_gpu_blocks_override sets the count
    # (the gpu check forces preemption on CUDA the same way)
    llm = make_llm(num_gpu_blocks_override=27)
    assert llm.engine.engine_core.kv.num_blocks == 27
    # EOS ignored so every request keeps growing and the running ones must preempt each other
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert llm.engine.engine_core.scheduler.num_preemptions > 0
    for out, ref in zip(outs, hf_reference):
        assert_greedy_matches(out.outputs[0].token_ids, ref, ignore_eos=True)


@pytest.mark.slow
def test_bfloat16_agrees_with_float32(llm):
    """bfloat16 (the CPU default with AVX512-BF16) takes the first 16 greedy tokens of float32 on at
    least 80% of the benchmark workload's prompts (the first 16 here). bfloat16 weights and activations
    flip a near-tie now and then (86% of all 64 agree, measured; 72% before the LM head re-scored its top
    logits in float32), a wrong kernel flips most."""
    work = [r["prompt_token_ids"] for r in _workload()[:16]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    bf16 = make_llm(dtype="bfloat16")
    assert bf16.engine.engine_core.executor.runner.kv_cache.dtype == torch.bfloat16
    ours = [o.outputs[0].token_ids for o in bf16.generate(work, params, use_tqdm=False)]
    ref = [o.outputs[0].token_ids for o in llm.generate(work, params, use_tqdm=False)]
    assert sum(a == b for a, b in zip(ours, ref)) >= 0.8 * len(work)
