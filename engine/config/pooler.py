"""`--pooler-config`: how an embedding request's hidden states become its embedding (vLLM's PoolerConfig)."""

from dataclasses import dataclass

from engine.config.parse import parse

POOLING_TYPES = ("LAST", "MEAN")


@dataclass
class PoolerConfig:
    """pooling_type: "LAST" (the last prompt token's final hidden state, as Qwen3-Embedding and
    e5-mistral are used) or "MEAN" (the mean over every prompt position); normalize: L2-normalise
    the result. Raises ValueError for another type or an unknown key."""

    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        self.pooling_type = str(self.pooling_type).upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")

    @classmethod
    def from_json(cls, text: str) -> "PoolerConfig":
        """From the flag's JSON object, e.g. '{"pooling_type": "MEAN"}'. Raises ValueError."""
        return cls(**parse(cls, text, "--pooler-config"))
