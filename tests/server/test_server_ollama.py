"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags, /api/show, /api/ps,
/api/version) through the `ollama` Python client and LangChain's ChatOllama: answers equal to the OpenAI
routes' for the same conversation, streamed and not, real tool calls of the model parsed into Ollama's shape
and a tool result sent back, generate's `context` carried into the next call, embeddings equal to
/v1/embeddings', and errors in Ollama's `{"error": ...}` shape with the server serving on and idle after."""

import httpx
import numpy as np
import ollama
import pytest
from langchain_ollama import ChatOllama

pytest_plugins = ["server_harness"]

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "num_predict": 16}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
# One worked example is enough for the default model to answer in hermes' <tool_call> format (the shared
# server runs --tool-call-parser hermes).
FEW_SHOT = [
    {
        "role": "system",
        "content": 'To call a tool, answer with <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
        "and nothing else.",
    },
    {"role": "user", "content": "What's the weather in Rome?"},
    {"role": "assistant", "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'},
    {"role": "user", "content": "What's the weather in Paris?"},
]


@pytest.fixture
async def client(server):
    return ollama.AsyncClient(host=server.url)


async def test_chat_is_the_chat_completion_streamed_or_not(client, openai_client, metrics):
    whole = await client.chat(model=MODEL, messages=ASK, stream=False, options=GREEDY)
    ref = await openai_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=16)
    assert whole.message.role == "assistant"
    assert whole.message.content == ref.choices[0].message.content and whole.message.content
    assert whole.done and whole.done_reason == ref.choices[0].finish_reason
    assert whole.prompt_eval_count == ref.usage.prompt_tokens
    assert whole.eval_count == ref.usage.completion_tokens
    assert whole.total_duration >= whole.eval_duration > 0 and whole.prompt_eval_duration > 0
    parts = [p async for p in await client.chat(model=f"{MODEL}:latest", messages=ASK, stream=True, options=GREEDY)]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert not any(p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == whole.eval_count
    await metrics.wait_until_idle()


async def test_chat_tool_calls_streamed_or_not_and_a_tool_result(client):
    options = {"temperature": 0, "num_predict": 40}
    whole = await client.chat(model=MODEL, messages=FEW_SHOT, tools=TOOLS, stream=False, options=options)
    assert whole.message.content == ""
    assert [(c.function.name, dict(c.function.arguments)) for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    parts = [
        p async for p in await client.chat(model=MODEL, messages=FEW_SHOT, tools=TOOLS, stream=True, options=options)
    ]
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    history = FEW_SHOT + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    answer = await client.chat(model=MODEL, messages=history, tools=TOOLS, stream=False, options=options)
    assert answer.message.content and not answer.message.tool_calls


async def test_generate_with_context_and_raw(client, openai_client):
    first = await client.generate(model=MODEL, prompt="What is the capital of France?", options=GREEDY)
    ref = await openai_client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=16)
    assert first.response == ref.choices[0].message.content and first.done
    assert len(first.context) == first.prompt_eval_count + first.eval_count
    more = await client.generate(model=MODEL, prompt="And of Italy?", context=first.context, options=GREEDY)
    alone = await client.generate(model=MODEL, prompt="And of Italy?", options=GREEDY)
    assert more.prompt_eval_count == len(first.context) + alone.prompt_eval_count
    assert more.context[: len(first.context)] == first.context
    raw = await client.generate(model=MODEL, prompt="The capital of France is", raw=True, options=GREEDY)
    completion = await openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=16
    )
    assert raw.response == completion.choices[0].text
    streamed = [
        p
        async for p in await client.generate(
            model=MODEL, prompt="What is the capital of France?", stream=True, options=GREEDY
        )
    ]
    assert "".join(p.response for p in streamed) == first.response and streamed[-1].context == first.context
    loaded = await client.generate(model=MODEL)  # no prompt: Ollama's way to load a model
    assert loaded.done and loaded.done_reason == "load"


async def test_embed_equals_openai_embeddings(client, openai_client):
    texts = ["The cat sat on the mat.", "Stock markets fell today."]
    ours = await client.embed(model=MODEL, input=texts)
    ref = await openai_client.embeddings.create(model=MODEL, input=texts)
    assert len(ours.embeddings) == 2 and ours.prompt_eval_count > 0
    for a, b in zip(ours.embeddings, ref.data):
        np.testing.assert_allclose(a, b.embedding, rtol=1e-5, atol=1e-6)
    old = await client.embeddings(model=MODEL, prompt=texts[0])
    np.testing.assert_allclose(old.embedding, ours.embeddings[0], rtol=1e-5, atol=1e-6)


async def test_list_show_ps_version(client, server):
    (listed,) = (await client.list()).models
    assert listed.model == MODEL and listed.size > 0 and len(listed.digest) == 64
    assert (listed.details.format, listed.details.family, listed.details.quantization_level) == (
        "gguf",
        "llama",
        "Q4_1",
    )
    assert listed.details.parameter_size == "134.5M"
    shown = await client.show(MODEL)
    assert "tools" in shown.capabilities and "completion" in shown.capabilities and "thinking" not in shown.capabilities
    assert "<|im_start|>" in shown.template and shown.modelinfo["llama.context_length"] == 2048
    (loaded,) = (await client.ps()).models
    assert loaded.model == MODEL and loaded.size > listed.size and loaded.context_length == 2048
    async with httpx.AsyncClient(base_url=server.url) as http:
        version = (await http.get("/api/version")).json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 6, 4)  # what VS Code's local models ask for


async def test_chat_ollama_invoke_and_stream(server):
    llm = ChatOllama(model=MODEL, base_url=server.url, temperature=0, num_predict=16)
    message = await llm.ainvoke("What is the capital of France?")
    assert message.content and message.usage_metadata["output_tokens"] > 0
    assert "".join([c.content async for c in llm.astream("What is the capital of France?")]) == message.content


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/api/chat", {"model": "nope", "messages": ASK}, 404, "not found"),
        (
            "/api/chat",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
            400,
            "images",
        ),
        ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"mirostat": 2}}, 400, "mirostat"),
        (
            "/api/chat",
            {"model": MODEL, "messages": ASK, "options": {"repeat_penalty": 1.2, "repeat_last_n": 64}},
            400,
            "repeat_last_n",
        ),
        ("/api/chat", {"model": MODEL, "messages": ASK, "think": True}, 400, "thinking"),
        ("/api/chat", {"model": MODEL, "messages": ASK, "think": "high"}, 400, "thinking levels"),
        ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"num_ctx": 8}}, 400, "num_ctx"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/api/generate", {"model": MODEL, "prompt": "x", "context": [10**9]}, 400, "vocabulary"),
        ("/api/embed", {"model": MODEL, "input": "x", "dimensions": 3}, 400, "dimensions"),
        ("/api/nothing", {}, 404, "Invalid URL"),
    ],
)
async def test_errors_in_ollama_shape(http, metrics, path, body, status, words):
    resp = await http.post(path, json=body)
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"} and words in resp.json()["error"], resp.json()
    assert (
        await http.post("/api/chat", json={"model": MODEL, "messages": ASK, "stream": False, "options": GREEDY})
    ).status_code == 200
    await metrics.wait_until_idle()


async def test_num_ctx_caps_the_answer(client):
    whole = await client.chat(model=MODEL, messages=ASK, stream=False, options={"temperature": 0, "num_ctx": 40})
    assert whole.prompt_eval_count + whole.eval_count == 40 and whole.done_reason == "length"
