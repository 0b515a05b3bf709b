"""What crosses the scheduler/runner seam each step (vLLM v1's `SchedulerOutput` and
`ModelRunnerOutput`), and the view of a sequence that the KV manager and the runner read.

Data only: the scheduler builds a `SchedulerOutput`, the executor's runner reads it (and the
sequences in it, without changing them) and answers a `ModelRunnerOutput`, and
`Scheduler.update_from_output` applies that answer to the requests.
"""
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams


class Sequence(Protocol):
    """What the KV cache manager and input preparation read from a sequence: `engine.core.request.Request`,
    and the draft model's own view of a request (`engine.spec_decode.draft_model.DraftSequence`).

    all_token_ids: prompt + output token ids (num_tokens of them); num_computed_tokens: how many have
    K/V in the cache; spec_token_ids: draft tokens to verify after the last token; block_hashes: the
    chained hashes of its full blocks, which the KV manager extends; prompt_logprobs: the entries
    collected so far, None when not asked for; pooling: an embedding request's pooling type, else None.
    """

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int]
    block_hashes: list[int]
    prompt_logprobs: list | None
    pooling: str | None
    params: SamplingParams

    @property
    def num_tokens(self) -> int: ...


@dataclass
class SchedulerOutput:
    """One step's batch, in batch order (requests that ran last step first, then new or resumed ones).

    requests[i] computes num_new_tokens[i] tokens from its num_computed_tokens on, its draft tokens
    (spec_token_ids) included, with the KV blocks block_tables[i]. num_new_requests: how many of the
    requests were admitted this step (the last ones). scheduled_spec_decode_tokens: the draft tokens
    verified this step, by request id. finished_req_ids: requests finished since the last step.
    grammar_bitmask: int32 [rows, ceil(vocab / 32)], the next tokens that the grammars of the
    structured-output requests sampling this step allow; structured_rows: request id -> its row
    (filled by engine.structured before the step runs; None when no sampling request is constrained).
    """

    requests: list[Sequence]
    num_new_tokens: list[int]
    block_tables: list[list[int]] = field(default_factory=list)
    num_new_requests: int = 0
    finished_req_ids: list[str] = field(default_factory=list)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    structured_rows: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass
class ModelRunnerOutput:
    """What one step computed, by request id.

    req_ids: the requests that sampled (in batch order); sampled_token_ids[i]: their new tokens (one,
    or with drafts the accepted ones and one more); logprobs[i]: a Logprob|None per new token.
    prompt_logprobs: new prompt-logprob entries of the requests collecting them, in order.
    pooler_output: this step's share of each embedding request's pooled hidden state (engine.worker.pooler).
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Logprob | None]] = field(default_factory=list)
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)
