"""Scheduler, driven by synthetic model-runner outputs (as vLLM's tests/v1/core/test_scheduler.py): token
budget, running requests before new ones, chunked prefill, FCFS preemption, what the workers are told (new
requests whole, the others as diffs; resumed ones with all their blocks; finished ids), draft rollback, stop
checks, prompt-only finish, embeddings passed on, and a data-only seam that pickles."""

import pickle
import pickletools
import zlib

import torch

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.step_io import ModelRunnerOutput, SchedulerOutput
from engine.kv_transfer.connector import NoKVConnector
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams


def make_scheduler(num_blocks=100, block_size=16, max_num_seqs=8, max_num_batched_tokens=128, **kwargs):
    return Scheduler(
        KVCacheManager(num_blocks, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=4096,
        connector=NoKVConnector(),
        **kwargs,
    )


def make_request(rid, num_prompt_tokens, max_tokens=16, **params):
    # crc32, not hash(): str hashes change with each process, and two ids equal mod 1000 shared a prompt (a prefix
    # hit) in about one run in a thousand
    prompt = [(zlib.crc32(rid.encode()) + i) % 1000 + 10 for i in range(num_prompt_tokens)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=frozenset({2}))


def sample(out: SchedulerOutput, sched: Scheduler, token: int = 7, drafts: dict | None = None) -> ModelRunnerOutput:
    """What a runner answers: `token` for every request whose scheduled tokens reach its last one."""
    ids = [
        r
        for r, n in out.num_scheduled_tokens.items()
        if sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_tokens
        and sched.requests[r].params.max_tokens != 0
    ]
    return ModelRunnerOutput(
        req_ids=ids,
        sampled_token_ids=[[token] for _ in ids],
        logprobs=[[None] for _ in ids],
        draft_token_ids=drafts or {},
    )


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    return out, sched.update_from_output(out, sample(out, sched, token))


def test_budget_and_chunked_prefill():
    sched = make_scheduler()
    for rid in "abc":
        sched.add_request(make_request(rid, 100))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 100, "b": 28} and out.total_num_scheduled_tokens == 128
    out, _ = run_step(sched)
    # running first: a's decode, then b's next chunk, then c takes what is left
    assert out.num_scheduled_tokens == {"a": 1, "b": 72, "c": 55}


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=1000)
    for rid in "abc":
        sched.add_request(make_request(rid, 10))
    out, _ = run_step(sched)
    assert len(out.num_scheduled_tokens) == 2 and len(sched.waiting) == 1


def test_new_requests_whole_then_diffs():
    sched = make_scheduler(block_size=4)
    a = make_request("a", 6, temperature=0.5, seed=3)
    sched.add_request(a)
    out, _ = run_step(sched)
    [new] = out.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.num_computed_tokens) == ("a", a.prompt_token_ids, 0)
    assert new.block_ids == sched.kv.block_ids("a") and len(new.block_ids[0]) == 2
    assert new.sampling_params.seed == 3 and new.eos_token_ids == {2}
    # next steps: the token sampled since, the blocks given since, the computed count
    out, _ = run_step(sched, token=8)
    cached = out.scheduled_cached_reqs
    assert not out.scheduled_new_reqs and cached.req_ids == ["a"]
    assert cached.new_token_ids == [[7]] and cached.new_block_ids == [([],)] and cached.num_computed_tokens == [6]
    assert cached.resumed_from_preemption == [False]
    out, _ = run_step(sched)
    assert out.scheduled_cached_reqs.new_token_ids == [[8]] and out.scheduled_cached_reqs.new_block_ids == [([],)]
    out, _ = run_step(sched)
    assert out.scheduled_cached_reqs.new_block_ids == [([sched.kv.block_ids("a")[0][2]],)]  # position 8: a third block


def test_preempts_newest_running_request_fcfs_and_resumes_it_with_all_its_blocks():
    # 4 blocks of 4 tokens; a and b take 2 blocks each, then a's decode needs a third block
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 8), make_request("b", 8)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    assert sched.kv.pool.num_free_blocks == 0
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens) == ["a"]
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0 and b.status == RequestStatus.PREEMPTED
    assert sched.kv.block_ids("b") == ([],)
    # b comes back first once a finishes, recomputing its prompt and its sampled token; its first block is
    # still in the prefix cache (a's new block evicted b's tail, the LRU block)
    sched.finish(a, "length")
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"b": 5} and b.num_computed_tokens == 9
    assert out.finished_req_ids == {"a"}
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.resumed_from_preemption == [True]
    assert cached.new_block_ids == [sched.kv.block_ids("b")] and cached.num_computed_tokens == [4]
    assert cached.new_token_ids == [[7]]  # sampled just before the preemption: the workers had not seen it


def test_waiting_request_blocked_by_memory_is_not_skipped():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    big, small = make_request("big", 20), make_request("small", 2)
    sched.add_request(big)
    sched.add_request(small)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {}  # FCFS: `small` does not jump the queue ahead of `big`


def test_finish_frees_blocks_at_once_and_tells_the_workers():
    sched = make_scheduler(num_blocks=8, block_size=4)
    a = make_request("a", 10)
    sched.add_request(a)
    run_step(sched)
    sched.finish(a, "abort")
    assert sched.kv.pool.num_free_blocks == 8 and not sched.running and not sched.requests
    assert a.finish_reason == "abort"
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()  # told once


