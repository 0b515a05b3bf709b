"""Random JSON schemas for the structured-output tests: objects, nested objects, arrays, enums, bounded
numbers, required and optional properties, and `$ref` to `$defs`; deterministic for a seed."""

import random

_WORDS = [
    "name",
    "city",
    "age",
    "score",
    "tags",
    "color",
    "owner",
    "size",
    "status",
    "items",
    "price",
    "id",
    "title",
    "count",
    "label",
    "kind",
    "level",
    "note",
    "rank",
    "code",
]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "short_string", "integer", "number", "boolean", "enum"])
    # Strings are bounded so that sampled ones end soon; length bounds cost compile time (xgrammar
    # unrolls them: ~0.1 s at 8 characters, 0.5 s at 24 on a loaded 2-core machine).
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(4, 10)}
    if kind == "short_string":
        return {"type": "string", "minLength": 1, "maxLength": 3}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no", "maybe"], rng.randint(2, 4))}


def _value(rng: random.Random, depth: int, defs: dict) -> dict:
    roll = rng.random()
    if depth < 2 and roll < 0.2:
        return _object(rng, depth + 1, defs)
    if depth < 2 and roll < 0.35:
        return {"type": "array", "items": _value(rng, depth + 1, defs), "minItems": 1, "maxItems": rng.randint(1, 3)}
    if roll < 0.45:
        name = f"def{len(defs)}"
        defs[name] = _leaf(rng)
        return {"$ref": f"#/$defs/{name}"}
    return _leaf(rng)


def _object(rng: random.Random, depth: int, defs: dict) -> dict:
    keys = rng.sample(_WORDS, rng.randint(1, 4))
    props = {k: _value(rng, depth, defs) for k in keys}
    required = [k for k in keys if rng.random() < 0.7] or keys[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schemas(n: int, seed: int = 0) -> list[dict]:
    """n JSON schemas (draft 2020-12), each an object at the top."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        defs: dict = {}
        schema = _object(rng, 0, defs)
        if defs:
            schema["$defs"] = defs
        out.append(schema)
    return out
