"""Structured outputs and tool calls through real HTTP with the openai SDK: response_format, vLLM's
structured_outputs and guided_* fields, tool_choice required / named / auto (hermes) / none, the
tool-result round trip, streamed tool-call deltas, and 400s for bad constraints before any engine work."""

import json
import re

import jsonschema
import pytest

from api.errors import APIError
from api.protocol import ChatCompletionRequest
from api.tool_calls import ToolCalls

pytest_plugins = ["server_harness"]

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def reassemble(stream) -> tuple[str, dict[int, dict], list]:
    """(content, calls by index as {id, name, arguments}, finish reasons) from a chat stream."""
    content, calls, reasons = "", {}, []
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return content, calls, reasons


async def test_response_format_json_schema_and_json_object(openai_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = await openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about a person."}],
        response_format=fmt,
        max_tokens=200,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    stream = await openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a cat."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    content, calls, reasons = await reassemble(stream)
    assert isinstance(json.loads(content), dict) and not calls and reasons == ["stop"]


async def test_completions_structured_outputs_and_guided_fields(openai_client):
    r = await openai_client.completions.create(
        model=MODEL,
        prompt=["The film was great. Sentiment:", "My phone number is"],
        max_tokens=30,
        temperature=1.0,
        n=2,
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert len(r.choices) == 4 and all(c.text in ("positive", "negative") for c in r.choices)
    r = await openai_client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=30,
        temperature=0,
        extra_body={"guided_regex": r"\d{3}-\d{4}"},
    )
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = await openai_client.completions.create(
        model=MODEL, prompt="A person:", max_tokens=100, temperature=0, extra_body={"guided_json": PERSON}
    )
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = await openai_client.completions.create(
        model=MODEL,
        prompt="Yes or no?",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_grammar": 'root ::= "yes" | "no"'},
    )
    assert r.choices[0].text in ("yes", "no")
    r = await openai_client.completions.create(
        model=MODEL, prompt="A person:", max_tokens=5, temperature=0, extra_body={"guided_json": PERSON}
    )
    assert r.choices[0].finish_reason == "length"


async def test_tool_choice_required_and_named(openai_client):
    r = await openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    r = await openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=200, temperature=1.0, seed=1, n=2
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        check_calls(choice.message.tool_calls, ["get_weather"])
        assert len(choice.message.tool_calls) == 1


@pytest.mark.slow
async def test_streamed_tool_calls_reassemble_to_the_same_calls(openai_client):
    for tool_choice in ("required", NAMED):
        kwargs = dict(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=200,
            temperature=0,
            parallel_tool_calls=False,
        )
        whole = (await openai_client.chat.completions.create(**kwargs)).choices[0]
        content, calls, reasons = await reassemble(await openai_client.chat.completions.create(**kwargs, stream=True))
        assert not content and reasons == [whole.finish_reason]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
        ]
        assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())


async def test_tool_result_round_trip(openai_client):
    first = await openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=200, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"},
    ]
    final = await openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.slow
async def test_auto_tool_choice_parses_hermes_calls(openai_client):
    """With --tool-call-parser hermes the <tool_call> blocks the model writes become tool_calls (the
    135M model does not write them by itself, so a regex makes it, as a larger model would)."""
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>"
    )
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=100,
        temperature=0,
        extra_body={"structured_outputs": {"regex": re.escape(text)}},
    )
    r = await openai_client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check.\n"
    check_calls(choice.message.tool_calls, ["get_weather"])
    content, calls, reasons = await reassemble(await openai_client.chat.completions.create(**kwargs, stream=True))
    assert content == "Let me check.\n" and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    plain = await openai_client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=10, temperature=0
    )
    assert plain.choices[0].message.content and plain.choices[0].finish_reason == "length"


def test_auto_needs_the_server_flags():
    req = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS})
    with pytest.raises(APIError, match="--enable-auto-tool-choice") as e:
        ToolCalls(req, None)
    assert e.value.status == 400 and e.value.param == "tool_choice"


CHAT = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
        "response_format",
        "Unsupported type",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "Extra inputs"),
    (
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
        "only one",
    ),
    ({"guided_json": {"type": "objekt"}}, "guided_json", "Unsupported type"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "only one"),
    ({"tools": [], "tool_choice": "none"}, "tools", "must not be empty"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "not in tools",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "not both",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
            "tool_choice": "required",
        },
        "tools",
        "Unsupported type",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", None),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "content is required"),
]


@pytest.mark.parametrize("fields,param,message", CHAT)
async def test_bad_constraints_get_400_naming_the_field(http, fields, param, message):
    r = await http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2} | fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert message is None or message in error["message"], error


async def test_bad_constraint_on_a_stream_gets_400_before_streaming(http):
    r = await http.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "(ab"}, "stream": True}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


PYTHONIC_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nAnswer or call tools as [name(arg=value)]: "
    "{% for t in tools %}{{ t['function']['name'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.slow
async def test_auto_tool_choice_with_the_pythonic_parser(server_factory, tmp_path):
    """--tool-call-parser pythonic starts, answers tool_choice "auto" and reads a `[f(k=v)]` reply (forced by
    a regex, as the 135M model does not write one by itself) into tool_calls, whole and streamed."""
    from openai import AsyncOpenAI

    from tests.server_harness import cli_args

    template = tmp_path / "pythonic.jinja"
    template.write_text(PYTHONIC_TEMPLATE)
    server = server_factory(
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "pythonic",
        "--no-dashboard",
        "--chat-template",
        str(template),
        *cli_args(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512),
    )
    text = '[get_weather(city="Paris", unit="celsius")]'
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        plain = await client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=5, temperature=0
        )
        assert plain.choices[0].finish_reason == "length" and not plain.choices[0].message.tool_calls
        kwargs = dict(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            max_tokens=40,
            temperature=0,
            extra_body={"structured_outputs": {"regex": re.escape(text)}},
        )
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls, ["get_weather"])
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
        content, calls, reasons = await reassemble(await client.chat.completions.create(**kwargs, stream=True))
    assert content == "" and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


@pytest.mark.slow
async def test_tools_without_flags_use_the_templates_format(server_factory):
    """No tool flags: Qwen 2.5's own chat template (llama.cpp's copy) asks for <tool_call> JSON, so the server
    picks hermes by itself (and says so in its log), and tool_choice "auto" gets parsed calls."""
    from openai import AsyncOpenAI

    from scripts import llama_cpp
    from tests.server_harness import cli_args

    template = llama_cpp.SOURCE / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    if not template.exists():
        pytest.skip("llama.cpp's tree is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    server = server_factory(
        "--no-dashboard",
        "--chat-template",
        str(template),
        *cli_args(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024),
    )
    assert "the chat template writes hermes tool calls" in server.log()
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        r = await client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            max_tokens=60,
            temperature=0,
            extra_body={"structured_outputs": {"regex": re.escape(text)}},
        )
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, ["get_weather"])
