"""Engine-wide structured-output options (`--structured-outputs-config`)."""

from dataclasses import dataclass

from engine.config.parse import parse


@dataclass
class StructuredOutputsConfig:
    """Engine-wide structured-output options (`--structured-outputs-config`, vLLM's name).

    backend: "xgrammar" (or "auto", which means it here; vLLM's other backends are not built in).
    disable_any_whitespace: compact JSON for every request. compile_timeout: seconds a request waits
    for its grammar to compile before it is refused (the compile goes on and fills the cache).
    max_cached_grammars: compiled grammars kept, least recently used dropped first.
    max_whitespace_cnt: the most whitespace characters in a row that JSON output may hold (xgrammar's
    bound; None: unbounded), so a small model cannot fill max_tokens with newlines the grammar allows.

    Raises:
        ValueError: an unknown backend or a bound below its minimum.
    """

    backend: str = "xgrammar"
    disable_any_whitespace: bool = False
    compile_timeout: float = 10.0
    max_cached_grammars: int = 512
    max_whitespace_cnt: int | None = 16

    def __post_init__(self):
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(f'structured outputs backend {self.backend!r} is not supported; use "xgrammar"')
        if not self.compile_timeout > 0:
            raise ValueError(f"compile_timeout must be > 0 seconds, got {self.compile_timeout}")
        if self.max_cached_grammars < 1:
            raise ValueError(f"max_cached_grammars must be >= 1, got {self.max_cached_grammars}")
        if self.max_whitespace_cnt is not None and self.max_whitespace_cnt < 1:
            raise ValueError(f"max_whitespace_cnt must be >= 1 or null, got {self.max_whitespace_cnt}")

    @classmethod
    def from_json(cls, text: str) -> "StructuredOutputsConfig":
        """From the flag's JSON object, e.g. '{"backend": "xgrammar", "compile_timeout": 5}'.

        Raises ValueError for invalid JSON, a non-object, unknown keys or bad values."""
        return cls(**parse(cls, text, "--structured-outputs-config"))
