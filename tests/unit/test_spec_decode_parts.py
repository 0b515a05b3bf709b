"""Speculative decoding's parts without the model: the n-gram proposer on hand-made histories, the
config's vLLM defaults and errors, the scheduler and KV cache with draft tokens (only verified
blocks enter the prefix cache), and the draft-length policy."""

import subprocess
import sys

import numpy as np
import pytest

from engine.config import SpeculativeConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kv_transfer.connector import NoKVConnector
from engine.sample.rejection_sampler import WithDrafts
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram import find_ngram_proposal
from engine.spec_decode.policy import DraftLengthPolicy
from engine.worker.input_batch import CachedRequestState


def propose(tokens, min_n, max_n, k):
    return find_ngram_proposal(np.array(tokens, dtype=np.int64), min_n, max_n, k)


def test_ngram_longest_match_wins():
    # the suffix [1, 2, 3] occurs once (followed by 7, 8); the 2-gram [2, 3] earlier (followed by 5)
    tokens = [2, 3, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3]
    assert propose(tokens, 2, 3, 2) == [7, 8]
    assert propose(tokens, 2, 2, 2) == [5, 1]  # max_n = 2: only 2-grams count; earliest wins


def test_ngram_earliest_occurrence_and_bounds():
    assert propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]  # vLLM's docstring example
    tokens = [4, 5, 6, 9, 4, 5, 7, 4, 5]
    assert propose(tokens, 2, 5, 3) == [6, 9, 4]  # two earlier [4, 5]: the first one
    assert propose(tokens, 3, 5, 3) == []  # no 3-gram matches: below min_n
    assert propose([1, 2, 1], 1, 1, 5) == [2, 1]  # the continuation may run into the suffix
    assert propose([1, 2, 3], 1, 3, 4) == []  # nothing repeats
    assert propose([7, 7, 7, 7], 2, 2, 2) == [7, 7]  # overlapping occurrences count


def test_ngram_length_capped_by_k_and_the_end():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(tokens, 2, 2, 3) == [3, 4, 5]
    assert propose(tokens, 2, 2, 10) == [3, 4, 5, 6, 1, 2]
    assert propose(tokens, 2, 2, 0) == []


def test_proposals_are_capped_by_max_tokens_and_max_model_len():
    from engine.spec_decode.speculator import Speculator

    spec = Speculator.__new__(Speculator)  # only _cap: no model needed
    spec.k, spec.max_model_len = 4, 20

    def view(prompt_len, max_tokens, sampled):
        state = CachedRequestState(
            "a",
            list(range(prompt_len)),
            SamplingParams(max_tokens=max_tokens),
            frozenset(),
            [],
            0,
            token_ids=list(range(prompt_len)),
        )
        return WithDrafts(state, sampled)  # the request with the tokens it just sampled

    assert spec._cap(view(10, 3, [1])) == 1  # 3 output tokens at most: 1 sampled, 1 draft + the next step's
    assert spec._cap(view(10, 3, [1, 2])) == 0
    assert spec._cap(view(16, None, [1])) == 2  # room for 3 more tokens before max_model_len 20


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"method": "ngram", "num_speculative_tokens": 4}, (5, 5)),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, (3, 3)),
        ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}, (2, 2)),
        ({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 5}, (2, 5)),
    ],
)
def test_config_defaults_as_vllm(data, expected):
    config = SpeculativeConfig.from_dict(data)
    assert config.method == "ngram" and (config.prompt_lookup_min, config.prompt_lookup_max) == expected
    assert SpeculativeConfig.from_dict({"model": "/some/dir", "num_speculative_tokens": 3}).method == "draft_model"


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 6, "prompt_lookup_max": 5},
            "must be <=",
        ),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "magic", "num_speculative_tokens": 2}, "unknown speculative_config method"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown speculative_config key"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 8, 1]]},
            "must start at 1",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "num_speculative_tokens_per_batch_size": [[1, 8, 1], [8, 9, 0]],
            },
            "must not overlap",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 8]]},
            "3 integers",
        ),
    ],
)
def test_config_errors(data, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(data)


def test_batch_size_schedule_as_vllm():
    config = SpeculativeConfig.from_dict(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[17, 32, 1], [1, 8, 6], [64, 64, 0]],
        }
    )
    # k capped at num_speculative_tokens; gaps and the tail keep the k before them
    assert [config.tokens_for_batch(b) for b in (1, 8, 9, 16, 17, 32, 33, 63, 64, 200)] == [
        4,
        4,
        4,
        4,
        1,
        1,
        1,
        1,
        0,
        0,
    ]
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}).tokens_for_batch(500) == 3


