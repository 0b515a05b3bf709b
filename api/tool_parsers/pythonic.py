"""vLLM's `pythonic` tool-call parser."""

import ast
import json

from api.tool_parsers.abstract import Call, ToolParser


class PythonicParser(ToolParser):
    """vLLM's `pythonic` (Llama 3.2 1B / 3B, Llama 4): the output is a Python list of calls with keyword
    arguments, `[get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")]`. It is read with
    `ast` (nothing is evaluated); the arguments are Python literals (strings, numbers, True / False / None,
    lists, dicts), sent as JSON. An output that is not such a list is content."""

    TEMPLATE_MARKERS = (r"\[func_name1\(",)  # vLLM's pythonic templates, Llama 4's

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
            if not (
                isinstance(item, ast.Call)
                and isinstance(item.func, ast.Name)
                and not item.args
                and all(k.arg is not None for k in item.keywords)
            ):
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
        read = self._calls(source) or self._calls(source + "]") or self._calls(source[: source.rfind(")") + 1] + "]")
        return "", read[0] if read else []
