"""The tool-call parsers of tool_choice "auto" (`--tool-call-parser`) on real token streams: a model's output
in each format, as the default model's tokenizer cuts it, fed token by token through `ToolCallStream`,
reassembles to the whole-text parse and the expected calls; malformed outputs are content, with no calls."""

import json

import pytest

from api.protocol import ChatCompletionRequest
from api.tool_calls import ToolCalls
from api.tool_parsers import TOOL_CALL_PARSERS
from models.loader import load_tokenizer, resolve_model

TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
TOKYO = ("get_time", {"timezone": "Asia/Tokyo", "utc_offset": 9, "dst": False, "aliases": ["JST", None]})
CASES = [  # (parser, output, content, calls)
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>',
        "Let me check.\n",
        [PARIS],
    ),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [PARIS]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo", "utc_offset": 9, "dst": false, '
        '"aliases": ["JST", null]}}',
        None,
        [PARIS, TOKYO],
    ),
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', None, [PARIS]),
    (
        "pythonic",
        '[get_weather(city=\'Paris\', unit="celsius"),\n get_time(timezone="Asia/Tokyo", '
        "utc_offset=9, dst=False, aliases=('JST', None))]",
        None,
        [PARIS, TOKYO],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        None,
        [PARIS],
    ),
    (
        "mistral",
        'Checking both. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {"timezone": "Asia/Tokyo", "utc_offset": 9, '
        '"dst": false, "aliases": ["JST", null]}}]',
        "Checking both. ",
        [PARIS, TOKYO],
    ),
]
CUT = [  # (parser, output, arguments streamed) cut by max_tokens: content whole, but streamed the call had started
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"', '{"city": "Paris"'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', '{"city": "Paris"}'),
    ("pythonic", '[get_weather(city="Paris"', '{"city": "Paris"'),
]
MALFORMED = [  # (parser, output): each is content, whole
    ("llama3_json", "The weather in Paris is sunny; 18 degrees."),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, not a call
    ("pythonic", "Paris is sunny [citation needed]."),
    ("pythonic", '[get_weather("Paris")]'),  # positional argument
    ("pythonic", "[get_weather(city=__import__('os').getcwd())]"),  # not a literal: never evaluated
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[]"),
    ("mistral", "No tools needed: [TOOL_CALLS is a marker]."),
    ("mistral", '[TOOL_CALLS]{"name": "get_weather", "arguments": {}}'),  # not an array
    ("hermes", "<tool_call>not json</tool_call>"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


def tool_calls(parser: str) -> ToolCalls:
    return ToolCalls(
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "Weather in Paris, time in Tokyo?"}], "tools": TOOLS}
        ),
        parser,
    )


def token_deltas(tokenizer, output: str) -> list[str]:
    """The text each token adds, as the detokenizer streams it (decode of the ids so far, differenced)."""
    ids = tokenizer.encode(output, add_special_tokens=False)
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert texts[-1] == output and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    return [b[len(a) :] for a, b in zip(texts, texts[1:])]


def stream(tools: ToolCalls, deltas: list[str]) -> tuple[str, list[dict]]:
    """(content, calls as {id, name, arguments}) reassembled from the stream's deltas, checking their shape."""
    streamer, content, calls = tools.streamer(), "", []
    for i, delta in enumerate(deltas):
        text, items = streamer.feed(delta, i == len(deltas) - 1)
        content += text
        for item in items:
            if "id" in item:  # a call starts: index, id, type, function.name
                assert item["index"] == len(calls) and item["type"] == "function"
                calls.append({"id": item["id"], "name": item["function"]["name"], "arguments": ""})
            calls[item["index"]]["arguments"] += item["function"].get("arguments", "")
    return content, calls


def names_and_arguments(calls) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


def test_the_flag_lists_every_parser():
    assert TOOL_CALL_PARSERS == ("hermes", "llama3_json", "pythonic", "mistral")


@pytest.mark.parametrize("parser, output, content, calls", CASES)
def test_whole_and_streamed_token_by_token(tokenizer, parser, output, content, calls):
    tools = tool_calls(parser)
    whole_content, whole = tools.parse(output)
    assert whole_content == content
    assert names_and_arguments([c["function"] | {"id": c["id"]} for c in whole]) == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in whole)
    streamed_content, streamed = stream(tools, token_deltas(tokenizer, output))
    assert streamed_content == (content or "")
    assert names_and_arguments(streamed) == names_and_arguments([c["function"] for c in whole])
    assert len({c["id"] for c in streamed}) == len(streamed)


@pytest.mark.parametrize("parser, output", MALFORMED)
def test_malformed_output_is_content(tokenizer, parser, output):
    tools = tool_calls(parser)
    assert tools.parse(output) == (output, [])
    assert stream(tools, token_deltas(tokenizer, output)) == (output, [])


