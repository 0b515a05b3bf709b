"""vLLM's `mistral` tool-call parser."""

from api.streaming import held_tail
from api.tool_parsers.abstract import Call, ToolParser
from api.tool_parsers.json_scan import json_calls, json_objects, partial_calls, skip_space


class MistralParser(ToolParser):
    """vLLM's `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`; the text
    before it is the content. (Newer Mistral tokenizers' `[TOOL_CALLS]name[ARGS]{...}` is not read.)"""

    TEMPLATE_MARKERS = (r"\[TOOL_CALLS\]",)
    TEMPLATE_EXCLUDES = (r"\[ARGS\]",)  # the newer [TOOL_CALLS]name[ARGS]{...} (Mistral Small 3.2, Devstral)

    TAG = "[TOOL_CALLS]"

    def _calls(self, text: str, start: int) -> tuple[list[Call], bool]:
        """The leading calls of the array after the tag at `start` and whether the array is all calls."""
        pos = skip_space(text, start + len(self.TAG))
        if not text.startswith("[", pos):
            return [], False
        values, complete = json_objects(text, pos + 1, ",", "]")
        calls = json_calls(values, ("arguments",))
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
            return text[: len(text) - (0 if finished else held_tail(text, self.TAG))], []
        pos = skip_space(text, start + len(self.TAG))
        if not text.startswith("[", pos):
            return text[:start], []
        return text[:start], partial_calls(text, skip_space(text, pos + 1), ",", ("arguments",))