@pytest.mark.slow
def test_server_refuses_a_bad_config_in_one_line():
    bad = subprocess.run(
        [
            sys.executable,
            "server.py",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 6, "prompt_lookup_max": 5}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "server.py: error: --speculative-config: prompt_lookup_min (6) must be <= prompt_lookup_max (5)"
    ]


def make_request(rid, prompt, drafts=()):
    req = Request(rid, list(prompt), SamplingParams(max_tokens=64), frozenset())
    req.spec_token_ids = list(drafts)
    return req


def test_only_verified_blocks_enter_the_prefix_cache():
    kv = KVCacheManager(16, 4)
    req = make_request("a", range(6))  # 6 tokens: one full block
    assert kv.allocate_slots(req, 6)
    req.num_computed_tokens = 5  # as after a step: the last token is computed with the next one
    req.all_token_ids.append(6)
    assert len(kv.pool.cached) == 1
    # next step: the last token + 3 drafts fill block 1 (positions 4..7) and reach block 2 (8)
    req.spec_token_ids = [7, 8, 9]
    assert kv.allocate_slots(req, 4)
    assert len(kv.req_blocks["a"][0]) == 3 and len(kv.pool.cached) == 1  # block 1 holds drafts: not cached
    # two drafts accepted (7, 8) plus a bonus token: positions 4..7 are verified now
    req.all_token_ids += [7, 8, 10]
    req.num_computed_tokens = 9
    req.spec_token_ids = []
    assert kv.allocate_slots(req, 1)
    assert len(kv.pool.cached) == 2 and req.block_hashes[1] in kv.pool.cached
    # the same prefix from another request hits both verified blocks
    hits, n = kv.get_computed_blocks(make_request("b", list(range(7)) + [7, 8, 10]))
    assert n == 8 and [b.block_id for b in hits[0]] == kv.block_ids("a")[0][:2]
    kv.free(req)
    assert kv.pool.num_free_blocks == 16 and not kv.num_cached_blocks


def test_scheduler_gives_drafts_slots_under_the_budget():
    sched = Scheduler(
        KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, max_model_len=4096, connector=NoKVConnector()
    )
    a, b = make_request("a", range(8)), make_request("b", range(100, 108))
    for req in (a, b):
        sched.add_request(req)
    sched.schedule()  # prefill 8 + 2
    for req, computed in ((a, 7), (b, 7)):
        req.num_computed_tokens = computed
        req.all_token_ids.append(1)
    a.spec_token_ids, b.spec_token_ids = [5, 6, 7, 8], [5, 6, 7, 8]
    out = sched.schedule()
    # a: its 2 tokens (last prompt token + sampled) + 4 drafts; b: the 4 tokens left of the budget
    assert list(out.num_scheduled_tokens.values()) == [6, 4] and out.total_num_scheduled_tokens == 10
    assert a.spec_token_ids == [5, 6, 7, 8] and b.spec_token_ids == [5, 6]  # b's drafts cut to fit
    assert out.scheduled_spec_decode_tokens == {"a": [5, 6, 7, 8], "b": [5, 6]}


def test_policy_drafts_less_as_the_batch_grows():
    policy = DraftLengthPolicy(num_speculative_tokens=5, break_even_batch=24)
    req = make_request("a", range(4))
    assert policy.lengths([req], [5], num_running=1) == [4]  # prior 1/2: 0.5^4 = 0.06 > 1/25
    for _ in range(10):  # every draft accepted
        policy.observe(req.request_id, [1, 2, 3], [1, 2, 3, 4])
    assert policy.lengths([req], [5], num_running=1) == [5]
    assert 1 <= policy.lengths([req], [5], num_running=64)[0] < 5
    assert policy.lengths([req], [2], num_running=1) == [2]  # the cap
    for _ in range(10):  # every draft rejected at once
        policy.observe(req.request_id, [1, 2, 3], [9])
    assert policy.lengths([req], [5], num_running=64) == [0]
    assert policy.lengths([req], [5], num_running=1)[0] >= 1
    # a shadow proposal that the sampled token confirms raises the rate
    before = policy.requests["a"].rate
    policy.keep_shadow(req.request_id, [3])
    policy.observe(req.request_id, [], [3])
    assert policy.requests["a"].rate > before
    policy.free(req.request_id)
    assert not policy.requests
