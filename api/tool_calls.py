"""OpenAI tool calling on chat completions: which calls a request allows, the grammar that forces them, and
reading the calls out of the generated text (whole, or as a stream of `delta.tool_calls` chunks).

tool_choice, as in vLLM:
- "none": tools go to the chat template (if it renders them); nothing is parsed.
- a named function: the output is constrained to that function's `parameters` schema and is its
  arguments; finish_reason stays "stop" (OpenAI's behaviour).
- "required": the output is constrained to vLLM's schema, a JSON array of {"name", "parameters"} with
  each tool's own parameters (one item at most without parallel_tool_calls); finish_reason "tool_calls".
- "auto" (the default when tools are given; needs --enable-auto-tool-choice --tool-call-parser NAME):
  the model decides; the calls are read out of its text by one of vLLM's tool parsers, by the same names
  (`TOOL_CALL_PARSERS`): hermes, llama3_json, pythonic, mistral (see their classes for the formats).
"""
import ast
import json
import re
import uuid

from api.errors import APIError
from api.protocol import ChatCompletionRequest
from api.streaming import held_tail
from engine import StructuredOutputsParams

def _tool_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCalls:
    """The tool-calling side of one chat request.

    mode: None (no tools, or "none"), "named", "required" or "auto". `template_tools` go to the chat
    template; `constraint` is the grammar of named/required calls (None otherwise).

    Raises:
        APIError: 400 for an empty tools list, tool_choice without tools, a named tool that is not in
            tools, "auto" on a server without --enable-auto-tool-choice, or tool_choice named/required
            together with another output constraint (checked by `check_no_other_constraint`).
    """

    def __init__(self, req: ChatCompletionRequest, auto_parser: str | None):
        self.mode, self.named = None, None
        self.parser: ToolParser | None = None  # the auto parser, in mode "auto"
        self.template_tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        self.constraint: StructuredOutputsParams | None = None
        if req.tools is not None and not req.tools:
            raise APIError(400, "tools must not be empty (leave it out for no tools)", param="tools")
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if choice == "none":
            return
        if not req.tools:
            raise APIError(400, "tool_choice other than \"none\" needs tools", param="tool_choice")
        functions = {t.function.name: t.function for t in req.tools}
        if choice == "auto":
            if auto_parser is None:
                raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                    'to be set (or give tool_choice "none", "required" or a named function)',
                               param="tool_choice")
            self.mode, self.parser = "auto", _PARSERS[auto_parser]
        elif choice == "required":
            self.mode = "required"
            items = [{"properties": {"name": {"type": "string", "enum": [name]},
                                     "parameters": f.parameters or {"type": "object", "properties": {}}},
                      "required": ["name", "parameters"]} for name, f in functions.items()]
            schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
            if not req.parallel_tool_calls:
                schema["maxItems"] = 1
            self.constraint = StructuredOutputsParams(json=schema)
        else:
            self.named = choice.function.name
            if self.named not in functions:
                raise APIError(400, f"tool_choice names the function {self.named!r}, which is not in tools",
                               param="tool_choice")
            self.mode = "named"
            self.constraint = StructuredOutputsParams(
                json=functions[self.named].parameters or {"type": "object", "properties": {}})

    @property
    def skip_special_tokens(self) -> bool | None:
        """False with an auto parser, as vLLM does: the markers of the calls (<tool_call>, <|python_tag|>,
        [TOOL_CALLS]) may be special tokens of the model."""
        return False if self.mode == "auto" else None

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls in OpenAI's shape) of a finished output. Text that does not parse as the
        expected calls comes back whole as content, with no calls."""
        if self.mode == "named":
            return None, [_tool_call(self.named, text)]
        if self.mode == "required":
            try:
                calls = json.loads(text)
                return None, [_tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
            except (ValueError, TypeError, KeyError):
                return text, []
        if self.mode == "auto":
            content, calls = self.parser.extract(text)
            return content, [_tool_call(name, arguments) for name, arguments in calls]
        return text, []

    def streamer(self) -> "ToolCallStream":
        return ToolCallStream(self)


def finish_reason(reason: str | None, calls: list, mode: str | None) -> str | None:
    """"tool_calls" when the model stopped by itself after calling tools ("required" or "auto");
    "length" and the rest stay, and a named tool_choice keeps "stop" (OpenAI's behaviour)."""
    return "tool_calls" if reason == "stop" and calls and mode in ("required", "auto") else reason


class ToolCallStream:
    """Splits one choice's streamed text into content deltas and OpenAI `delta.tool_calls` items.

    A call's first item carries `index`, `id`, `type` and `function.name` (and `arguments` so far, "" when
    the name comes before them), later ones only `index` and more `function.arguments`, as vLLM streams them.
    Named calls stream their arguments as they are generated; "required" calls and those of the JSON auto
    parsers go out as soon as their `"name"` is complete, then the raw text of their arguments object as it
    grows (so the concatenation parses to the arguments, though its spacing is the model's, not that of the
    whole-output `json.dumps`); pythonic calls go out whole once their text has arrived. "auto" sends content
    as soon as the parser knows it cannot be part of a call (`ToolParser.scan`). A call once started is never
    taken back, so from then on no more content is sent: a malformed call after it is dropped, and a call cut
    short (max_tokens) or malformed after its name ends as sent, where the whole-text parse would turn the
    whole output into content.
    """

    def __init__(self, tools: ToolCalls):
        self.tools = tools
        self.text = ""  # all text received
        self.done = 0  # characters of content already sent ("auto")
        self.calls: list[dict] = []  # calls started, in OpenAI's shape, with the arguments sent so far

    def feed(self, new_text: str, finished: bool) -> tuple[str, list[dict]]:
        """Takes the next piece of text; returns (content delta, tool-call delta items)."""
        self.text += new_text
        mode = self.tools.mode
        if mode == "named":
            if not new_text and (self.calls or not finished):
                return "", []
            if not self.calls:
                self.calls.append(_tool_call(self.tools.named, ""))
                return "", [{"index": 0, **self.calls[0], "function": {"name": self.tools.named,
                                                                       "arguments": new_text}}]
            return "", [{"index": 0, "function": {"arguments": new_text}}]
        if mode == "required":
            # the grammar forces the array, so nothing is content until the end shows it does not parse
            pos = _skip_space(self.text, 0)
            start = _skip_space(self.text, pos + 1) if self.text.startswith("[", pos) else len(self.text)
            return self._feed_calls("", _partial_calls(self.text, start, ",", ("parameters",)), finished)
        if mode == "auto":
            return self._feed_calls(*self.tools.parser.scan(self.text, finished), finished)
        return new_text, []

    def _feed_calls(self, content: str, calls: list["Call"], finished: bool) -> tuple[str, list[dict]]:
        # the calls are re-read from all the text each time (outputs are short); each one's arguments only grow
        if finished and not self.calls:
            whole_content, whole_calls = self.tools.parse(self.text)
            if not whole_calls:  # not calls after all: the whole parse's content
                content, calls = whole_content or "", []
        delta = "" if self.calls else content[self.done:]
        self.done += len(delta)
        items = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.calls):
                self.calls.append(_tool_call(name, arguments))
                items.append({"index": index, "id": self.calls[-1]["id"], "type": "function",
                              "function": {"name": name, "arguments": arguments}})
            elif len(arguments) > len(sent := self.calls[index]["function"]["arguments"]):
                self.calls[index]["function"]["arguments"] = arguments
                items.append({"index": index, "function": {"arguments": arguments[len(sent):]}})
        return delta, items


