"""POST /v1/responses (OpenAI's Responses API, stateless) through the openai SDK: text equal to chat completions'
for the same conversation, message / function-call items, the typed event stream (order, sequence numbers, named
SSE events), text.format JSON schemas, a function-call round trip, max_output_tokens cuts, and 4xx in OpenAI's
shape for what is not supported, with the server serving on and no KV blocks held afterwards."""

import itertools
import json

import jsonschema
import openai
import orjson
import pytest

pytest_plugins = ["server_harness"]

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": WEATHER,
    "strict": True,
}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
NAMED = {"type": "function", "name": "get_weather"}
ASK_WEATHER = "What's the weather in Paris?"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


def runs(types: list[str]) -> list[str]:
    """Event types with each run of a type kept once (the deltas)."""
    return [t for t, _ in itertools.groupby(types)]


async def chat_text(client, messages, max_tokens: int, **kwargs) -> str:
    r = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )
    return r.choices[0].message.content


async def test_create_equals_chat_with_usage(openai_client):
    r = await openai_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0)
    chat = await openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=40, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [(p.type, p.annotations) for p in message.content] == [("output_text", [])]
    assert r.output_text and r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert 0 <= u.input_tokens_details.cached_tokens <= u.input_tokens
    assert (r.temperature, r.max_output_tokens, r.tools, r.tool_choice, r.parallel_tool_calls) == (
        0,
        40,
        [],
        "auto",
        True,
    )


