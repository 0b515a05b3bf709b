"""Sampling parameters of one request, with vLLM's names and validation."""
from dataclasses import dataclass

from engine.structured.params import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per request (the fields of vLLM's `SamplingParams`).

    temperature 0 (or below 1e-5) means greedy. `seed` gives the request its own `torch.Generator`, so its samples do
    not depend on what else is in the batch. Penalties follow vLLM/OpenAI: presence and frequency over
    generated tokens, repetition (multiplicative, CTRL paper, Keskar et al. 2019) over prompt + output.
    `logprobs` = N returns the sampled token's log-probability and the top N (0 = only the sampled one).
    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar (needs xgrammar).
    `prompt_logprobs` = K returns every prompt token's log-probability given the tokens before it, and
    the top K alternatives (vLLM's meaning; `RequestOutput.prompt_logprobs`, None for the first token).
    `max_tokens` = 0 makes a prompt-only request: it computes the prompt (e.g. to score it with
    prompt_logprobs) and finishes with "length" without sampling.

    Raises:
        ValueError: a field is out of range; the message names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1 (or 0) = all tokens
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16  # None = up to max_model_len; 0 = compute the prompt only
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict | None = None  # for extensions, as in vLLM: {"kv_transfer_params": {...}} (engine.kv_transfer)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == 0:
            self.top_k = -1
        self._check()

    def _check(self):
        def bad(name, why):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            bad("max_tokens", "must be an integer >= 0")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "must be an integer in [0, 20]")
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias and any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            bad("logit_bias", "values must be in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        # as in vLLM: tiny temperatures are greedy (logits / 1e-40 would overflow float32)
        return self.temperature < 1e-5
