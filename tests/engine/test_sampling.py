"""Sampling parameters on the real model: seeds, stops, logprobs, penalties, n > 1, validation."""

import pytest

from engine import SamplingParams

COUNT = "1, 2, 3, 4, 5,"  # greedy continuation: " 6, 7, 8, 9, 10, 11, ..."


def texts(outs):
    return [o.outputs[0].text for o in outs]


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_across_batches(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=20),
        seeded,
        SamplingParams(temperature=0.7, top_k=5, max_tokens=12),
    ]
    batch = llm.generate(["Hello there", "The weather", "Once upon a time", "In 1999"], others, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate(["Once upon a time"], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_string_spanning_tokens(llm):
    full = llm.generate([COUNT], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert full.text.startswith(" 6, 7, 8, 9")
    out = llm.generate([COUNT], SamplingParams(temperature=0, max_tokens=20, stop=["7, 8"]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (" 6, ", "stop", "7, 8")
    out = llm.generate(
        [COUNT],
        SamplingParams(temperature=0, max_tokens=20, stop=["7, 8"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text == " 6, 7, 8"


def test_stop_token_ids_and_length(llm):
    comma = llm.tokenizer.convert_tokens_to_ids(",")
    out = llm.generate([COUNT], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[comma]), use_tqdm=False)[
        0
    ].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" 6", "stop", comma)
    assert out.token_ids[-1] == comma
    out = llm.generate([COUNT], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


@pytest.mark.slow
def test_eos_min_tokens_and_ignore_eos(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert "Paris" in short.text and short.finish_reason == "stop" and short.stop_reason is None
    n = len(short.token_ids)
    longer = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 5), use_tqdm=False)[0]
    assert len(longer.outputs[0].token_ids) >= n + 5
    ignored = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=n + 10, ignore_eos=True), use_tqdm=False)[0]
    assert len(ignored.outputs[0].token_ids) == n + 10 and ignored.outputs[0].finish_reason == "length"


def test_logprobs_top_n(llm):
    out = llm.generate([COUNT], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for token, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0][0] == token  # greedy = the most likely
        assert lp.top_logprobs[0][1] == pytest.approx(lp.logprob)
    assert c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))


def test_logit_bias_and_penalties(llm):
    x = llm.tokenizer.convert_tokens_to_ids("x")
    out = llm.generate([COUNT], SamplingParams(temperature=0, max_tokens=4, logit_bias={x: 100}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [x] * 4
    plain, rep = llm.generate(
        [COUNT, COUNT],
        [
            SamplingParams(temperature=0, max_tokens=16),
            SamplingParams(temperature=0, max_tokens=16, repetition_penalty=2.0),
        ],
        use_tqdm=False,
    )
    assert plain.outputs[0].token_ids != rep.outputs[0].token_ids
    freq = llm.generate([COUNT], SamplingParams(temperature=0, max_tokens=16, frequency_penalty=2.0), use_tqdm=False)[0]
    c = freq.outputs[0].token_ids
    assert max(c.count(t) for t in c) < max(plain.outputs[0].token_ids.count(t) for t in plain.outputs[0].token_ids)


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode("The history of the printing press " * 12)[:70]  # 4 full blocks + 6
    engine.add_request("n2", prompt, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4))
    engine.step()
    (a,), (b,) = engine.engine_core.kv.req_blocks["n2#0"], engine.engine_core.kv.req_blocks["n2#1"]
    assert a[:4] == b[:4] and all(blk.ref_cnt == 2 for blk in a[:4])  # same blocks, no copies
    assert a[4] is not b[4]
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].finished
    res = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6), use_tqdm=False)[0]
    assert [c.index for c in res.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in res.outputs}) > 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": -1}, "max_tokens"),  # 0 = prompt only
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {1: 500}}, "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_clearly(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * llm.engine.max_model_len], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], use_tqdm=False)
