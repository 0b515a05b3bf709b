"""Bad requests get OpenAI error bodies with the right status and `param`, never a 500 or a
traceback, and the server stays healthy; odd but valid values are served."""

import json

import pytest

pytest_plugins = ["server_harness"]

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def cmpl(**fields) -> dict:
    return {"prompt": "Hello", "max_tokens": 2} | fields


def chat(**fields) -> dict:
    return {"messages": MSGS, "max_tokens": 2} | fields


# (method, path, body: dict = JSON, bytes = raw, expected status, expected param)
BAD_REQUESTS = [
    ("POST", CMPL, b"{bad json", 400, None),
    ("POST", CMPL, b"\xff\xfe not utf-8", 400, None),
    ("POST", CMPL, b'{"prompt": "\\ud800"}', 400, None),  # lone surrogate
    ("POST", CMPL, b'{"prompt": "x", "temperature": 1e400}', 400, None),  # infinity
    ("POST", CMPL, b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("POST", CMPL, b"[" * 100_000, 400, None),  # nesting deeper than any parser should follow
    ("POST", CMPL, [], 400, None),
    ("POST", CMPL, {"max_tokens": 2}, 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=""), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[]), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=["ok", ""]), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[[]]), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[1.5]), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[-1]), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[10**9]), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[[1, 2], [3, 10**9]]), 400, "prompt"),
    ("POST", CMPL, cmpl(prompt=[1] * 2100), 400, "prompt"),  # longer than max_model_len by itself
    ("POST", CMPL, cmpl(max_tokens=5000), 400, "max_tokens"),  # prompt + max_tokens > max_model_len
    ("POST", CMPL, cmpl(max_tokens=0), 400, "max_tokens"),
    ("POST", CMPL, cmpl(max_tokens="5"), 400, "max_tokens"),
    ("POST", CMPL, cmpl(temperature=-0.1), 400, "temperature"),
    ("POST", CMPL, cmpl(temperature="hot"), 400, "temperature"),
    ("POST", CMPL, cmpl(top_p=0), 400, "top_p"),
    ("POST", CMPL, cmpl(top_p=1.01), 400, "top_p"),
    ("POST", CMPL, cmpl(n=0), 400, "n"),
    ("POST", CMPL, cmpl(n=True), 400, "n"),
    ("POST", CMPL, cmpl(n=100_000), 400, "n"),
    ("POST", CMPL, cmpl(logprobs=21), 400, "logprobs"),
    ("POST", CMPL, cmpl(presence_penalty=2.5), 400, "presence_penalty"),
    ("POST", CMPL, cmpl(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("POST", CMPL, cmpl(repetition_penalty=0), 400, "repetition_penalty"),
    ("POST", CMPL, cmpl(top_k=-2), 400, "top_k"),
    ("POST", CMPL, cmpl(min_p=1.5), 400, "min_p"),
    ("POST", CMPL, cmpl(seed=2**64), 400, "seed"),
    ("POST", CMPL, cmpl(stop=[""]), 400, "stop"),
    ("POST", CMPL, cmpl(stop=5), 400, "stop"),
    ("POST", CMPL, cmpl(stop=["x"] * 65), 400, "stop"),
    ("POST", CMPL, cmpl(prompt=["x"] * 1025), 400, "prompt"),
    ("POST", CMPL, cmpl(stop_token_ids=[1] * 1025), 400, "stop_token_ids"),
    ("POST", CMPL, cmpl(logit_bias={"x": 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"²": 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"9" * 5000: 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"5": 101}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("POST", CMPL, cmpl(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("POST", CMPL, cmpl(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("POST", CMPL, cmpl(min_tokens=3), 400, "min_tokens"),  # above max_tokens
    ("POST", CMPL, cmpl(echo="yes"), 400, "echo"),
    ("POST", CMPL, cmpl(stream_options={"include_usage": True}), 400, "stream_options"),
    ("POST", CMPL, cmpl(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options"),
    ("POST", CMPL, cmpl(model="gpt-4"), 404, "model"),
    ("POST", CHAT, {"max_tokens": 2}, 400, "messages"),
    ("POST", CHAT, chat(messages=[]), 400, "messages"),
    ("POST", CHAT, chat(messages=[{"role": "wizard", "content": "Hi"}]), 400, "messages"),
    ("POST", CHAT, chat(messages=[{"role": "user"}]), 400, "messages"),
    (
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages",
    ),
    ("POST", CHAT, chat(messages="Hi"), 400, "messages"),
    ("POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),  # without logprobs
    ("POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("POST", CHAT, chat(max_completion_tokens=5000), 400, "max_completion_tokens"),
    ("POST", CHAT, chat(model="gpt-4o"), 404, "model"),
    ("POST", "/tokenize", {}, 400, None),
    ("POST", "/tokenize", {"prompt": "x", "messages": MSGS}, 400, None),
    ("POST", "/detokenize", {"tokens": [-5]}, 400, "tokens"),
    ("POST", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("GET", "/v1/no-such-route", None, 404, None),
    ("GET", CMPL, None, 405, None),
    ("POST", CMPL, b'{"prompt": "' + b"a" * (9 << 20) + b'"}', 413, None),  # over the 8 MiB default
]


@pytest.mark.parametrize(
    "method,path,body,status,param", BAD_REQUESTS, ids=[f"{i}-{r[1]}-{r[3]}-{r[4]}" for i, r in enumerate(BAD_REQUESTS)]
)
async def test_bad_request(http, method, path, body, status, param):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body)
    r = await http.request(method, path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and "Traceback" not in r.text


async def test_context_length_error_says_the_numbers(http):
    r = await http.post(CMPL, json=cmpl(max_tokens=2048))  # "Hello" is one token
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and all(n in message for n in ("is 2048 tokens", "2049 tokens", "1 in the prompt"))


@pytest.mark.slow
async def test_odd_but_valid_values_are_served(http):
    for body in [
        cmpl(temperature=1e-30),
        cmpl(temperature=50.0),
        cmpl(top_k=10**15),
        cmpl(seed=-1),
        cmpl(seed=2**63 - 1, n=3),
        cmpl(prompt=[[1, 2], [3]], echo=True, logprobs=20),
        cmpl(logit_bias={str(t): -100 for t in range(100)}),
        cmpl(stop=["a"] * 50, stop_token_ids=[0]),
        cmpl(prompt="\u0000\U0001f600 \ufffd"),
        cmpl(temperature=None, max_tokens=None, stop=None),
        cmpl(repetition_penalty=1e-9, presence_penalty=2, frequency_penalty=-2, min_tokens=2),
    ]:
        r = await http.post(CMPL, json=body)
        assert r.status_code == 200, (body, r.text)
    r = await http.post(CHAT, json=chat(messages=[{"role": "assistant", "content": "Hello"}] * 3, max_tokens=None))
    assert r.status_code == 200, r.text


async def test_still_healthy_after_bad_requests(http, metrics):
    assert (await http.get("/health")).status_code == 200
    r = await http.post(CMPL, json=cmpl(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    await metrics.wait_until_idle()
