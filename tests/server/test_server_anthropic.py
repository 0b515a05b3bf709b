"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) through the anthropic SDK: text and
usage equal to chat completions' for the same conversation, system prompts, stop sequences, the event stream (raw
order and the SDK's accumulator), a tool_use -> tool_result round trip, token counting with tools, and 4xx in
Anthropic's error shape (x-api-key, body limit, content type included) with the server serving on and no KV
blocks held afterwards."""

import itertools

import anthropic
import httpx
import jsonschema
import pytest

from tests.server_harness import cli_args

pytest_plugins = ["server_harness"]

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"extra_body": {"temperature": 0}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    }
]
KEY = "s3cret-key"
# A template that renders what the default model's does not: the tools, and assistant tool calls.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
async def client(server):
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def aux(server_factory, tmp_path_factory):
    """A server with --api-key, a 4 KiB body limit and a chat template that renders tools and tool calls."""
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    return server_factory(
        "--api-key",
        KEY,
        "--max-request-body-bytes",
        "4096",
        "--no-dashboard",
        "--chat-template",
        str(template),
        *cli_args(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512),
    )


def runs(types: list[str]) -> list[str]:
    """Event types with each run of a type kept once (the deltas)."""
    return [t for t, _ in itertools.groupby(types)]


def prompt_tokens(message) -> int:
    """The whole prompt of a message: the tokens computed and those read from the prefix cache."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


async def test_message_is_the_chat_completion(client, openai_client):
    """Greedy, a message is the chat completion of the same conversation: same text, token counts and end."""
    for max_tokens, stop_reason in ((5, "max_tokens"), (60, "end_turn")):  # the answer is 8 tokens
        r = await client.messages.create(model=MODEL, max_tokens=max_tokens, messages=ASK, **GREEDY)
        chat = await openai_client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=max_tokens, temperature=0
        )
        assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == MODEL
        assert [b.type for b in r.content] == ["text"] and r.content[0].text == chat.choices[0].message.content
        assert r.content[0].text
        assert (
            r.stop_reason == stop_reason
            and chat.choices[0].finish_reason == {"max_tokens": "length", "end_turn": "stop"}[stop_reason]
        )
        assert r.stop_sequence is None
        # Anthropic counts the prompt's cached tokens apart (llama.cpp does too): input + cache read = the prompt
        prompt = r.usage.input_tokens + r.usage.cache_read_input_tokens
        assert (prompt, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
        if max_tokens == 60:  # the same prompt ran in the first round: its full blocks come from the prefix cache
            assert r.usage.cache_read_input_tokens > 0
        assert r.usage.cache_creation_input_tokens == 0
        assert (r.usage.output_tokens == max_tokens) == (stop_reason == "max_tokens")
        count = await client.messages.count_tokens(model=MODEL, messages=ASK)
        assert count.input_tokens == prompt


@pytest.mark.slow
async def test_system_and_stop_sequences(client):
    system = "You are a travel guide. Answer in two sentences."
    ask = [{"role": "user", "content": "Describe Paris."}]
    whole = text_of(await client.messages.create(model=MODEL, max_tokens=40, system=system, messages=ask, **GREEDY))
    word = whole.split()[3]  # a word the greedy answer writes, so a stop sequence that must match
    r = await client.messages.create(
        model=MODEL, max_tokens=40, system=system, messages=ask, stop_sequences=["never-written-%%", word], **GREEDY
    )
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert text_of(r) == whole[: whole.index(word)] and word not in text_of(r)
    # the system prompt is rendered (in place of the template's default one), given as text blocks too
    counts = [
        (await client.messages.count_tokens(model=MODEL, system=s, messages=ask)).input_tokens
        for s in (system, [{"type": "text", "text": system}], system + " Be polite and precise.")
    ]
    assert counts[0] == counts[1] < counts[2]


@pytest.mark.slow
async def test_stream_events_and_accumulated_message(client, metrics):
    whole = await client.messages.create(model=MODEL, max_tokens=30, messages=ASK, **GREEDY)
    events = [
        e async for e in await client.messages.create(model=MODEL, max_tokens=30, messages=ASK, stream=True, **GREEDY)
    ]
    assert runs([e.type for e in events]) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0].message
    assert start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens + start.usage.cache_read_input_tokens == prompt_tokens(whole)
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert all(e.delta.type == "text_delta" and e.index == 0 for e in events if e.type == "content_block_delta")
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    async with client.messages.stream(model=MODEL, max_tokens=30, messages=ASK, **GREEDY) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == text_of(final) == text_of(whole) and text
    assert (final.stop_reason, prompt_tokens(final), final.usage.output_tokens) == (
        whole.stop_reason,
        prompt_tokens(whole),
        whole.usage.output_tokens,
    )
    # a client that leaves mid-stream aborts its request: nothing keeps running or holds KV blocks
    aborted = "vllm:request_success_total{finished_reason=abort}"
    before = (await metrics.scrape()).get(aborted, 0)
    stream = await client.messages.create(
        model=MODEL,
        max_tokens=500,
        stream=True,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
    )
    assert [(await anext(aiter(stream))).type for _ in range(3)] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
    ]
    await stream.close()
    assert (await metrics.wait_until_idle())[aborted] == before + 1