Call = tuple[str, str]  # (function name, arguments as JSON text: whole, or so far while streaming)


class ToolParser:
    """Reads the tool calls of tool_choice "auto" out of a model's text; one per `--tool-call-parser` name.

    `extract` parses a whole output; `scan` reads one that is still being generated. A text that does not
    parse as the format's calls is content, whole, with no calls.
    """

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a finished output; content None when the output is only calls."""
        raise NotImplementedError

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        """(content, calls) that the text so far settles: content that cannot become part of a call and the
        calls begun, each with its arguments so far (the JSON parsers: from when the name is complete, the raw
        text of the arguments; pythonic: a call whole once its text has arrived). What is returned is never
        taken back by a longer text (the content only grows; a call, once returned, keeps its place and its
        arguments only grow, though a half-written one after it may hide it for a while: `ToolCallStream`
        sends only what is past what it sent). Whether a finished text is calls at all is `extract`'s say."""
        if finished:
            content, calls = self.extract(text)
            return content or "", calls
        return self.partial(text)

    def partial(self, text: str) -> tuple[str, list[Call]]:
        """`scan` of an unfinished text."""
        raise NotImplementedError


def _skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


def _json_objects(text: str, pos: int, sep: str, close: str | None) -> tuple[list, bool]:
    """The JSON values in `text` from `pos`, separated by `sep` and, with `close`, ending with it (whitespace
    allowed around them); and whether that is all the text (else it stops at the first thing that is not)."""
    values, decoder = [], json.JSONDecoder()
    while True:
        try:
            value, pos = decoder.raw_decode(text, _skip_space(text, pos))
        except ValueError:
            return values, False
        values.append(value)
        pos = _skip_space(text, pos)
        if text.startswith(sep, pos):
            pos += len(sep)
        elif close is None:
            return values, pos == len(text)
        else:
            return values, text.startswith(close, pos) and _skip_space(text, pos + len(close)) == len(text)


