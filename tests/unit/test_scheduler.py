"""Scheduler: token budget, running requests before new ones, chunked prefill, FCFS preemption."""
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler


def make_request(rid, num_prompt_tokens, max_tokens=16):
    prompt = [(hash(rid) + i) % 1000 for i in range(num_prompt_tokens)]
    return Request(rid, rid, 0, None, prompt, SamplingParams(max_tokens=max_tokens), None, frozenset(), 0.0)


def run_step(sched: Scheduler):
    """Schedules one step and plays the model: computed tokens advance, caught-up requests get a token."""
    out = sched.schedule()
    for req, n in zip(out.requests, out.num_new_tokens):
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(7)
            req.output_token_ids.append(7)
    return out


def test_budget_and_chunked_prefill():
    sched = Scheduler(KVCacheManager(100, 16), max_num_seqs=8, max_num_batched_tokens=128, max_model_len=4096)
    for rid in "abc":
        sched.add_request(make_request(rid, 100))
    out = run_step(sched)
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert out.num_new_tokens == [100, 28] and out.total_num_scheduled_tokens == 128
    out = run_step(sched)
    # running first: a's decode, then b's next chunk, then c takes what is left
    assert [r.request_id for r in out.requests] == ["a", "b", "c"]
    assert out.num_new_tokens == [1, 72, 55]


def test_max_num_seqs():
    sched = Scheduler(KVCacheManager(100, 16), max_num_seqs=2, max_num_batched_tokens=1000, max_model_len=4096)
    for rid in "abc":
        sched.add_request(make_request(rid, 10))
    out = run_step(sched)
    assert len(out.requests) == 2 and len(sched.waiting) == 1


def test_preempts_newest_running_request_fcfs():
    # 4 blocks of 4 tokens; a and b take 2 blocks each, then a's decode needs a third block
    sched = Scheduler(KVCacheManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096)
    a, b = make_request("a", 8), make_request("b", 8)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    assert sched.kv.pool.num_free_blocks == 0
    out = run_step(sched)
    assert [r.request_id for r in out.requests] == ["a"]
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.num_computed_tokens == 0
    assert sched.kv.block_ids("b") == []
    # b comes back first once a finishes, recomputing its prompt and its sampled token; its first
    # block is still in the prefix cache (a's new block evicted b's tail, the LRU block)
    sched.finish(a, "length")
    out = run_step(sched)
    assert out.requests == [b] and out.num_new_tokens == [5]
    assert b.num_computed_tokens == 9


def test_waiting_request_blocked_by_memory_is_not_skipped():
    sched = Scheduler(KVCacheManager(4, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096)
    big, small = make_request("big", 20), make_request("small", 2)
    sched.add_request(big)
    sched.add_request(small)
    out = sched.schedule()
    assert out.requests == []  # FCFS: `small` does not jump the queue ahead of `big`


def test_finish_frees_blocks_at_once():
    sched = Scheduler(KVCacheManager(8, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096)
    a = make_request("a", 10)
    sched.add_request(a)
    run_step(sched)
    sched.finish(a, "abort")
    assert sched.kv.pool.num_free_blocks == 8 and not sched.running
    assert a.finish_reason == "abort"
