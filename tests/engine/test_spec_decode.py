"""Speculative decoding on the real model: greedy output token for token as without speculation
(alone, batched with chunked prefill, with prefix hits, under preemption), stops applied token by
token, seeded sampling reproducible, a draft model that is the target itself accepting every
token, and vLLM's counters on /metrics."""

import json
import os
import shutil

import pytest

from api.metrics import ServerMetrics
from engine import LLM, SamplingParams
from engine.spec_decode.draft_model import check_draft_model
from tests.conftest import ROOT, assert_greedy_matches, make_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def spec_llm():
    return make_llm(speculative_config=NGRAM)


@pytest.fixture(scope="module")
def copy_prompts():
    """Two "repeat this passage" and two "edit this function" chat prompts of the copy workload."""
    with open(os.path.join(ROOT, "scripts", "data", "copy_workload.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    repeat = [r for r in rows if r["task"] == "repeat" and r["num_prompt_tokens"] < 300][:2]
    edit = [r for r in rows if r["task"] == "edit" and r["num_prompt_tokens"] < 300][:2]
    return [r["prompt_token_ids"] for r in repeat + edit]


@pytest.fixture(scope="module")
def copy_reference(llm, copy_prompts):
    """Greedy tokens without speculation, with the top-two logit gap at each step (from logprobs)."""
    outs = llm.generate(copy_prompts, SamplingParams(temperature=0, max_tokens=32, logprobs=2), use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [lp.top_logprobs[0][1] - lp.top_logprobs[1][1] for lp in o.outputs[0].logprobs])
        for o in outs
    ]


def stats_delta(llm, before):
    after = llm.engine.stats().spec_decoding
    return after.num_drafts - before.num_drafts, after.num_accepted_tokens - before.num_accepted_tokens


@pytest.mark.slow
def test_greedy_alone_equals_no_speculation(spec_llm, prompts, hf_reference, copy_prompts, copy_reference):
    for ids, ref in zip(prompts, hf_reference):
        assert_greedy_matches(spec_llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids, ref)
    before = spec_llm.engine.stats().spec_decoding
    for ids, ref in zip(copy_prompts, copy_reference):
        assert_greedy_matches(spec_llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids, ref)
    drafts, accepted = stats_delta(spec_llm, before)
    assert drafts > 0 and 1 + accepted / drafts > 2.5, "copying prompts should accept most drafts"
    text = ServerMetrics(spec_llm.engine, "m").render().decode()
    stats = spec_llm.engine.stats().spec_decoding
    assert f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {float(stats.num_drafts)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(stats.num_accepted_tokens)}' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"}' in text
    for pos in range(4):
        value = float(stats.num_accepted_tokens_per_pos[pos])
        assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{pos}"}} {value}' in text


@pytest.mark.slow
def test_structured_request_beside_drafted_ones(spec_llm, copy_prompts, copy_reference):
    """A constrained request runs undrafted in the same steps as drafted ones: its grammar mask still
    applies, and the drafted requests keep their greedy tokens."""
    pytest.importorskip("xgrammar")
    from engine import StructuredOutputsParams

    choices = ["apple pie", "banana split", "cherry tart"]
    constrained = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices)
    )
    before = spec_llm.engine.stats().spec_decoding
    outs = spec_llm.generate(copy_prompts[:2] + [copy_prompts[2]], [GREEDY, GREEDY, constrained], use_tqdm=False)
    assert outs[2].outputs[0].text in choices
    for out, ref in zip(outs[:2], copy_reference[:2]):
        assert_greedy_matches(out.outputs[0].token_ids, ref)
    drafts, _ = stats_delta(spec_llm, before)
    assert drafts > 0


