"""The server through the official openai SDK: completions and chat, streamed and not, with the
OpenAI and vLLM sampling fields; and greedy text equal to the offline LLM API's."""

import asyncio

import pytest

from engine import LLM, SamplingParams

MODEL_NAME = "SmolLM2-135M-Instruct"

pytest_plugins = ["server_harness"]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "My favourite colour is"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


async def test_models_lists_the_served_model(openai_client):
    models = (await openai_client.models.list()).data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "vllm" and models[0].model_extra["max_model_len"] == 2048


async def test_completion_with_usage(openai_client):
    r = await openai_client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL_NAME and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and "Paris" in choice.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


@pytest.mark.slow
async def test_greedy_text_equals_offline_llm(openai_client, engine_args):
    """Completions (four prompts in one request) and chat, greedy, equal `LLM.generate`/`LLM.chat`."""
    api = await openai_client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=16, temperature=0)
    chat = await openai_client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0)

    llm = LLM(model=None, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=16)

    def offline() -> tuple[list[str], str]:
        texts = [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]
        return texts, llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text

    # Generating on a worker thread, as the server does, keeps this event loop free; and the thread
    # that built the engine (it called torch.set_num_threads) runs many times slower while other
    # processes load the CPU, as its OpenMP workers spin.
    texts, chat_text = await asyncio.to_thread(offline)
    assert [c.text for c in sorted(api.choices, key=lambda c: c.index)] == texts
    assert chat.choices[0].message.content == chat_text


async def test_chat_completion(openai_client):
    r = await openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "You are a geography teacher."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}],
            },
        ],
        max_completion_tokens=12,
        temperature=0,
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and "Paris" in r.choices[0].message.content
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


async def test_chat_stream_matches_non_stream_and_ends_with_usage(openai_client):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0)
    full = await openai_client.chat.completions.create(**kwargs)
    chunks = [
        c
        async for c in await openai_client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] == full.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


async def test_completion_stream_n2_each_choice_streams_and_finishes(openai_client, http):
    stream = await openai_client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    texts, finish = {0: "", 1: ""}, {}
    usage = None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in finish, "a chunk after the choice's finish_reason"
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "length", 1: "length"} and all(texts.values())
    assert usage.completion_tokens == 12 and usage.prompt_tokens == len(await _tokenize(http, PROMPTS[1]))


async def _tokenize(http, prompt: str) -> list[int]:
    return (await http.post("/tokenize", json={"prompt": prompt})).json()["tokens"]


async def test_n2_non_stream_and_seed_reproducible(openai_client):
    kwargs = dict(
        model=MODEL_NAME,
        prompt=PROMPTS[3],
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    first = await openai_client.completions.create(**kwargs)
    second = await openai_client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1] and first.usage.completion_tokens == 16
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


async def test_stop_string_and_stop_token(openai_client, http):
    base = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    r = await openai_client.completions.create(**base, stop=["."])
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "."
    r = await openai_client.completions.create(**base, stop=["."], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == " Paris."
    [period] = await _tokenize(http, ".")
    r = await openai_client.completions.create(**base, extra_body={"stop_token_ids": [period]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == period


async def test_completion_logprobs_and_echo(openai_client):
    r = await openai_client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 4
    for token, logprob, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert logprob <= 0 and token in top and 3 <= len(top) <= 4
        assert max(top.values()) == logprob  # greedy picks the most likely token
        assert r.choices[0].text[offset : offset + len(token)] == token
    echo = await openai_client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=1, echo=True
    )
    text, lp = echo.choices[0].text, echo.choices[0].logprobs
    assert text == PROMPTS[0] + r.choices[0].text
    # prompt tokens are scored too (the first has no logprob, as in OpenAI's API): tests/server/test_server_clients.py
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and None not in lp.token_logprobs[1:]
    assert lp.token_logprobs[5:] == pytest.approx(r.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert "".join(lp.tokens) == text and all(text[o : o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset))


async def test_chat_logprobs_and_top_logprobs(openai_client):
    r = await openai_client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob and t.bytes == list(t.token.encode())


async def test_sampling_extras_are_accepted(openai_client):
    r = await openai_client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=6,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"16": -100},
        user="tester",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 6,
            "ignore_eos": True,
            "skip_special_tokens": True,
        },
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6


async def test_cached_tokens_on_repeated_long_prompt(openai_client):
    prompt = "The quick brown fox jumps over the lazy dog while the cat watches. " * 25  # ~350 tokens
    first = await openai_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = await openai_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 300
    assert second.usage.prompt_tokens_details.cached_tokens >= 256  # whole 16-token blocks, all but the last
    assert second.choices[0].text == first.choices[0].text
