"""The worker's side of the seam without a model: its copy of every request kept from synthetic SchedulerOutputs
(new requests whole, then diffs; resumed requests with all their blocks; finished ones dropped), and a step's
flat inputs built from it (decodes first, positions, slot mapping, logits rows of drafts, prompt-logprob rows)."""

import torch

from engine.core.step_io import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.worker.input_batch import InputBatch, build_model_inputs

BLOCK = 4


def new(req_id, prompt, blocks, computed=0, **params):
    return NewRequestData(req_id, list(prompt), SamplingParams(**params), frozenset({2}), (list(blocks),), computed)


def cached(*rows):
    """rows: (req_id, new tokens, new blocks, computed, resumed)."""
    return CachedRequestData(
        *map(list, zip(*[(r, resumed, toks, (blocks,), computed) for r, toks, blocks, computed, resumed in rows]))
    )


def test_states_follow_new_requests_diffs_resumes_and_finishes():
    batch = InputBatch()
    batch.update_states(
        SchedulerOutput(
            [new("a", range(10, 16), [3, 4], seed=7), new("b", range(20, 23), [5])],
            num_scheduled_tokens={"a": 6, "b": 3},
        )
    )
    a = batch.requests["a"]
    assert a.token_ids == list(range(10, 16)) and a.block_ids == ([3, 4],) and a.output_token_ids == []
    assert torch.equal(torch.rand(3, generator=a.generator), torch.rand(3, generator=torch.Generator().manual_seed(7)))
    assert batch.requests["b"].generator is None
    batch.update_states(
        SchedulerOutput(
            scheduled_cached_reqs=cached(("a", [99], [], 6, False), ("b", [98], [6], 3, False)),
            num_scheduled_tokens={"a": 1, "b": 1},
        )
    )
    assert a.token_ids[-1] == 99 and a.output_token_ids == [99] and a.num_computed_tokens == 6
    assert batch.requests["b"].block_ids == ([5, 6],)
    # b was preempted: it comes back with all its blocks; a finished
    batch.update_states(
        SchedulerOutput(
            scheduled_cached_reqs=cached(("b", [97], [8, 9], 0, True)),
            num_scheduled_tokens={"b": 5},
            finished_req_ids={"a"},
        )
    )
    assert set(batch.requests) == {"b"}
    b = batch.requests["b"]
    assert b.block_ids == ([8, 9],) and b.token_ids == [20, 21, 22, 98, 97] and b.num_computed_tokens == 0


