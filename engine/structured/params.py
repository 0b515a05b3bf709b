"""What a request's output must match (`StructuredOutputsParams`) and the engine-wide options."""
import json
from dataclasses import dataclass

from engine import json_config

INSTALL_HINT = "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi"
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on a request's output, with vLLM's field names.

    json: a JSON schema (dict, or its JSON text); json_object: any JSON object; regex: a regular expression
    the whole output must match; choice: the output is one of these strings; grammar: an EBNF grammar in
    xgrammar's (GBNF-like) dialect with a `root` rule. disable_any_whitespace: JSON without free whitespace
    between tokens (compact output; small models then wander less).

    Raises:
        ValueError: none or several constraints, an empty or non-string choice, a non-string regex/grammar.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [f for f in _KINDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar and json_object; "
                             + (f"got {', '.join(given)}" if given else "none was given"))
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")

    @property
    def kind(self) -> str:
        """The constraint given: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(f for f in _KINDS if getattr(self, f) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """The compile-cache key: (what xgrammar compiles: "json", "regex" or "grammar", its text, any_whitespace).

        A choice becomes the EBNF alternation of its strings as JSON string literals (xgrammar's EBNF takes
        the same escapes); a json_object is the schema {"type": "object"}, as vLLM compiles it. Schema keys
        keep their order (it is the order the grammar emits properties in).
        """
        any_ws = not self.disable_any_whitespace
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json), any_ws
        if self.json_object:
            return "json", '{"type": "object"}', any_ws
        if self.regex is not None:
            return "regex", self.regex, any_ws
        if self.choice is not None:
            return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in self.choice), any_ws
        return "grammar", self.grammar, any_ws


@dataclass
class StructuredOutputsConfig:
    """Engine-wide structured-output options (`--structured-outputs-config`, vLLM's name).

    backend: "xgrammar" (or "auto", which means it here; vLLM's other backends are not built in).
    disable_any_whitespace: compact JSON for every request. compile_timeout: seconds a request waits
    for its grammar to compile before it is refused (the compile goes on and fills the cache).
    max_cached_grammars: compiled grammars kept, least recently used dropped first.

    Raises:
        ValueError: an unknown backend or a bound below its minimum.
    """

    backend: str = "xgrammar"
    disable_any_whitespace: bool = False
    compile_timeout: float = 10.0
    max_cached_grammars: int = 512

    def __post_init__(self):
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(f"structured outputs backend {self.backend!r} is not supported; use \"xgrammar\"")
        if not self.compile_timeout > 0:
            raise ValueError(f"compile_timeout must be > 0 seconds, got {self.compile_timeout}")
        if self.max_cached_grammars < 1:
            raise ValueError(f"max_cached_grammars must be >= 1, got {self.max_cached_grammars}")

    @classmethod
    def from_json(cls, text: str) -> "StructuredOutputsConfig":
        """From the flag's JSON object, e.g. '{"backend": "xgrammar", "compile_timeout": 5}'.

        Raises ValueError for invalid JSON, a non-object, unknown keys or bad values."""
        return cls(**json_config.parse(cls, text, "--structured-outputs-config"))