def test_stop_checks_eos_stop_token_min_tokens_and_length():
    sched = make_scheduler()
    eos, stop, short = (
        make_request("eos", 4),
        make_request("stop", 4, stop_token_ids=[9]),
        make_request("short", 4, max_tokens=2),
    )
    early = make_request("early", 4, min_tokens=2)
    for req in (eos, stop, short, early):
        sched.add_request(req)
    out = sched.schedule()
    outputs = {
        o.request_id: o
        for o in sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=["eos", "stop", "short", "early"],
                sampled_token_ids=[[2], [9], [5], [2]],
                logprobs=[[Logprob(2, -0.5)], [None], [None], [None]],
            ),
        )
    }
    assert (outputs["eos"].finish_reason, outputs["eos"].stop_reason) == ("stop", None)
    assert outputs["eos"].new_token_ids == [2] and outputs["eos"].new_logprobs[0].logprob == -0.5
    assert (outputs["stop"].finish_reason, outputs["stop"].stop_reason) == ("stop", 9)
    assert outputs["short"].finish_reason is None and outputs["early"].finish_reason is None  # EOS before min_tokens
    out, outputs = run_step(sched, token=5)
    assert {o.request_id: o.finish_reason for o in outputs} == {"short": "length", "early": None}
    assert not sched.kv.req_blocks.get("short") and sched.requests.keys() == {"early"}


def test_draft_rollback_and_tokens_after_a_stop_dropped():
    sched = make_scheduler(block_size=4, num_speculative_tokens=3)
    a, b = make_request("a", 6), make_request("b", 6, stop_token_ids=[12])
    for req in (a, b):
        sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=["a", "b"],
            sampled_token_ids=[[7], [7]],
            logprobs=[[None], [None]],
            draft_token_ids={"a": [10, 11, 12], "b": [10, 11, 12]},
        ),
    )
    assert a.spec_token_ids == [10, 11, 12]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 4} and out.scheduled_spec_decode_tokens["a"] == [10, 11, 12]
    # a: the first draft accepted, the second rejected (13 sampled instead); b: all accepted plus a bonus token,
    # but its third draft is a stop token
    outputs = {
        o.request_id: o
        for o in sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=["a", "b"], sampled_token_ids=[[10, 13], [10, 11, 12, 14]], logprobs=[[None] * 2, [None] * 4]
            ),
        )
    }
    assert a.num_computed_tokens == 6 + 1 + 1 and a.all_token_ids[6:] == [7, 10, 13] and not a.spec_token_ids
    assert outputs["b"].new_token_ids == [10, 11, 12] and outputs["b"].finish_reason == "stop"
    stats = sched.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]


def test_lookahead_slots_for_a_draft_model():
    sched = make_scheduler(block_size=4, num_speculative_tokens=3, num_lookahead_tokens=3)
    a = make_request("a", 8)
    sched.add_request(a)
    sched.schedule()
    assert len(sched.kv.block_ids("a")[0]) == 3  # 8 prompt tokens + 3 lookahead slots
    assert len(sched.kv.pool.cached) == 2  # the prompt's two full blocks; the lookahead block is not cached


def test_prompt_only_request_finishes_once_its_prompt_is_computed_with_its_embedding():
    sched = make_scheduler(max_num_batched_tokens=64)
    req = Request("e", list(range(10, 110)), SamplingParams(max_tokens=0), frozenset(), pooling="MEAN")
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"e": 64} and out.scheduled_new_reqs[0].pooling == "MEAN"
    assert sched.update_from_output(out, ModelRunnerOutput()) == []
    out = sched.schedule()
    embedding = torch.ones(4)
    [output] = sched.update_from_output(out, ModelRunnerOutput(pooler_output={"e": embedding}))
    assert output.finish_reason == "length" and output.pooling_output is embedding and not output.new_token_ids
    assert not sched.requests and not sched.kv.req_blocks


def test_prompt_logprobs_keep_the_prefix_cache_unread_until_the_prompt_is_computed():
    sched = make_scheduler(block_size=4)
    first = make_request("first", 12)
    sched.add_request(first)
    run_step(sched)
    sched.finish(first, "abort")
    again = Request("again", first.prompt_token_ids, SamplingParams(prompt_logprobs=1), frozenset())
    sched.add_request(again)
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # the cached blocks are not read
    sched.update_from_output(out, sample(out, sched))
    assert not again.prompt_logprobs_pending


def test_seam_is_data_only_and_pickles():
    sched = make_scheduler(block_size=4)
    for rid in "ab":
        sched.add_request(make_request(rid, 6))
    run_step(sched)
    sched.finish(sched.requests["b"], "abort")
    out = sched.schedule()
    runner_output = sample(out, sched)
    for obj in (out, runner_output):
        data = pickle.dumps(obj)
        modules = {arg for op, arg, _ in pickletools.genops(data) if isinstance(arg, str) and arg.startswith("engine")}
        assert modules <= {"engine.core.step_io", "engine.sampling_params"}, modules
        assert pickle.loads(data) == obj