@pytest.mark.slow
def test_batched_with_chunked_prefill_and_prefix_hits(prompts, hf_reference, copy_prompts, copy_reference):
    llm = make_llm(speculative_config=NGRAM, max_num_batched_tokens=64, kv_cache_memory=256 << 20)
    steps = []
    original = llm.engine.engine_core.executor.execute_model

    def spy(scheduler_output, grammar_output=None):
        drafts = scheduler_output.scheduled_spec_decode_tokens
        steps.append([(n, len(drafts.get(r, []))) for r, n in scheduler_output.num_scheduled_tokens.items()])
        return original(scheduler_output, grammar_output)

    llm.engine.engine_core.executor.execute_model = spy
    # each copy prompt twice: the second copy hits the blocks of the first
    outs = llm.generate(prompts + copy_prompts + copy_prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, hf_reference + copy_reference + copy_reference):
        assert_greedy_matches(out.outputs[0].token_ids, ref)
    assert any(o.num_cached_tokens > 0 for o in outs[-len(copy_prompts) :])
    assert all(sum(n for n, _ in s) <= 64 for s in steps)
    assert any(any(d for _, d in s) and any(n > 1 and not d for n, d in s) for s in steps), (
        "no step verified drafts next to a prefill chunk"
    )
    # a follow-up prompt made of a request's prompt and output hits the blocks its verified drafts
    # filled, and continues exactly as the first request did
    first = outs[len(prompts)]
    tokens = first.outputs[0].token_ids
    follow = llm.generate(
        [first.prompt_token_ids + tokens[:16]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
    )[0]
    assert follow.num_cached_tokens == (len(first.prompt_token_ids) + 16 - 1) // 16 * 16
    assert_greedy_matches(follow.outputs[0].token_ids, (copy_reference[0][0][16:], copy_reference[0][1][16:]))


@pytest.mark.slow
def test_preemption_keeps_greedy_output(prompts, hf_reference):
    # as tests/engine/test_greedy_vs_hf.py: 27 blocks, just enough for the longest request alone
    llm = make_llm(speculative_config=NGRAM, kv_cache_memory=27 * 16 * 2 * 30 * 3 * 64 * 4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert llm.engine.engine_core.scheduler.num_preemptions > 0
    assert llm.engine.stats().spec_decoding.num_drafts > 0
    for out, ref in zip(outs, hf_reference):
        assert_greedy_matches(out.outputs[0].token_ids, ref, ignore_eos=True)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=40, stop=["the"]),
        SamplingParams(temperature=0, max_tokens=40, stop=["the"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=30, logprobs=1),
    ],
    ids=["stop", "stop-included", "max_tokens", "min_tokens-logprobs"],
)
@pytest.mark.slow
def test_stops_apply_token_by_token(spec_llm, llm, copy_prompts, params):
    ids = copy_prompts[0]
    ours = spec_llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    ref = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    assert (ours.text, ours.token_ids, ours.finish_reason, ours.stop_reason) == (
        ref.text,
        ref.token_ids,
        ref.finish_reason,
        ref.stop_reason,
    )
    if params.logprobs is not None:
        assert [lp.token_id for lp in ours.logprobs] == ours.token_ids
        assert [lp.logprob for lp in ours.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-3)


@pytest.mark.slow
def test_stop_token_ids(spec_llm, llm, copy_prompts):
    ids = copy_prompts[2]
    free = llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[free[10]])
    ours = spec_llm.generate([ids], stop, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == free[: free.index(free[10]) + 1] and ours.stop_reason == free[10]


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_n_works(spec_llm, copy_prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=24, n=2)
    runs = [spec_llm.generate([copy_prompts[1]], seeded, use_tqdm=False)[0] for _ in range(2)]
    assert [c.token_ids for c in runs[0].outputs] == [c.token_ids for c in runs[1].outputs]
    assert len(runs[0].outputs) == 2 and all(len(c.token_ids) > 0 for c in runs[0].outputs)


@pytest.mark.slow
def test_draft_model_target_as_its_own_draft(llm, prompts):
    k = 3
    spec = make_llm(speculative_config={"method": "draft_model", "model": llm.model_dir, "num_speculative_tokens": k})
    # every step after the first token proposes k and accepts all: 1 + 5 * (k + 1) tokens exactly
    params = SamplingParams(temperature=0, max_tokens=1 + 5 * (k + 1), ignore_eos=True)
    batch = [prompts[0], prompts[2]]
    outs = spec.generate(batch, params, use_tqdm=False)
    refs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in refs]
    stats = spec.engine.stats().spec_decoding
    assert stats.num_drafts == 2 * 5 and stats.acceptance_rate == 1.0 and stats.mean_acceptance_length == k + 1
    assert stats.num_accepted_tokens_per_pos == [10, 10, 10]
    # the draft writes its K/V into the target's blocks: no blocks of its own, and its per-request state
    # goes with the request (told to the worker with the next step)
    drafter = spec.engine.engine_core.executor.runner.speculator.proposer
    assert drafter.runner.kv_cache.shape[2] == spec.engine.engine_core.kv.num_blocks
    engine = spec.engine
    rid = engine.add_request(None, prompts[1], params)
    while not engine.engine_core.scheduler.requests[rid].spec_token_ids:
        engine.step()
    assert rid in drafter.states
    engine.abort_request(rid)  # an abort with drafts in flight frees the target's blocks at once
    assert not engine.engine_core.kv.req_blocks
    spec.generate([prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert not drafter.states


def test_draft_model_with_another_vocabulary_is_refused(tmp_path, llm, hf_model_dir):
    draft = tmp_path / "draft"
    shutil.copytree(hf_model_dir, draft, ignore=shutil.ignore_patterns("*.safetensors"))  # refused before loading
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 1
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not share the target's tokenizer and vocabulary"):
        check_draft_model(str(draft), llm.engine.vocab_size, llm.engine.tokenizer)
    with pytest.raises(ValueError, match="does not share the target's tokenizer and vocabulary"):
        LLM(
            dtype="float32",
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2},
        )