@pytest.mark.parametrize("parser, output, arguments", CUT)
def test_a_call_cut_short_stays_as_sent(tokenizer, parser, output, arguments):
    """Its name went out before the output ended, so the stream keeps the call with the arguments it got
    (as vLLM does), where the whole-text parse is content."""
    tools = tool_calls(parser)
    assert tools.parse(output) == (output, [])
    content, calls = stream(tools, token_deltas(tokenizer, output))
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", arguments)]


def required_tool_calls() -> ToolCalls:
    return ToolCalls(
        ChatCompletionRequest.model_validate(
            {
                "messages": [{"role": "user", "content": "Weather in Paris, time in Tokyo?"}],
                "tools": TOOLS,
                "tool_choice": "required",
            }
        ),
        None,
    )


ARGUMENT_CASES = [(tool_calls, parser, output, calls) for parser, output, _, calls in CASES] + [
    (
        required_tool_calls,
        "required",
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "parameters": {"timezone": "Asia/Tokyo", "utc_offset": 9, '
        '"dst": false, "aliases": ["JST", null]}}]',
        [PARIS, TOKYO],
    ),
    (
        required_tool_calls,
        "required",
        '[{"name":"get_weather","parameters":{"city":"Paris","unit":"celsius"}}]',
        [PARIS],
    ),
]


@pytest.mark.parametrize("make, parser, output, calls", ARGUMENT_CASES)
def test_arguments_stream_as_they_arrive(tokenizer, make, parser, output, calls):
    """Each call's first item (with its name) goes out before the call's text is complete, then its arguments
    in several pieces, which concatenate to JSON text parsing to the arguments of the whole-text parse."""
    tools = make(parser) if make is tool_calls else make()
    streamer, deltas, seen, started, pieces = tools.streamer(), token_deltas(tokenizer, output), "", {}, {}
    for i, delta in enumerate(deltas):
        seen += delta
        for item in streamer.feed(delta, i == len(deltas) - 1)[1]:
            if "id" in item:
                assert item["function"]["name"] == calls[item["index"]][0]
                started[item["index"]] = seen
            pieces.setdefault(item["index"], []).append(item["function"].get("arguments", ""))
    for index, (name, arguments) in enumerate(calls):
        # the first item came once the name was in, while the arguments were still to come, in pieces
        assert (f'"{name}"' if parser != "pythonic" else f"{name}(") in started[index]
        assert pieces[index][0] != "".join(pieces[index])
        assert sum(1 for p in pieces[index] if p) > 1
        assert json.loads("".join(pieces[index])) == arguments
    whole = tools.parse(output)[1]
    assert (
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamer.calls]
        == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]
        == calls
    )


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_content_streams_before_the_output_ends(tokenizer, parser):
    """Text that cannot start a call is sent as it comes, not held until the end."""
    output = "The weather in Paris is sunny, 18 degrees celsius, with a light breeze from the west."
    streamer = tool_calls(parser).streamer()
    deltas = token_deltas(tokenizer, output)
    sent = "".join(streamer.feed(d, False)[0] for d in deltas[:-1])
    assert sent and output.startswith(sent) and len(sent) > len(output) // 2


def test_a_pythonic_call_starts_with_its_first_settled_argument(tokenizer):
    """The first of two pythonic calls is whole before the second is written; the second starts once its first
    argument's string begins, not at its name (a positional or non-literal argument would make it content)."""
    output = '[get_weather(city="Paris", unit="celsius"), get_time(timezone="Asia/Tokyo")]'
    streamer = tool_calls("pythonic").streamer()
    cut = output.index("get_time") + len("get_time(timezone=")
    assert streamer.feed(output[:cut], False)[0] == ""
    assert [c["function"]["name"] for c in streamer.calls] == ["get_weather"]
    assert json.loads(streamer.calls[0]["function"]["arguments"]) == PARIS[1]
    items = streamer.feed('"Asi', False)[1]
    assert items[0]["function"] == {"name": "get_time", "arguments": '{"timezone": "Asi'}
    assert streamer.feed(output[cut + 4 :], True)[1] == [{"index": 1, "function": {"arguments": 'a/Tokyo"}'}}]


def test_text_after_a_streamed_call_is_dropped(tokenizer):
    """The whole-text parse of a call followed by other text is content; streamed, the call has gone out
    before the text came, so the call stays and the text is dropped (as hermes does after a call)."""
    output = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}} and then some'
    tools = tool_calls("llama3_json")
    assert tools.parse(output) == (output, [])
    content, calls = stream(tools, token_deltas(tokenizer, output))
    assert content == "" and names_and_arguments(calls) == [PARIS]
