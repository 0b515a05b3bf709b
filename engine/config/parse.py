"""How settings are declared and read: `setting` (a dataclass field that is also a server flag), one parser
of the JSON-object settings (`--speculative-config`, `--structured-outputs-config`, `--kv-transfer-config`,
`--pooler-config`, or the same dicts passed to `LLM(...)`), so every one of them rejects invalid JSON, a
non-object and unknown keys alike, naming the setting, and byte sizes ("2G")."""

import dataclasses
import json
import re


def parse(cls, value: str | dict, name: str) -> dict:
    """The keyword arguments of dataclass `cls` in `value`, a JSON object's text or a dict.

    Raises ValueError: `value` is not valid JSON or not an object, or has keys that are not fields of
    `cls`; the message names the setting (`name`) and lists the supported keys.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown {name} key(s): {', '.join(unknown)} (supported: {', '.join(sorted(known))})")
    return value


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str | int) -> int:
    """A size in bytes: 268435456, "268435456", "256M", "2GiB" (K/M/G/T are powers of 1024).

    Raises ValueError: not a size.
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"(\d+)\s*([kmgt]?)(?:i?b)?", str(text).strip().lower())
    if not match:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 268435456, 256M, 2G)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def setting(
    default=None,
    help: str = "",
    *,
    default_factory=None,
    flags: tuple[str, ...] = (),
    choices=None,
    parse=None,
    metavar: str | None = None,
    nargs: str | None = None,
    cli: bool = True,
):
    """A dataclass field that is also a command-line flag (api/cli.py generates the flags from the fields).

    help: what it does (the flag's help); flags: the flag names (default: --field-name); choices: the
    values allowed; parse: str -> value for flags that are not plain ints, floats, strings or booleans
    (a JSON object, a byte size), raising ValueError; nargs: argparse's, for a flag taking several values (a
    list of strings); cli: False for a setting that has no flag.
    """
    metadata = {"help": help, "flags": flags, "choices": choices, "parse": parse, "metavar": metavar, "nargs": nargs}
    metadata["cli"] = cli
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
