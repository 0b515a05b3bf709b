"""Engine snapshots for the dashboard (engine/snapshot.py): request states and counts, the per-block
map against the block pool itself, shared blocks (n > 1, prefix hits), the step log, the slot's rate
limit; and the llama.cpp-style `timings` of RequestOutput.metrics offline."""

import base64
import time

import numpy as np
import pytest
from conftest import make_llm

from engine import SamplingParams
from engine.snapshot import CACHED, FINISHED_SHOWN_S, FREE, SHARED, USED, SnapshotSlot, Snapshotter

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # 64 tokens per step, so a 150-token prompt is prefilled in three chunks
    return make_llm(max_num_batched_tokens=64, max_num_seqs=2)


def decode_map(kv: dict) -> tuple[np.ndarray, np.ndarray]:
    """The snapshot's per-block state and chain-position arrays."""
    state = np.frombuffer(base64.b64decode(kv["state"]), np.uint8)
    pos = np.frombuffer(base64.b64decode(kv["pos"]), f"<u{kv['pos_bytes']}")
    assert len(state) == len(pos) == kv["num_blocks"]
    return state, pos


def assert_map_matches_pool(snap: dict, engine) -> np.ndarray:
    """The snapshot's block states are the pool's truth, block by block; returns the positions."""
    pool = engine.engine_core.kv.pool
    truth = np.array(
        [
            SHARED if b.ref_cnt > 1 else USED if b.ref_cnt == 1 else CACHED if b.block_hash is not None else FREE
            for b in pool.blocks
        ],
        np.uint8,
    )
    state, pos = decode_map(snap["kv"])
    np.testing.assert_array_equal(state, truth)
    kv = snap["kv"]
    assert [kv["free"], kv["cached"], kv["used"], kv["shared"]] == np.bincount(truth, minlength=4).tolist()
    assert kv["used"] + kv["shared"] == len(pool.blocks) - pool.num_free_blocks
    # a held block's position is its index in every holder's block table
    for row in snap["requests"]:
        assert row["blocks"] == [b.block_id for b in engine.engine_core.kv.held_blocks(row["id"])]
        assert pos[row["blocks"]].tolist() == list(range(len(row["blocks"])))
    return pos


