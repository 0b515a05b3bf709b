"""vLLM's `pythonic` tool-call parser."""

import ast
import json
import re

from api.tool_parsers.abstract import Call, ToolParser


class PythonicParser(ToolParser):
    """vLLM's `pythonic` (Llama 3.2 1B / 3B, Llama 4): the output is a Python list of calls with keyword
    arguments, `[get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")]`. It is read with
    `ast` (nothing is evaluated); the arguments are Python literals (strings, numbers, True / False / None,
    lists, dicts), sent as JSON. An output that is not such a list is content.

    Streamed, a call starts with its first settled argument, and its arguments go out as the JSON text they
    become, growing: each keyword argument once its value is complete (a comma or the call's ")" after it), a
    string's characters as they come."""

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

    def scan(self, text: str, finished: bool) -> tuple[str, list[Call]]:
        # a finished text that is not a whole list of calls still settles what its calls had sent (cut short)
        if finished and (whole := self.extract(text))[1]:
            return whole[0] or "", whole[1]
        return self.partial(text)

    def partial(self, text: str) -> tuple[str, list[Call]]:
        source = text.strip()
        if not source:
            return "", []
        if not source.startswith("["):
            return text, []
        read = self._calls(source) or self._calls(source + "]")
        if read and read[1]:  # every call so far is complete: the text, closed by "]" if it is not yet, is a list
            return "", read[0]
        # a call is half-written: the calls before it are the list up to the last ")" that closes one
        calls, tail = [], source[1:]
        for end in (m.start() for m in reversed(list(re.finditer(r"\)", source)))):
            read = self._calls(source[: end + 1] + "]")
            if read and read[1]:
                calls, tail = read[0], source[end + 1 :]
                break
        half = re.fullmatch(r"\s*,?\s*([A-Za-z_]\w*)\((.*)", tail, re.DOTALL)
        if half is not None and (arguments := _partial_arguments(half[2])) is not None:
            calls.append((half[1], arguments))
        return "", calls


_STRING = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*(['\"])(.*)", re.DOTALL)


def _literal_kwargs(source: str) -> dict | None:
    """The keyword arguments `source` holds as literals (`f(source)` parses and every argument is one), or None."""
    try:
        call = ast.parse(f"f({source})", mode="eval").body
        if call.args or any(k.arg is None for k in call.keywords):
            return None
        arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        json.dumps(arguments)
        return arguments
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


def _partial_arguments(source: str) -> str | None:
    """The JSON text (a prefix of what the whole call's arguments will dump to) of a half-written call's argument
    source: the arguments before its last top-level comma, then a string argument in progress, as far as its
    characters are settled. None while nothing is settled (no complete argument, no string begun), so that a
    call with a positional or non-literal first argument never starts."""
    done, rest = {}, source
    for comma in reversed([m.start() for m in re.finditer(",", source)]):
        read = _literal_kwargs(source[:comma])
        if read is not None:
            done, rest = read, source[comma + 1 :]
            break
    text = json.dumps(done, ensure_ascii=False)[:-1]
    string = _STRING.match(rest)
    if string is None:  # nothing settled yet (a call starts with its first literal argument), or wait for a comma
        return text if done else None
    name, quote, body = string[1], string[2], string[3]
    close = re.search(rf"(?<!\\)(?:\\\\)*{quote}", body)
    if close is not None:  # the string is complete: its value is final
        body, tail = body[: close.end() - 1], body[close.end() :]
        if tail.strip() not in ("", ")"):
            return text  # something else follows: wait for the comma
    elif (cut := body.rfind("\\")) >= 0 and len(body) - cut <= 10:
        body = body[:cut]  # an escape sequence may be half-written
    try:
        value = ast.literal_eval(quote + body + quote)
    except (SyntaxError, ValueError):
        return text
    if not isinstance(value, str):
        return text
    dumped = json.dumps(value, ensure_ascii=False)
    return f"{text}{', ' if done else ''}{json.dumps(name)}: {dumped if close is not None else dumped[:-1]}"