def test_inputs_put_decodes_first_and_give_logits_at_drafts():
    batch = InputBatch()
    so = SchedulerOutput(
        [new("p", range(10, 20), [0, 1, 2]), new("d", range(30, 35), [3, 4], computed=4)],
        num_scheduled_tokens={"p": 6, "d": 1},
    )
    batch.update_states(so)
    step = batch.prepare(so, BLOCK, torch.device("cpu"))
    inputs, (meta,) = step.model_inputs, step.model_inputs.attn_metadata
    # the decode row first: d's last prompt token at position 4 (block 4, slot 16); then p's first 6 tokens
    assert inputs.input_ids.tolist() == [34] + list(range(10, 16))
    assert inputs.positions.tolist() == [4, 0, 1, 2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [16, 0, 1, 2, 3, 4, 5] and meta.num_decodes == 1
    assert meta.seq_lens.tolist() == [5, 6] and meta.query_start_loc.tolist() == [0, 1, 7]
    assert [r.req_id for r in step.sampled] == ["d"] and inputs.logits_indices.tolist() == [0]  # p still prefills
    # next step: p's last 4 prompt tokens; d verifies 2 drafts after its sampled token
    so = SchedulerOutput(
        scheduled_cached_reqs=cached(("p", [], [], 6, False), ("d", [40], [], 5, False)),
        num_scheduled_tokens={"p": 4, "d": 3},
        scheduled_spec_decode_tokens={"d": [41, 42]},
    )
    batch.update_states(so)
    step = batch.prepare(so, BLOCK, torch.device("cpu"))
    inputs = step.model_inputs
    assert inputs.input_ids.tolist() == [16, 17, 18, 19, 40, 41, 42]
    assert inputs.positions.tolist() == [6, 7, 8, 9, 5, 6, 7]
    assert inputs.attn_metadata[0].slot_mapping.tolist() == [6, 7, 8, 9, 17, 18, 19]
    # p samples at its last position; d at its 1 + 2 positions
    assert [r.req_id for r in step.sampled] == ["p", "d"] and inputs.logits_indices.tolist() == [3, 4, 5, 6]


def test_prompt_only_requests_give_no_logits_and_prompt_logprob_rows_are_collected_once():
    batch = InputBatch()
    so = SchedulerOutput(
        [new("e", range(10, 18), [0, 1], max_tokens=0), new("l", range(20, 26), [2, 3], prompt_logprobs=1)],
        num_scheduled_tokens={"e": 8, "l": 4},
    )
    batch.update_states(so)
    step = batch.prepare(so, BLOCK, torch.device("cpu"))
    assert step.sampled == [] and step.model_inputs.logits_indices.tolist() == []
    # l's positions 0..3 predict its prompt tokens 1..4: rows 8..11
    [rows] = step.prompt_rows
    assert (rows.request.req_id, rows.row, rows.position, rows.count) == ("l", 8, 0, 4)
    so = SchedulerOutput(scheduled_cached_reqs=cached(("l", [], [], 4, False)), num_scheduled_tokens={"l": 2})
    batch.update_states(so)
    [rows] = batch.prepare(so, BLOCK, torch.device("cpu")).prompt_rows
    assert (rows.position, rows.count) == (4, 1)  # the last prompt token predicts nothing in the prompt
    assert batch.requests["l"].num_prompt_logprobs == 6


def test_each_kv_cache_group_gets_its_own_block_tables_and_slots():
    """A model mixing attention kinds has a block table per KV cache group: the same rows, positions and
    sequence lengths, each group's tokens written to its own blocks (the null block 0 where a sliding group
    freed the blocks before the window)."""
    batch = InputBatch()
    req = NewRequestData("a", list(range(10)), SamplingParams(), frozenset(), ([5, 6, 7], [0, 8, 9]), 8)
    so = SchedulerOutput([req], num_scheduled_tokens={"a": 2})
    batch.update_states(so)
    full, sliding = batch.prepare(so, BLOCK, torch.device("cpu")).model_inputs.attn_metadata
    assert full.slot_mapping.tolist() == [7 * BLOCK, 7 * BLOCK + 1] and sliding.slot_mapping.tolist() == [36, 37]
    assert full.block_tables.tolist() == [[5, 6, 7]] and sliding.block_tables.tolist() == [[0, 8, 9]]
    assert full.seq_lens is sliding.seq_lens and full.num_decodes == sliding.num_decodes == 0
    batch.update_states(SchedulerOutput(scheduled_cached_reqs=cached(("a", [1], [], 10, False))))
    assert batch.requests["a"].block_ids == ([5, 6, 7], [0, 8, 9])


def test_a_decode_step_builds_what_the_general_rows_build():
    """A step of decodes only (a token and its logits a row) takes a shorter path; its inputs equal those the general
    path builds for the same rows (forced by a prompt row after them that gives no logits), in each of two KV cache
    groups: token ids, positions, slots, block tables, sequence lengths, row offsets and logits rows."""
    rows = [[11], [12], [13]]
    starts = [9, 0, 4]
    tables = [([5, 6, 7], [0, 8, 9]), ([1], [2]), ([3, 4], [0, 10])]
    cpu = torch.device("cpu")
    decode, qsl = build_model_inputs(rows, starts, tables, [1, 1, 1], BLOCK, cpu)
    general, qsl_g = build_model_inputs(
        rows + [[20, 21]], starts + [0], tables + [([11], [12])], [1, 1, 1, 0], BLOCK, cpu
    )
    assert decode.input_ids.tolist() == general.input_ids.tolist()[:3] == [11, 12, 13]
    assert decode.positions.tolist() == general.positions.tolist()[:3] == [9, 0, 4]
    assert decode.logits_indices.tolist() == general.logits_indices.tolist() == [0, 1, 2]
    assert qsl.tolist() == qsl_g.tolist()[:4]
    for d, g in zip(decode.attn_metadata, general.attn_metadata, strict=True):
        assert d.slot_mapping.tolist() == g.slot_mapping.tolist()[:3]
        assert d.seq_lens.tolist() == g.seq_lens.tolist()[:3] and d.query_start_loc.tolist() == qsl.tolist()
        assert d.block_tables.tolist() == [r[: d.block_tables.shape[1]] for r in g.block_tables.tolist()[:3]]
        assert d.num_decodes == g.num_decodes == 3 and d.seq_lens_cpu == [10, 1, 5]
    assert decode.attn_metadata[0].slot_mapping.tolist() == [7 * BLOCK + 1, 1 * BLOCK, 4 * BLOCK]
