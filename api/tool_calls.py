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
  (`api.tool_parsers`): hermes, llama3_json, pythonic, mistral (one file each, with its format).
"""

import json
import uuid

from api.errors import APIError
from api.protocol import ChatCompletionRequest
from api.tool_parsers import ToolParser, get_tool_parser
from api.tool_parsers.json_scan import partial_calls, skip_space
from engine import StructuredOutputsParams


def _tool_call(name: str, arguments: str) -> dict:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


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
            raise APIError(400, 'tool_choice other than "none" needs tools', param="tool_choice")
        functions = {t.function.name: t.function for t in req.tools}
        if choice == "auto":
            if auto_parser is None:
                raise APIError(
                    400,
                    '"auto" tool choice needs a tool-call parser: the chat template writes no tool-call format '
                    "this server reads, so start it with --enable-auto-tool-choice and --tool-call-parser (or "
                    'give tool_choice "none", "required" or a named function)',
                    param="tool_choice",
                )
            self.mode, self.parser = "auto", get_tool_parser(auto_parser)
        elif choice == "required":
            self.mode = "required"
            items = [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": f.parameters or {"type": "object", "properties": {}},
                    },
                    "required": ["name", "parameters"],
                }
                for name, f in functions.items()
            ]
            schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
            if not req.parallel_tool_calls:
                schema["maxItems"] = 1
            self.constraint = StructuredOutputsParams(json=schema)
        else:
            self.named = choice.function.name
            if self.named not in functions:
                raise APIError(
                    400, f"tool_choice names the function {self.named!r}, which is not in tools", param="tool_choice"
                )
            self.mode = "named"
            self.constraint = StructuredOutputsParams(
                json=functions[self.named].parameters or {"type": "object", "properties": {}}
            )

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
    """ "tool_calls" when the model stopped by itself after calling tools ("required" or "auto");
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
                return "", [
                    {"index": 0, **self.calls[0], "function": {"name": self.tools.named, "arguments": new_text}}
                ]
            return "", [{"index": 0, "function": {"arguments": new_text}}]
        if mode == "required":
            # the grammar forces the array, so nothing is content until the end shows it does not parse
            pos = skip_space(self.text, 0)
            start = skip_space(self.text, pos + 1) if self.text.startswith("[", pos) else len(self.text)
            return self._feed_calls("", partial_calls(self.text, start, ",", ("parameters",)), finished)
        if mode == "auto":
            return self._feed_calls(*self.tools.parser.scan(self.text, finished), finished)
        return new_text, []

    def _feed_calls(self, content: str, calls: list[tuple[str, str]], finished: bool) -> tuple[str, list[dict]]:
        # the calls are re-read from all the text each time (outputs are short); each one's arguments only grow
        if finished and not self.calls:
            whole_content, whole_calls = self.tools.parse(self.text)
            if not whole_calls:  # not calls after all: the whole parse's content
                content, calls = whole_content or "", []
        delta = "" if self.calls else content[self.done :]
        self.done += len(delta)
        items = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.calls):
                self.calls.append(_tool_call(name, arguments))
                items.append(
                    {
                        "index": index,
                        "id": self.calls[-1]["id"],
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                )
            elif len(arguments) > len(sent := self.calls[index]["function"]["arguments"]):
                self.calls[index]["function"]["arguments"] = arguments
                items.append({"index": index, "function": {"arguments": arguments[len(sent) :]}})
        return delta, items
