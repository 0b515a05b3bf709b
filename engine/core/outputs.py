"""What one engine-core step hands the output processor for each request that changed (vLLM v1's
EngineCoreOutput): data only, the text and the per-request outputs are made from it."""

from dataclasses import dataclass, field

import torch

from engine.outputs import Logprob


@dataclass
class EngineCoreOutput:
    """One request's news from one step.

    new_token_ids / new_logprobs: the tokens it was given (the last one ends it when finish_reason is set)
    and a Logprob|None each; new_prompt_logprobs: prompt-logprob entries computed this step, in order;
    pooling_output: an embedding request's embedding, float32 [hidden], once its prompt is computed;
    finish_reason: "stop" (EOS, a stop token or the grammar's end), "length" or "abort", None while it
    runs; stop_reason: the stop token id; kv_transfer_params: what a prefill server returns for a remote
    decode. num_cached_tokens, first_scheduled_time (time.monotonic()), num_preemptions: the scheduler's
    facts about it, for the request's metrics.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[Logprob | None] = field(default_factory=list)
    new_prompt_logprobs: list[Logprob] = field(default_factory=list)
    pooling_output: torch.Tensor | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