def _json_calls(values: list, argument_keys: tuple[str, ...]) -> list[Call]:
    """The leading values that are calls, {"name": str, KEY: {...}} with KEY the first of `argument_keys` present."""
    calls = []
    for v in values:
        key = next((k for k in argument_keys if k in v), None) if isinstance(v, dict) else None
        if key is None or not isinstance(v.get("name"), str) or not isinstance(v[key], dict):
            break
        calls.append((v["name"], json.dumps(v[key], ensure_ascii=False)))
    return calls


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SCALAR = re.compile(r"[^\s,}\]]*[\s,}\]]")  # a number, true, ...: it ends at a delimiter
_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[{\[}\]]', re.DOTALL)  # strings whole, so their brackets do not count


def _value_end(text: str, pos: int) -> int | None:
    """Where the JSON value starting at `pos` ends; None while it may still go on. Only its extent is found
    (strings and brackets matched): `extract` is the judge of whether the whole is valid."""
    if text.startswith('"', pos):
        match = _STRING.match(text, pos)
        return match.end() if match else None
    if not text.startswith(("{", "["), pos):
        scalar = _SCALAR.match(text, pos)
        return scalar.end() - 1 if scalar else None
    depth = 0
    for match in _BRACKETS.finditer(text, pos):
        if match.group() in "{[":
            depth += 1
        elif match.group() in "}]":
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def _partial_call(text: str, pos: int, argument_keys: tuple[str, ...]) -> tuple[str | None, str | None, int | None]:
    """Reads the call object `{"name": ..., KEY: {...}}` starting at `pos` as far as it has arrived: (its name
    once that string is complete, the raw text so far of the value of the first of `argument_keys` met (None
    before it), where the object ends (None while it is unfinished or where it stops being a JSON object))."""
    name, arguments, decoder = None, None, json.JSONDecoder()
    pos = _skip_space(text, pos + 1)
    while not text.startswith("}", pos):
        try:
            key, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return name, arguments, None
        pos = _skip_space(text, pos)
        if not text.startswith(":", pos):
            return name, arguments, None
        pos = _skip_space(text, pos + 1)
        end = _value_end(text, pos)
        if key == "name" and end is not None and name is None:
            try:
                name = json.loads(text[pos:end]) if text.startswith('"', pos) else None
            except ValueError:  # a bad escape: not a call's name
                pass
        elif key in argument_keys and arguments is None and pos < len(text):
            arguments = text[pos:end]
        if end is None:
            return name, arguments, None
        pos = _skip_space(text, end)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
        elif not text.startswith("}", pos):
            return name, arguments, None
    return name, arguments, pos + 1


def _partial_calls(text: str, pos: int, sep: str, argument_keys: tuple[str, ...]) -> list[Call]:
    """The calls begun in `text` from `pos`, objects separated by `sep` (whitespace around them), each as (name,
    raw arguments so far) from when its name is complete; it stops at the first that has no name yet."""
    calls = []
    while text.startswith("{", pos):
        name, arguments, end = _partial_call(text, pos, argument_keys)
        if name is None:
            break
        calls.append((name, arguments or ""))
        if end is None or not text.startswith(sep, pos := _skip_space(text, end)):
            break
        pos = _skip_space(text, pos + len(sep))
    return calls

