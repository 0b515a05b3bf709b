"""The server over raw HTTP (httpx): SSE wire format, vLLM's extra endpoints, /metrics, 64
concurrent streaming clients, and clients that disconnect mid-request."""

import asyncio

import httpx
import orjson
import pytest
from openai import AsyncOpenAI

pytest_plugins = ["server_harness"]

VLLM_METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
]
LONG = {"max_tokens": 1500, "ignore_eos": True}  # minutes of work, unless the disconnect aborts it


def sse_events(raw: bytes) -> list[str]:
    """The data of each event of an SSE body, checking every event is exactly `data: ...\\n\\n`."""
    assert raw.endswith(b"\n\n") and b"\r" not in raw
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), events
    return [e[len(b"data: ") :].decode() for e in events]


async def test_sse_wire_format(http):
    body = {
        "prompt": "Hello, my name is",
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(c["object"] == "text_completion" for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    plain = await http.post("/v1/completions", json=body | {"stream": False, "stream_options": None})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == plain.json()["choices"][0]["text"]


async def test_chat_stream_without_usage_has_no_usage_key(http):
    r = await http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    )
    chunks = [orjson.loads(e) for e in sse_events(r.content)[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_tokenize_detokenize_round_trip(http):
    text = "Hello world, héllo 🌍!"
    r = (await http.post("/tokenize", json={"prompt": text, "return_token_strs": True})).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    assert (await http.post("/detokenize", json={"tokens": r["tokens"]})).json() == {"prompt": text}
    chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
    rendered = (await http.post("/detokenize", json={"tokens": chat["tokens"]})).json()["prompt"]
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


async def test_health_version_models(http):
    assert (await http.get("/health")).status_code == 200
    assert isinstance((await http.get("/version")).json()["version"], str)
    model = (await http.get("/v1/models")).json()["data"][0]
    assert model["id"] == "SmolLM2-135M-Instruct" and model["object"] == "model"


async def test_routes_also_answer_without_v1(http):
    """/chat/completions, /completions, /embeddings, /models, /messages, /responses: as under /v1 (llama.cpp
    answers both), errors in the same shape (Anthropic's on /messages)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    a, b = [(await http.post(p, json=body)).json() for p in ("/v1/chat/completions", "/chat/completions")]
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert (await http.post("/completions", json={"prompt": "Hi", "max_tokens": 2})).status_code == 200
    assert len((await http.post("/embeddings", json={"input": "Hi"})).json()["data"]) == 1
    assert (await http.get("/models")).json() == (await http.get("/v1/models")).json()
    message = await http.post("/messages", json=body | {"model": "SmolLM2-135M-Instruct"})
    assert message.json()["type"] == "message"
    bad = await http.post("/messages", json={"messages": []})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert (await http.post("/responses", json={"input": "Hi", "max_output_tokens": 16})).json()["object"] == "response"


async def test_metrics_use_vllm_names(http, metrics):
    await http.post("/v1/completions", json={"prompt": "Metrics", "max_tokens": 3, "ignore_eos": True})
    m = await metrics.wait_until_idle()
    assert all(name in m for name in VLLM_METRICS), sorted(m)
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:generation_tokens_total"] >= 3
    assert m["vllm:request_success_total{finished_reason=length}"] >= 1
    assert m["vllm:time_to_first_token_seconds_count"] >= 1 and m["vllm:e2e_request_latency_seconds_sum"] > 0
    text = (await http.get("/metrics")).text
    assert 'vllm:num_requests_running{model_name="SmolLM2-135M-Instruct"} 0.0' in text


@pytest.mark.slow
async def test_64_concurrent_streaming_clients(server, http, metrics):
    """Every stream finishes complete (greedy text equal to the same request alone, 8 tokens, usage
    right), and the engine is idle again afterwards."""
    prompts = [f"Story number {i}: once upon a time" for i in range(8)]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = {}
    for p in prompts:
        alone[p] = (await http.post("/v1/completions", json=body | {"prompt": p})).json()["choices"][0]["text"]
    idle = (await metrics.wait_until_idle())["vllm:kv_cache_usage_perc"]

    async def one_client(client: AsyncOpenAI, prompt: str):
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt=prompt,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        return prompt, text, finish, usage

    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        results = await asyncio.gather(*(one_client(client, prompts[i % 8]) for i in range(64)))
    for prompt, text, finish, usage in results:
        assert (text, finish, usage.completion_tokens) == (alone[prompt], "length", 8)
    await metrics.wait_until_idle(idle)


async def test_disconnect_mid_stream_frees_blocks(server, http, metrics):
    before = await metrics.wait_until_idle()
    async with httpx.AsyncClient(base_url=server.url) as client:
        async with client.stream(
            "POST", "/v1/completions", json={"prompt": "Tell me a story", "stream": True} | LONG
        ) as r:
            lines = r.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            during = await metrics.scrape()
    # Leaving the block closed the connection with the request running.
    assert during["vllm:num_requests_running"] == 1 and during["vllm:kv_cache_usage_perc"] > 0
    after = await metrics.wait_until_idle(before["vllm:kv_cache_usage_perc"], timeout=5)
    assert (
        after["vllm:request_success_total{finished_reason=abort}"]
        == before.get("vllm:request_success_total{finished_reason=abort}", 0) + 1
    )
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 200
    r = await http.post("/v1/completions", json={"prompt": "Still serving?", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def test_disconnect_mid_request_frees_blocks(server, http, metrics):
    before = await metrics.wait_until_idle()
    async with httpx.AsyncClient(base_url=server.url) as client:
        request = asyncio.create_task(
            client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Write a long essay."}]} | LONG
            )
        )
        while (await metrics.scrape())["vllm:num_requests_running"] == 0:
            await asyncio.sleep(0.05)
        request.cancel()  # closes the connection before the response
        with pytest.raises(asyncio.CancelledError):
            await request
    await metrics.wait_until_idle(before["vllm:kv_cache_usage_perc"], timeout=5)
    assert (await http.get("/health")).status_code == 200