@pytest.mark.slow
async def test_message_items_and_instructions_render_as_chat(openai_client):
    """instructions come first as a system message; input_text parts are joined as chat joins text parts; a
    developer message is a system message; an assistant output_text message is an assistant turn."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name three fruits."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Apple, banana and cherry."}]},
        {"role": "developer", "content": "Answer in one line."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Now three"}, {"type": "input_text", "text": "vegetables."}],
        },
    ]
    r = await openai_client.responses.create(
        model=MODEL, instructions="You are a helpful grocer.", input=items, max_output_tokens=24, temperature=0
    )
    messages = [
        {"role": "system", "content": "You are a helpful grocer."},
        {"role": "user", "content": "Name three fruits."},
        {"role": "assistant", "content": "Apple, banana and cherry."},
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Now three\nvegetables."},
    ]
    assert r.instructions == "You are a helpful grocer."
    assert r.output_text and r.output_text == await chat_text(openai_client, messages, 24)


async def test_stream_events_in_order_and_final_response(openai_client):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0)
    whole = await openai_client.responses.create(**kwargs)
    async with openai_client.responses.stream(**kwargs) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    assert runs([e.type for e in events]) == TEXT_EVENTS + ["response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == final.output_text == whole.output_text
    [done] = [e for e in events if e.type == "response.output_text.done"]
    item_id = final.output[0].id
    assert done.text == text and {e.item_id for e in [*deltas, done]} == {item_id}
    assert events[2].item.id == item_id and events[2].item.status == "in_progress"
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_stream_is_named_sse_events_without_done(http):
    """Each event is `event: <type>` then `data: <json of that type>`, as OpenAI and vLLM send them."""
    async with http.stream(
        "POST", "/v1/responses", json={"model": MODEL, "input": QUESTION, "max_output_tokens": 5, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = (await r.aread()).decode()
    blocks = [b.split("\n") for b in body.strip().split("\n\n")]
    assert all(len(b) == 2 and b[0].startswith("event: ") and b[1].startswith("data: ") for b in blocks), body
    names = [b[0].removeprefix("event: ") for b in blocks]
    assert names == [orjson.loads(b[1].removeprefix("data: "))["type"] for b in blocks]
    assert names[0] == "response.created" and names[-1] == "response.incomplete"


@pytest.mark.slow
async def test_text_format_json_schema(openai_client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = await openai_client.responses.create(
        model=MODEL, input="Tell me about a person.", text={"format": fmt}, max_output_tokens=200, temperature=0
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


@pytest.mark.slow
async def test_function_call_round_trip(openai_client):
    """A named function must be called: a function_call item with arguments valid for its parameters; its
    output sent back as function_call_output gets a message, the same text chat gives for the same turns."""
    first = await openai_client.responses.create(
        model=MODEL, input=ASK_WEATHER, tools=[TOOL], tool_choice=NAMED, max_output_tokens=200, temperature=0
    )
    assert first.status == "completed" and first.output_text == ""
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = "18 degrees celsius, sunny"
    # The output items go back as input as they came (the SDK sends their extra fields, which are ignored).
    second = await openai_client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": ASK_WEATHER},
            *first.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": result},
        ],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=40,
        temperature=0,
    )
    [message] = second.output
    assert message.type == "message" and second.output_text
    messages = [
        {"role": "user", "content": ASK_WEATHER},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    assert second.output_text == await chat_text(openai_client, messages, 40, tools=[CHAT_TOOL], tool_choice="none")


@pytest.mark.slow
async def test_streamed_function_call_events(openai_client):
    kwargs = dict(model=MODEL, input=ASK_WEATHER, tools=[TOOL], max_output_tokens=200, temperature=0)
    whole = await openai_client.responses.create(**kwargs, tool_choice="required")
    [call] = whole.output
    async with openai_client.responses.stream(**kwargs, tool_choice="required") as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    assert runs([e.type for e in events]) == CALL_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == final.output[0].arguments
    assert json.loads(arguments) == json.loads(call.arguments) and final.output[0].name == call.name
    # a named function streams its arguments as they are generated
    stream = await openai_client.responses.create(**kwargs, tool_choice=NAMED, stream=True)
    events = [e async for e in stream]
    assert runs([e.type for e in events]) == CALL_EVENTS
    assert len([e for e in events if e.type == "response.function_call_arguments.delta"]) > 1
    jsonschema.validate(json.loads(events[-1].response.output[0].arguments), WEATHER)


async def test_max_output_tokens_cut_is_incomplete(openai_client):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)
    r = await openai_client.responses.create(**kwargs)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.output_text
    events = [e async for e in await openai_client.responses.create(**kwargs, stream=True)]
    assert runs([e.type for e in events]) == TEXT_EVENTS + ["response.incomplete"]
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.output_text == r.output_text and events[-2].item.status == "incomplete"


async def test_sdk_errors_and_the_server_serves_on(openai_client, metrics):
    with pytest.raises(openai.BadRequestError, match="web_search_preview") as e:
        await openai_client.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search_preview"}])
    assert e.value.body["param"] == "tools" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="stores no responses") as e:
        await openai_client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError) as e:
        await openai_client.responses.create(model="gpt-4o", input=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        await openai_client.responses.create(model=MODEL, input=[{"type": "reasoning", "id": "rs_1", "summary": "x"}])
    assert e.value.body["param"] == "input" and "summary" in e.value.body["message"]
    await metrics.wait_until_idle()
    r = await openai_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert r.usage.output_tokens == 2


BAD = [
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", "'file_search'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
        "input",
        "input_text",
    ),
    ({"input": []}, "input", None),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"background": True}, "background", "not supported"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning", "no reasoning summaries"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning", None),
    ({"truncation": "auto"}, "truncation", '"auto"'),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}},
        "text",
        "Unsupported type",
    ),
    ({"text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text", "name"),
    ({"tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text", "not both"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"max_output_tokens": 4096}, "max_output_tokens", "maximum context length"),
    ({"input": "word " * 3000}, "input", "maximum context length"),
    ({"temperature": "0"}, "temperature", None),
]


@pytest.mark.parametrize("fields,param,message", BAD)
async def test_bad_requests_get_400_naming_the_field(http, fields, param, message):
    r = await http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "max_output_tokens": 2} | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert message is None or message in error["message"], error


async def test_inert_values_of_unsupported_fields_are_accepted(http):
    """What the SDK or agent frameworks send by default (store, empty tools, null reasoning...) is served."""
    r = await http.post(
        "/v1/responses",
        json={
            "model": MODEL,
            "input": QUESTION,
            "max_output_tokens": 2,
            "store": True,
            "tools": [],
            "tool_choice": "auto",
            "include": [],
            "background": False,
            "reasoning": {"effort": None},
            "truncation": "disabled",
            "metadata": {"k": "v"},
            "user": "u1",
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["metadata"] == {"k": "v"} and body["user"] == "u1" and body["usage"]["output_tokens"] == 2


async def test_client_leaving_a_stream_frees_its_blocks(http, metrics):
    async with http.stream(
        "POST",
        "/v1/responses",
        json={"model": MODEL, "input": QUESTION, "stream": True, "max_output_tokens": 500, "temperature": 0},
    ) as r:
        async for line in r.aiter_lines():
            if line == "event: response.output_text.delta":
                break
    await metrics.wait_until_idle()
