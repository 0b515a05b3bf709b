"""vLLM's `llama3_json` tool-call parser."""

from api.tool_parsers.abstract import Call, ToolParser
from api.tool_parsers.json_scan import json_calls, json_objects, partial_calls, skip_space


class Llama3JsonParser(ToolParser):
    """vLLM's `llama3_json` (Llama 3.1 / 3.2 JSON tool calling): the output is `{"name": ..., "parameters":
    {...}}` (or "arguments"), several separated by `;`, optionally after `<|python_tag|>`; an output that
    does not start with `{` (after whitespace and the tag) is content."""

    TEMPLATE_MARKERS = ('"parameters": dictionary of argument name',)  # Llama 3.1 / 3.2 / 3.3's templates

    TAG = "<|python_tag|>"

    def _body(self, text: str) -> int:
        """Where the JSON starts: after leading whitespace and the tag."""
        pos = skip_space(text, 0)
        return skip_space(text, pos + len(self.TAG)) if text.startswith(self.TAG, pos) else pos

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        pos = self._body(text)
        if not text.startswith("{", pos):
            return text, []
        values, complete = json_objects(text, pos, ";", None)
        calls = json_calls(values, ("parameters", "arguments"))
        return (None, calls) if complete and len(calls) == len(values) else (text, [])

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        pos = self._body(text)
        if text.startswith("{", pos):
            return "", partial_calls(text, pos, ";", ("parameters", "arguments"))
        # whitespace or the start of the tag may still lead to a call
        return ("", []) if self.TAG.startswith(text[pos:]) else (text, [])
