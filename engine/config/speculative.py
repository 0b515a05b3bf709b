"""`speculative_config`: vLLM's keys, defaults and validation (vllm/config/speculative.py)."""

from dataclasses import dataclass

from engine.config.parse import parse

METHODS = ("ngram", "draft_model")
# vLLM's other methods, refused by name so the error says what is missing rather than "unknown"
UNSUPPORTED = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix", "ngram_gpu", "deepseek_mtp")
MAX_SPEC_TOKENS = 128  # vLLM's MAX_SPEC_LEN


@dataclass
class SpeculativeConfig:
    """Speculative decoding, as `LLM(speculative_config={...})` and `--speculative-config '{...}'`.

    method: "ngram" (prompt lookup) or "draft_model" (`model` drafts, the target verifies). When
        left out it is inferred as vLLM does: model "ngram" / "[ngram]" means ngram, another model
        means draft_model.
    num_speculative_tokens: k, the most tokens proposed per request and step (1..128).
    prompt_lookup_min / prompt_lookup_max: the n-gram sizes searched (ngram). Neither set: both 5;
        one set: the other copies it (vLLM's defaults).
    model: the draft model (draft_model): anything the loader takes, with the target's vocabulary.
    num_speculative_tokens_per_batch_size: vLLM's dynamic schedule, [[first, last, k], ...]: inclusive
        ranges of the number of running requests and the most tokens proposed there (0: none);
        ranges sorted, non-overlapping, the first starting at 1; gaps and batches past the last
        range keep the k before them. None: k at every batch size. Within it the acceptance-aware
        policy (policy.py) decides per request.
    max_model_len: proposals stop once a sequence would pass this length (None: the target's).
    draft_tensor_parallel_size: 1 or None (this engine runs on one device).

    Raises:
        ValueError: an unknown key or method, or a value out of range; the message names the key.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    num_speculative_tokens_per_batch_size: list | None = None
    max_model_len: int | None = None
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def from_dict(cls, data: dict) -> "SpeculativeConfig":
        return cls(**parse(cls, data, "speculative_config"))

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig":
        return cls(**parse(cls, text, "speculative_config"))

    def __post_init__(self):
        if self.method is None:
            if self.model in ("ngram", "[ngram]"):
                self.method = "ngram"
            elif self.model is not None:
                self.method = "draft_model"
            else:
                raise ValueError("speculative_config needs a method (ngram or draft_model) or a model")
        if self.method in UNSUPPORTED:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported by this engine "
                f"(supported: {', '.join(METHODS)})"
            )
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative_config method {self.method!r} (supported: {', '.join(METHODS)})")
        k = self.num_speculative_tokens
        if k is None:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if not _is_int(k) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPEC_TOKENS}], got {k!r}")
        if self.method == "ngram":
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min = self.prompt_lookup_max = 5  # vLLM: "arbitrarily chosen"
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                    f"({self.prompt_lookup_max})"
                )
            if self.model in ("ngram", "[ngram]"):
                self.model = None
        elif self.model is None:
            raise ValueError("speculative_config method draft_model needs a model")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}")
        if self.num_speculative_tokens_per_batch_size is not None:
            self.num_speculative_tokens_per_batch_size = _schedule(self.num_speculative_tokens_per_batch_size)
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(
                f"draft_tensor_parallel_size must be 1 on this engine, got {self.draft_tensor_parallel_size!r}"
            )

    def tokens_for_batch(self, num_running: int) -> int:
        """The most tokens to propose per request while `num_running` requests run."""
        k = self.num_speculative_tokens
        for first, _, k_range in self.num_speculative_tokens_per_batch_size or ():
            if first > num_running:
                break
            k = min(k_range, self.num_speculative_tokens)
        return k


def _schedule(entries) -> list[tuple[int, int, int]]:
    """vLLM's validation of num_speculative_tokens_per_batch_size (v1/spec_decode/dynamic/utils.py)."""
    name = "num_speculative_tokens_per_batch_size"
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{name} must be a non-empty list of [range_start, range_end, num_speculative_tokens]")
    if any(not isinstance(e, (list, tuple)) or len(e) != 3 or not all(map(_is_int, e)) for e in entries):
        raise ValueError(f"each {name} entry must be 3 integers [range_start, range_end, num_speculative_tokens]")
    schedule = sorted(tuple(e) for e in entries)
    previous_end = 0
    for first, last, k in schedule:
        if first < 1 or first > last or k < 0:
            raise ValueError(f"{name} entry {[first, last, k]}: need 1 <= range_start <= range_end and k >= 0")
        if first <= previous_end:
            raise ValueError(f"{name} ranges must not overlap")
        previous_end = last
    if schedule[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at 1")
    return schedule


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