@pytest.mark.slow
async def test_tool_use_round_trip(client):
    """A forced call ("tool" and "any") is a tool_use block whose input fits the schema, streamed as
    input_json_delta; its tool_result sent back gets a text answer."""
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        r = await client.messages.create(
            model=MODEL, max_tokens=100, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, **GREEDY
        )
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"], r
        use = r.content[0]
        assert use.name == "get_weather" and use.id
        jsonschema.validate(use.input, WEATHER)
        async with client.messages.stream(
            model=MODEL, max_tokens=100, messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, **GREEDY
        ) as stream:
            types = [e.type async for e in stream if e.type != "input_json"]  # the SDK adds input_json events
            final = await stream.get_final_message()
        assert runs(types) == [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in final.content] == [(use.name, use.input)]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 degrees celsius, sunny"}
    conversation = ASK_WEATHER + [{"role": "assistant", "content": r.content}, {"role": "user", "content": [result]}]
    answer = await client.messages.create(
        model=MODEL, max_tokens=40, messages=conversation, tools=TOOLS, tool_choice={"type": "none"}, **GREEDY
    )
    assert [b.type for b in answer.content] == ["text"] and text_of(answer)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    # the call and its result are in the prompt: a longer result is more tokens
    longer = conversation[:-1] + [
        {
            "role": "user",
            "content": [
                result | {"content": [{"type": "text", "text": "18 degrees celsius, sunny, light wind from the west"}]}
            ],
        }
    ]
    counts = [
        (await client.messages.count_tokens(model=MODEL, messages=m)).input_tokens for m in (conversation, longer)
    ]
    assert counts[1] > counts[0] > (await client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER)).input_tokens


@pytest.mark.slow
async def test_count_tokens_renders_tools_and_calls(aux):
    async with (
        anthropic.AsyncAnthropic(base_url=aux.url, api_key=KEY, max_retries=0) as client,
        httpx.AsyncClient(base_url=aux.url, headers={"Authorization": f"Bearer {KEY}"}) as http,
    ):
        plain = await client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER)
        with_tools = await client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER, tools=TOOLS)
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": ASK_WEATHER, "tools": CHAT_TOOLS, "tool_choice": "none", "max_tokens": 1},
        )
        assert with_tools.input_tokens == chat.json()["usage"]["prompt_tokens"] > plain.input_tokens
        # tool_choice "none" leaves the tools out of the prompt
        none = await client.messages.count_tokens(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice={"type": "none"}
        )
        assert none.input_tokens == plain.input_tokens
        # an assistant's tool_use block is rendered as a tool call, its input included
        counts = []
        for city in ("Paris", "Paris, France, Europe"):
            use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": city}}
            result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
            conversation = ASK_WEATHER + [
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [result]},
            ]
            counts.append((await client.messages.count_tokens(model=MODEL, messages=conversation)).input_tokens)
        assert counts[1] > counts[0] > plain.input_tokens
        # without --enable-auto-tool-choice, tool_choice "auto" (the default) renders the tools and answers text
        r = await client.messages.create(model=MODEL, max_tokens=3, messages=ASK_WEATHER, tools=TOOLS, **GREEDY)
        assert [b.type for b in r.content] == ["text"] and prompt_tokens(r) == with_tools.input_tokens