def test_request_states_counts_and_chunks(llm):
    engine = llm.engine
    tok = llm.tokenizer
    long_prompt = list(range(1000, 1150))  # 150 tokens: chunks of 64, 64, 22
    engine.add_request("a", long_prompt, SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("b", tok.encode("The capital of France is"), SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("c", tok.encode("Hello"), SamplingParams(max_tokens=8, **GREEDY))
    snapper = Snapshotter(engine)
    try:
        snap = snapper.take()
        assert [(r["id"], r["state"]) for r in snap["requests"]] == [
            ("a", "waiting"),
            ("b", "waiting"),
            ("c", "waiting"),
        ]
        assert snap["kv"]["used"] == 0

        engine.step()
        snap = snapper.take()
        a = snap["requests"][0]
        assert (a["id"], a["state"], a["chunk"], a["computed"], a["output"]) == ("a", "prefilling", [2, 3], 64, 0)
        assert a["ttft"] is None and a["queue"] >= 0 and a["max_tokens"] == 8
        assert (snap["num_running"], snap["num_waiting"]) == (1, 2)
        assert_map_matches_pool(snap, engine)

        engine.step()
        engine.step()  # a's last chunk (22 tokens) and b's whole prompt share this step
        snap = snapper.take()
        rows = {r["id"]: r for r in snap["requests"]}
        assert rows["a"]["state"] == rows["b"]["state"] == "decoding"
        assert rows["a"]["output"] == 1 and rows["a"]["computed"] == 150 and rows["a"]["ttft"] > 0
        assert rows["c"]["state"] == "waiting"  # max_num_seqs = 2
        assert len(rows["a"]["blocks"]) == -(-150 // 16)
        steps = snap["steps"]
        assert steps["prefill"][-3:] == [64, 64, 22 + rows["b"]["prompt"]] and steps["decode"][-3:] == [0, 0, 0]
        assert_map_matches_pool(snap, engine)

        engine.step()
        snap = snapper.take()
        assert snap["steps"]["decode"][-1] == 2 and snap["steps"]["prefill"][-1] == 0
        while engine.has_unfinished_requests():
            engine.step()
        snap = snapper.take()
        assert snap["requests"] == [] and snap["kv"]["used"] == snap["kv"]["shared"] == 0
        assert [req.request_id for _, req in engine.engine_core.step_log.finished][-3:] == ["a", "b", "c"]
        # finished requests are listed for FINISHED_SHOWN_S seconds
        recent = {
            req.request_id for t, req in engine.engine_core.step_log.finished if snap["time"] - t < FINISHED_SHOWN_S
        }
        assert {r["id"] for r in snap["finished"]} == recent and "c" in recent
        assert all(r["state"] == "finished" and r["reason"] == "length" and r["output"] == 8 for r in snap["finished"])
        assert snap["finished"][-1]["tokens_per_s"] > 0
        # the finished requests' full blocks stay in the prefix cache, evictable, positions remembered
        pos = assert_map_matches_pool(snap, engine)
        state, _ = decode_map(snap["kv"])
        assert snap["kv"]["cached"] > 0
        assert (pos[state == CACHED] != snap["kv"]["pos_unknown"]).all()
    finally:
        for rid in "abc":
            engine.abort_request(rid)


def test_shared_blocks_of_n_samples_and_prefix_hits(llm):
    engine = llm.engine
    llm.reset_prefix_cache()
    prompt = list(range(2000, 2040))  # 40 tokens: two full blocks, then 8 in the third
    engine.add_request("n3", prompt, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=0))
    snapper = Snapshotter(engine)
    try:
        engine.step()
        snap = snapper.take()
        # max_num_seqs = 2: two samples run; the second found the first's two full blocks cached
        running = [r for r in snap["requests"] if r["state"] != "waiting"]
        assert len(running) == 2 and running[1]["cached"] == 32
        pos = assert_map_matches_pool(snap, engine)
        state, _ = decode_map(snap["kv"])
        shared = np.flatnonzero(state == SHARED)
        assert snap["kv"]["shared"] == 2 and pos[shared].tolist() == [0, 1]
        assert all(set(shared) <= set(r["blocks"]) for r in running)
        while engine.has_unfinished_requests():
            engine.step()

        # a new request with the same first 32 tokens takes the cached blocks back
        engine.add_request("hit", prompt[:32] + [7, 8, 9], SamplingParams(max_tokens=2, **GREEDY))
        engine.step()
        snap = snapper.take()
        (row,) = snap["requests"]
        assert row["cached"] == 32 and row["blocks"][:2] == shared.tolist()
        assert_map_matches_pool(snap, engine)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.abort_request("n3")
        engine.abort_request("hit")


def test_preemptions_in_step_log_and_timings():
    # 6 blocks of 16 tokens: two 44-token prompts fill them; the first to need a fourth block preempts
    llm = make_llm(kv_cache_memory=6 * 16 * 2 * 30 * 3 * 64 * 4)
    prompts = [list(range(100 * i, 100 * i + 44)) for i in range(1, 3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    engine = llm.engine
    assert engine.engine_core.scheduler.num_preemptions > 0
    assert sum(s[4] for s in engine.engine_core.step_log.steps) == engine.engine_core.scheduler.num_preemptions
    assert sum(o.metrics.num_preemptions for o in outs) == engine.engine_core.scheduler.num_preemptions
    assert sum(s[2] for s in engine.engine_core.step_log.steps) <= engine.engine_core.scheduler.num_generation_tokens
    for out in outs:
        t = out.metrics.timings()
        assert t["predicted_n"] == len(out.outputs[0].token_ids) == 12
        assert t["prompt_n"] + t["cached_n"] == len(out.prompt_token_ids) and t["cache_n"] == t["cached_n"]
        assert t["queue_ms"] >= 0 and t["prompt_ms"] > 0 and t["predicted_ms"] > 0
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / 12)
        assert t["predicted_per_second"] == pytest.approx(12e3 / t["predicted_ms"])
        assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] * 1e3 / t["prompt_ms"])


def test_timings_count_prefix_hits_and_samples(llm):
    llm.reset_prefix_cache()
    prompt = list(range(3000, 3050))
    first, second = (
        llm.generate([prompt], SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)[0] for _ in range(2)
    )
    assert first.metrics.timings()["cached_n"] == 0 and first.metrics.timings()["prompt_n"] == 50
    assert second.metrics.timings()["cached_n"] == 48 and second.metrics.timings()["prompt_n"] == 2
    assert second.num_cached_tokens == 48
    # n = 2: counts add up over the samples (the second sample's prompt mostly hits the cache)
    out = llm.generate([prompt[:40]], SamplingParams(n=2, max_tokens=3, **GREEDY), use_tqdm=False)[0]
    t = out.metrics.timings()
    assert t["predicted_n"] == 6 and t["prompt_n"] + t["cached_n"] == 80 and t["cached_n"] >= 32


def test_slot_rate_limit_and_idle_snapshot(llm):
    engine = llm.engine
    slot = SnapshotSlot(engine, max_rate=5.0)
    slot.offer()
    assert slot.latest is None  # no reader, no snapshot
    slot.add_reader()
    engine.add_request("busy", list(range(50)), SamplingParams(max_tokens=1000, **GREEDY))
    published = []  # snapshot times, one per new seq
    try:
        while len(published) < 4:
            slot.offer()
            if slot.seq > len(published):
                published.append(slot.latest["time"])
            engine.step()
    finally:
        engine.abort_request("busy")
    assert slot.seq == 4 and all(b - a >= 0.2 for a, b in zip(published, published[1:]))
    # the return to idle is published once due, then nothing more is taken
    assert slot.next_due() is not None
    time.sleep(slot.next_due())
    slot.offer()
    assert slot.latest["requests"] == [] and slot.latest["time"] - published[-1] >= 0.2
    assert slot.next_due() is None
    slot.offer()
    assert slot.seq == 5
    # snapshots are spaced so that taking them costs at most max_overhead of the time
    costly = SnapshotSlot(engine, max_overhead=1e-9)
    costly.add_reader()
    costly.offer()
    costly.add_reader()  # a new reader is served at once...
    costly.offer()
    assert costly.seq == 2
    engine.add_request("busy2", list(range(50)), SamplingParams(max_tokens=4, **GREEDY))
    try:
        engine.step()
        costly.offer()  # ...but otherwise the next one waits cost / max_overhead
        assert costly.seq == 2 and costly.next_due() > 60
    finally:
        engine.abort_request("busy2")


def test_embedding_requests_show_as_embed(llm):
    engine = llm.engine
    snapper = Snapshotter(engine)
    engine.add_request("e", list(range(100, 140)), SamplingParams(max_tokens=0), pooling=True)
    engine.add_request("g", list(range(200, 240)), SamplingParams(max_tokens=2, **GREEDY))
    try:
        kinds = {r["id"]: r["kind"] for r in snapper.take()["requests"]}
        assert kinds == {"e": "embed", "g": "generate"}
    finally:
        engine.abort_request("e")
        engine.abort_request("g")