class HermesParser(ToolParser):
    """vLLM's `hermes` (Hermes 2 Pro, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks; the text before the first one is the content. An unclosed last block is read to the end."""

    START, END = "<tool_call>", "</tool_call>"
    BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        if self.START not in text:
            return text, []
        try:
            calls = [json.loads(a or b) for a, b in self.BLOCKS.findall(text)]
            calls = [(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in calls]
        except (ValueError, TypeError, KeyError):
            return text, []
        return text[:text.index(self.START)] or None, calls

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        # block by block, so that (as before this parser had siblings) a block with no name before the first
        # call streams as content and one after it is dropped, rather than the whole output turning into content
        content, calls, pos = "", [], 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                # after the first call, text outside calls is not content (as in `extract`)
                if not calls:
                    content += text[pos:len(text) - (0 if finished else held_tail(text[pos:], self.START))]
                return content, calls
            if not calls:
                content += text[pos:start]
            end = text.find(self.END, start)
            # an unclosed block ends where the text does, less what may be the start of its closing tag
            body_end = end if end >= 0 else len(text) - (0 if finished else held_tail(text, self.END))
            body = _skip_space(text, start + len(self.START))
            name, arguments, object_end = (_partial_call(text[:body_end], body, ("arguments",))
                                           if text.startswith("{", body) else (None, None, None))
            if name is not None:  # no "arguments" is {} (as in `extract`), once the object shows there are none
                calls.append((name, arguments if arguments is not None else "" if object_end is None else "{}"))
            if end < 0:
                return content, calls
            pos = end + len(self.END)
            if name is None and not calls:
                content += text[start:pos]


class Llama3JsonParser(ToolParser):
    """vLLM's `llama3_json` (Llama 3.1 / 3.2 JSON tool calling): the output is `{"name": ..., "parameters":
    {...}}` (or "arguments"), several separated by `;`, optionally after `<|python_tag|>`; an output that
    does not start with `{` (after whitespace and the tag) is content."""

    TAG = "<|python_tag|>"

    def _body(self, text: str) -> int:
        """Where the JSON starts: after leading whitespace and the tag."""
        pos = _skip_space(text, 0)
        return _skip_space(text, pos + len(self.TAG)) if text.startswith(self.TAG, pos) else pos

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        pos = self._body(text)
        if not text.startswith("{", pos):
            return text, []
        values, complete = _json_objects(text, pos, ";", None)
        calls = _json_calls(values, ("parameters", "arguments"))
        return (None, calls) if complete and len(calls) == len(values) else (text, [])

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        pos = self._body(text)
        if text.startswith("{", pos):
            return "", _partial_calls(text, pos, ";", ("parameters", "arguments"))
        # whitespace or the start of the tag may still lead to a call
        return ("", []) if self.TAG.startswith(text[pos:]) else (text, [])


class PythonicParser(ToolParser):
    """vLLM's `pythonic` (Llama 3.2 1B / 3B, Llama 4): the output is a Python list of calls with keyword
    arguments, `[get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")]`. It is read with
    `ast` (nothing is evaluated); the arguments are Python literals (strings, numbers, True / False / None,
    lists, dicts), sent as JSON. An output that is not such a list is content."""

    def _calls(self, source: str) -> tuple[list[Call], bool] | None:
        """The leading well-formed calls of the list `source` and whether all its items are; None when it is
        not a list."""
        try:
            tree = ast.parse(source, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return None
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for item in tree.elts:
            if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and not item.args
                    and all(k.arg is not None for k in item.keywords)):
                return calls, False
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in item.keywords}
                calls.append((item.func.id, json.dumps(arguments, ensure_ascii=False)))
            except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal, or not JSON (a set)
                return calls, False
        return calls, True

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        source = text.strip()
        if not source.startswith("["):
            return text, []
        read = self._calls(source)
        return (None, read[0]) if read and read[1] and read[0] else (text, [])

    def partial(self, text: str) -> tuple[str, list[Call]]:
        source = text.strip()
        if not source:
            return "", []
        if not source.startswith("["):
            return text, []
        # a call is complete once its ")" is there: the text, closed by "]" if it is not yet, is a list; while
        # the next call is half-written, the list up to the last ")" is
        read = (self._calls(source) or self._calls(source + "]")
                or self._calls(source[:source.rfind(")") + 1] + "]"))
        return "", read[0] if read else []


class MistralParser(ToolParser):
    """vLLM's `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`; the text
    before it is the content. (Newer Mistral tokenizers' `[TOOL_CALLS]name[ARGS]{...}` is not read.)"""

    TAG = "[TOOL_CALLS]"

    def _calls(self, text: str, start: int) -> tuple[list[Call], bool]:
        """The leading calls of the array after the tag at `start` and whether the array is all calls."""
        pos = _skip_space(text, start + len(self.TAG))
        if not text.startswith("[", pos):
            return [], False
        values, complete = _json_objects(text, pos + 1, ",", "]")
        calls = _json_calls(values, ("arguments",))
        return calls, complete and bool(calls) and len(calls) == len(values)

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        start = text.find(self.TAG)
        if start < 0:
            return text, []
        calls, complete = self._calls(text, start)
        return (text[:start] or None, calls) if complete else (text, [])

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        start = text.find(self.TAG)
        if start < 0:
            return text[:len(text) - (0 if finished else held_tail(text, self.TAG))], []
        pos = _skip_space(text, start + len(self.TAG))
        if not text.startswith("[", pos):
            return text[:start], []
        return text[:start], _partial_calls(text, _skip_space(text, pos + 1), ",", ("arguments",))


_PARSERS: dict[str, ToolParser] = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser(),
                                   "pythonic": PythonicParser(), "mistral": MistralParser()}
TOOL_CALL_PARSERS = tuple(_PARSERS)