def anthropic_error(exc: anthropic.APIStatusError, status: int, kind: str) -> str:
    """The message of an error body in Anthropic's shape with this status and type."""
    assert exc.status_code == status and exc.body["type"] == "error" and exc.body["error"]["type"] == kind, exc.body
    assert set(exc.body["error"]) == {"type", "message"}
    return exc.body["error"]["message"]


async def test_bad_requests_get_anthropic_errors_and_the_server_serves_on(client, metrics):
    with pytest.raises(anthropic.BadRequestError) as e:  # the SDK's create() insists on max_tokens itself
        await client.post("/v1/messages", body={"model": MODEL, "messages": ASK}, cast_to=anthropic.types.Message)
    assert "max_tokens" in anthropic_error(e.value, 400, "invalid_request_error")
    bad = [
        (dict(messages=[{"role": "system", "content": "Hi"}]), "role"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]),
            "tool_use",
        ),
        (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "not in tools"),
        (dict(tool_choice={"type": "any"}), "needs tools"),
        (dict(tools=[{"name": "f", "input_schema": {"type": "string"}}]), "input_schema"),
        (dict(max_tokens=5000), "maximum context length"),
        (dict(extra_body={"temperature": -1}), "temperature"),
        (dict(extra_body={"thinking": {"type": "enabled"}}), "budget_tokens"),
        (dict(messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]), "thinking blocks"),
    ]
    for fields, says in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            await client.messages.create(**{"model": MODEL, "max_tokens": 4, "messages": ASK} | fields)
        assert says in anthropic_error(e.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as e:  # refused before the stream starts
        async with client.messages.stream(model=MODEL, max_tokens=4, messages=[{"role": "bot", "content": "x"}]):
            pass
    anthropic_error(e.value, 400, "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.count_tokens(model=MODEL, messages=[])
    anthropic_error(e.value, 400, "invalid_request_error")
    for call in (
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK),
        client.messages.count_tokens(model="claude-nope", messages=ASK),
    ):
        with pytest.raises(anthropic.NotFoundError) as e:
            await call
        assert "claude-nope" in anthropic_error(e.value, 404, "not_found_error")
    r = await client.messages.create(model=MODEL, max_tokens=4, messages=ASK, **GREEDY)
    assert r.usage.output_tokens >= 1 and text_of(r)
    # thinking enabled without a reasoning parser: accepted, and a model that does not reason answers in text
    r = await client.messages.create(
        model=MODEL, max_tokens=4, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}, **GREEDY
    )
    assert [b.type for b in r.content] == ["text"] and text_of(r)
    await metrics.wait_until_idle()  # nothing running or waiting, every KV block free


async def test_other_routes_keep_openai_errors(http):
    r = await http.post("/v1/chat/completions", json={"messages": [{"role": "bot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "type" not in r.json()
    r = await http.get("/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error" and r.json()["type"] == "error"


@pytest.mark.slow
async def test_api_key_body_limit_and_content_type(aux):
    async with anthropic.AsyncAnthropic(base_url=aux.url, api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as e:
            await wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
        assert "x-api-key" in anthropic_error(e.value, 401, "authentication_error")
    # x-api-key (the SDK's api_key) and Authorization: Bearer (its auth_token) both work
    for auth in ({"api_key": KEY}, {"auth_token": KEY}):
        async with anthropic.AsyncAnthropic(base_url=aux.url, max_retries=0, **auth) as sdk:
            assert (await sdk.messages.count_tokens(model=MODEL, messages=ASK)).input_tokens > 0
    async with anthropic.AsyncAnthropic(base_url=aux.url, api_key=KEY, max_retries=0) as sdk:
        with pytest.raises(anthropic.APIStatusError) as e:
            await sdk.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "a" * 5000}])
        anthropic_error(e.value, 413, "request_too_large")
        r = await sdk.messages.create(model=MODEL, max_tokens=2, messages=ASK, **GREEDY)
        assert r.usage.output_tokens == 2
    async with httpx.AsyncClient(base_url=aux.url, headers={"x-api-key": KEY}) as http:
        r = await http.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
        assert (await http.get("/v1/models")).status_code == 200  # x-api-key on OpenAI's routes too
        r = await http.get("/v1/models", headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there
