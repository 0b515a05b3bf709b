"""The engine's JSON-object settings (`--speculative-config`, `--structured-outputs-config`,
`--kv-transfer-config`, or the same dicts passed to `LLM(...)`): one parser, so every one of them
rejects invalid JSON, a non-object and unknown keys alike, naming the setting."""
import dataclasses
import json


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
