"""What real clients rely on: prompt scoring as lm-evaluation-harness requests it (echo + logprobs,
max_tokens 0) and vLLM's prompt_logprobs field, strict Content-Type handling, /openapi.json and /docs,
and the graceful drain on SIGTERM."""

import asyncio
import signal

import httpx
import orjson
import pytest

from api.protocol import CompletionRequest

pytest_plugins = ["server_harness"]

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


async def _ids(http, text: str) -> list[int]:
    return (await http.post("/tokenize", json={"prompt": text})).json()["tokens"]


@pytest.mark.slow
async def test_echo_scores_prompts_as_lm_eval_asks(openai_client, http):
    """lm-eval's loglikelihood request (token-id prompts, max_tokens 1, echo, logprobs 1): the score of
    a continuation equals the logprob the sampler gives the same token."""
    r = await openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    generated, logprob = r.choices[0].text, r.choices[0].logprobs.token_logprobs[0]
    context = await _ids(http, PROMPT)
    ids = (
        context
        + (await http.post("/tokenize", json={"prompt": generated, "add_special_tokens": False})).json()["tokens"]
    )
    body = {
        "model": MODEL,
        "prompt": [ids, context],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    choices = sorted((await http.post("/v1/completions", json=body)).json()["choices"], key=lambda c: c["index"])
    lp = choices[0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][len(context)] == pytest.approx(logprob, abs=1e-4)
    # lm-eval's is_greedy: the continuation is the most likely token
    assert max(lp["top_logprobs"][len(context)].values()) == lp["token_logprobs"][len(context)]
    assert choices[1]["logprobs"]["token_logprobs"][: len(context)] == pytest.approx(
        lp["token_logprobs"][: len(context)], abs=1e-5
    )
    # max_tokens 0: the same prompt entries, nothing generated
    zero = (await http.post("/v1/completions", json=body | {"prompt": ids, "max_tokens": 0})).json()
    [choice] = zero["choices"]
    assert choice["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0
    assert choice["text"] == PROMPT + generated and choice["logprobs"]["tokens"] == lp["tokens"][:-1]
    # another request, whose prompt runs alone in its step where the first ran beside the context (other row counts
    # and attention tasks, so other summation orders): an entry moved by 1.1e-5 on the pool's AMX Xeon
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"][:-1], abs=1e-4)
    assert (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})).status_code == 400


async def test_vllm_prompt_logprobs_field(http):
    scored = (
        await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0})
    ).json()["choices"][0]["logprobs"]
    ids = await _ids(http, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    [choice] = (await http.post("/v1/completions", json=body)).json()["choices"]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids) and choice["logprobs"] is None
    for token, entry, logprob in zip(ids[1:], entries[1:], scored["token_logprobs"][1:]):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(logprob, abs=1e-5) and mine["rank"] >= 1
        top = sorted(entry.values(), key=lambda e: e["rank"])[:2]
        assert [e["rank"] for e in top] == [1, 2] and top[0]["logprob"] >= max(top[1]["logprob"], mine["logprob"])
        assert 2 <= len(entry) <= 3
    assert entries[1][str(ids[1])]["decoded_token"] == " capital"
    # streamed: in the choice's first chunk; chat: a top-level field, as vLLM sends them
    r = await http.post("/v1/completions", json=body | {"stream": True})
    chunks = [orjson.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_logprobs"] == entries
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])
    chat = (
        await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
        )
    ).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    bad = await http.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize(
    "content_type, status",
    [
        (None, 200),
        ("application/json", 200),
        ("Application/JSON; charset=utf-8", 200),
        ("application/vnd.api+json", 200),
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("text/json", 415),
    ],
)
async def test_content_types_as_fastapi_decides(http, content_type, status):
    headers = {"content-type": content_type} if content_type else {}
    r = await http.post("/tokenize", content=b'{"prompt": "Hi"}', headers=headers)
    if content_type is None:
        assert "content-type" not in r.request.headers
    assert r.status_code == status
    if status == 415:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and "Content-Type: application/json" in error["message"]


async def test_openapi_document_and_docs_page(http):
    doc = (await http.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.1")
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    } <= doc["paths"].keys()
    assert all(
        "requestBody" in doc["paths"][path]["post"]
        for path in ("/v1/embeddings", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens")
    )
    ref = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    expected = CompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    assert schema["properties"] == expected["properties"] and schema["required"] == ["prompt"]
    assert doc["paths"]["/v1/completions"]["post"]["responses"]["415"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    page = await http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # nothing from a CDN
    for asset in ["/docs/static/swagger-ui-bundle.js", "/docs/static/swagger-ui.css"]:
        assert asset in page.text
        r = await http.get(asset)
        assert r.status_code == 200 and len(r.content) > 100_000
    assert (await http.get("/docs/static/../../api/app.py")).status_code == 404


@pytest.mark.slow
async def test_sigterm_drains_streams_in_flight(server_factory):
    """SIGTERM during 8 streams: all 8 finish normally, a new request gets 503 with Retry-After, the
    server exits 0."""
    proc = server_factory(
        "--dtype", "float32", "--kv-cache-memory", "128M", "--max-model-len", "512", "--shutdown-timeout", "120"
    )
    started = asyncio.Event()
    first_chunks = 0

    async def stream(client: httpx.AsyncClient, i: int) -> list[dict]:
        nonlocal first_chunks
        body = {"prompt": f"Story number {i}:", "max_tokens": 24, "ignore_eos": True, "stream": True}
        chunks = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(orjson.loads(line[6:]))
                    if len(chunks) == 1:
                        first_chunks += 1
                        if first_chunks == 8:
                            started.set()
                elif line == "data: [DONE]":
                    chunks.append("[DONE]")
        return chunks

    async with httpx.AsyncClient(base_url=proc.url, timeout=300) as client:
        streams = [asyncio.create_task(stream(client, i)) for i in range(8)]
        await asyncio.wait_for(started.wait(), 300)
        proc.proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(base_url=proc.url, timeout=60) as late:
            for _ in range(200):  # until the server's loop has handled the signal
                r = await late.post("/v1/completions", json={"prompt": "late", "max_tokens": 1})
                if r.status_code == 503:
                    break
                await asyncio.sleep(0.05)
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.json()["error"]["code"] == "shutting_down"
        results = await asyncio.gather(*streams)
    for chunks in results:
        assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) and len(chunks) >= 3
    assert proc.proc.wait(60) == 0
    assert "aborting" not in proc.log()
