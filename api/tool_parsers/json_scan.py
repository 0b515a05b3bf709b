"""Reading JSON tool calls out of text that may still be arriving: where a value ends, the call objects
begun so far and their names and raw arguments (the JSON parsers and tool_choice "required" use them)."""

import json
import re

from api.tool_parsers.abstract import Call


def skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


def json_objects(text: str, pos: int, sep: str, close: str | None) -> tuple[list, bool]:
    """The JSON values in `text` from `pos`, separated by `sep` and, with `close`, ending with it (whitespace
    allowed around them); and whether that is all the text (else it stops at the first thing that is not)."""
    values, decoder = [], json.JSONDecoder()
    while True:
        try:
            value, pos = decoder.raw_decode(text, skip_space(text, pos))
        except ValueError:
            return values, False
        values.append(value)
        pos = skip_space(text, pos)
        if text.startswith(sep, pos):
            pos += len(sep)
        elif close is None:
            return values, pos == len(text)
        else:
            return values, text.startswith(close, pos) and skip_space(text, pos + len(close)) == len(text)


def json_calls(values: list, argument_keys: tuple[str, ...]) -> list[Call]:
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


def value_end(text: str, pos: int) -> int | None:
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


def partial_call(text: str, pos: int, argument_keys: tuple[str, ...]) -> tuple[str | None, str | None, int | None]:
    """Reads the call object `{"name": ..., KEY: {...}}` starting at `pos` as far as it has arrived: (its name
    once that string is complete, the raw text so far of the value of the first of `argument_keys` met (None
    before it), where the object ends (None while it is unfinished or where it stops being a JSON object))."""
    name, arguments, decoder = None, None, json.JSONDecoder()
    pos = skip_space(text, pos + 1)
    while not text.startswith("}", pos):
        try:
            key, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return name, arguments, None
        pos = skip_space(text, pos)
        if not text.startswith(":", pos):
            return name, arguments, None
        pos = skip_space(text, pos + 1)
        end = value_end(text, pos)
        if key == "name" and end is not None and name is None:
            try:
                name = json.loads(text[pos:end]) if text.startswith('"', pos) else None
            except ValueError:  # a bad escape: not a call's name
                pass
        elif key in argument_keys and arguments is None and pos < len(text):
            arguments = text[pos:end]
        if end is None:
            return name, arguments, None
        pos = skip_space(text, end)
        if text.startswith(",", pos):
            pos = skip_space(text, pos + 1)
        elif not text.startswith("}", pos):
            return name, arguments, None
    return name, arguments, pos + 1


def partial_calls(text: str, pos: int, sep: str, argument_keys: tuple[str, ...]) -> list[Call]:
    """The calls begun in `text` from `pos`, objects separated by `sep` (whitespace around them), each as (name,
    raw arguments so far) from when its name is complete; it stops at the first that has no name yet."""
    calls = []
    while text.startswith("{", pos):
        name, arguments, end = partial_call(text, pos, argument_keys)
        if name is None:
            break
        calls.append((name, arguments or ""))
        if end is None or not text.startswith(sep, pos := skip_space(text, end)):
            break
        pos = skip_space(text, pos + len(sep))
    return calls
