"""OpenAI tool calling on chat completions: which calls a request allows, the grammar that forces them, and
reading the calls out of the generated text (whole, or as a stream of `delta.tool_calls` chunks).

tool_choice, as in vLLM:
- "none": tools go to the chat template (if it renders them); nothing is parsed.
- a named function: the output is constrained to that function's `parameters` schema and is its
  arguments; finish_reason stays "stop" (OpenAI's behaviour).
- "required": the output is constrained to vLLM's schema, a JSON array of {"name", "parameters"} with
  each tool's own parameters (one item at most without parallel_tool_calls); finish_reason "tool_calls".
- "auto" (the default when tools are given; needs --enable-auto-tool-choice --tool-call-parser hermes):
  the model decides; `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes / Qwen
  format) are extracted, the text before the first one is the content.
"""
import json
import re
import uuid

from api.errors import APIError
from api.protocol import ChatCompletionRequest
from engine import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


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
            self.mode = "auto"
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
        """False with the hermes parser (models may have <tool_call> as a special token), as vLLM does."""
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
        if self.mode == "auto" and _HERMES_START in text:
            try:
                calls = [json.loads(a or b) for a, b in _HERMES.findall(text)]
                calls = [_tool_call(c["name"], json.dumps(c.get("arguments", {}), ensure_ascii=False)) for c in calls]
            except (ValueError, TypeError, KeyError):
                return text, []
            return text[:text.index(_HERMES_START)] or None, calls
        return text, []

    def streamer(self) -> "ToolCallStream":
        return ToolCallStream(self)


def finish_reason(reason: str | None, calls: list, mode: str | None) -> str | None:
    """"tool_calls" when the model stopped by itself after calling tools ("required" or "auto");
    "length" and the rest stay, and a named tool_choice keeps "stop" (OpenAI's behaviour)."""
    return "tool_calls" if reason == "stop" and calls and mode in ("required", "auto") else reason


class ToolCallStream:
    """Splits one choice's streamed text into content deltas and OpenAI `delta.tool_calls` items.

    A call's first item carries `index`, `id`, `type` and `function.name` (and `arguments` so far), later
    ones only `index` and more `function.arguments`. Named calls stream their arguments as they are
    generated; "required" calls are sent when the output is complete (the JSON array must parse);
    "auto" sends text before `<tool_call>` as content and each call once its `</tool_call>` arrives.
    """

    def __init__(self, tools: ToolCalls):
        self.tools = tools
        self.text = ""  # all text received
        self.done = 0  # characters of `text` already turned into deltas
        self.calls: list[dict] = []  # calls sent, in OpenAI's shape

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
            if not finished:
                return "", []
            content, self.calls = self.tools.parse(self.text)
            return content or "", [{"index": i, **c} for i, c in enumerate(self.calls)]
        if mode == "auto":
            return self._feed_hermes(finished)
        return new_text, []

    def _feed_hermes(self, finished: bool) -> tuple[str, list[dict]]:
        content, items = "", []
        while True:
            rest = self.text[self.done:]
            start = rest.find(_HERMES_START)
            if start < 0:
                # hold back a tail that may be the start of "<tool_call>"; after the first call, text
                # outside calls is not content (as in the non-streamed parse)
                keep = 0 if finished else next((k for k in range(min(len(rest), len(_HERMES_START) - 1), 0, -1)
                                                if _HERMES_START.startswith(rest[-k:])), 0)
                if not self.calls:
                    content += rest[:len(rest) - keep]
                self.done += len(rest) - keep
                return content, items
            if not self.calls:
                content += rest[:start]
            self.done += start  # the text from `done` on starts with "<tool_call>"
            end = self.text.find(_HERMES_END, self.done)
            if end < 0 and not finished:
                return content, items
            body_end = end if end >= 0 else len(self.text)
            block_end = body_end + len(_HERMES_END) if end >= 0 else body_end
            try:
                call = json.loads(self.text[self.done + len(_HERMES_START):body_end])
                call = _tool_call(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False))
                items.append({"index": len(self.calls), **call})
                self.calls.append(call)
            except (ValueError, TypeError, KeyError):
                if not self.calls:
                    content += self.text[self.done:block_end]
            self.done = block_end
