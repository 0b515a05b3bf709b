"""Sampling parameters of one request, with vLLM's names and validation."""

import json
from dataclasses import dataclass

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
            raise ValueError(
                "structured outputs need exactly one of json, regex, choice, grammar and json_object; "
                + (f"got {', '.join(given)}" if given else "none was given")
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"json must be a JSON schema (an object or its JSON text), got {type(self.json).__name__}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
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
    `thinking_token_budget` = B with `thinking_end_token_ids` (the tokens of a reasoning model's end of thinking,
    `</think>`): once B tokens are out and the end has not been written, the next tokens are forced to be the end
    (Anthropic's `thinking.budget_tokens`, llama.cpp's reasoning budget); the answer follows.

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
    thinking_token_budget: int | None = None
    thinking_end_token_ids: list[int] | None = None
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
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            bad("prompt_logprobs", "must be an integer in [0, 20]")
        if any(not s for s in self.stop):
            bad("stop", "must not contain empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias and any(not -100 <= b <= 100 for b in self.logit_bias.values()):
            bad("logit_bias", "values must be in [-100, 100]")
        if self.thinking_token_budget is not None and (
            not isinstance(self.thinking_token_budget, int) or self.thinking_token_budget < 0
        ):
            bad("thinking_token_budget", "must be an integer >= 0")
        if self.thinking_token_budget is not None and not self.thinking_end_token_ids:
            bad("thinking_end_token_ids", "must name the end of thinking when a thinking_token_budget is set")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        # as in vLLM: tiny temperatures are greedy (logits / 1e-40 would overflow float32)
        return self.temperature < 1e-5
