"""What crosses the scheduler/worker seam each step, as data only (vLLM v1's vllm/v1/core/sched/output.py and
vllm/v1/outputs.py).

The scheduler describes a step (`SchedulerOutput`): the requests the workers see for the first time, whole
(`NewRequestData`), and for the others only what changed since they last ran (`CachedRequestData`). The
structured-outputs hook adds the step's grammar masks (`GrammarOutput`). The executor sends both to every
rank; each rank's worker keeps its own copy of every request (engine.worker.input_batch), builds its own
inputs from it and runs the same forward; the first rank answers a `ModelRunnerOutput`, which
`Scheduler.update_from_output` applies to the requests. Everything here pickles and holds no live object.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.outputs import Logprob
from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request scheduled for the first time: what a worker keeps about it.

    prompt_token_ids: its prompt; sampling_params: its own (a sample of an n > 1 request has n 1 and its seed
    offset by its index); eos_token_ids: the token ids that end it (empty with ignore_eos); pooling: an
    embedding request's pooling type ("LAST" or "MEAN"), else None; block_ids: its KV blocks in order, one list
    per KV cache group (engine.core.kv_cache_spec);
    num_computed_tokens: tokens whose K/V is already in them (prefix-cache hits, pulled K/V).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    pooling: str | None = None


@dataclass
class CachedRequestData:
    """Requests the workers already know, as parallel lists (index i is one request).

    new_token_ids[i]: the tokens it sampled since it last ran (the workers append them); new_block_ids[i]: the
    KV blocks it was given since then in each KV cache group, or all of its blocks when
    resumed_from_preemption[i] (the workers replace its tables); num_computed_tokens[i]: tokens with K/V
    before this step (it drops when rejected draft tokens are rolled back, and to the prefix-cache hit after
    a preemption).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step.

    num_scheduled_tokens: request id -> tokens it computes this step, in batch order (those that ran in the
    last step first, then the ones admitted), draft tokens included; scheduled_spec_decode_tokens: the draft
    tokens each verifies after its last token; finished_req_ids: requests finished since the last step, whose
    state the workers drop.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class GrammarOutput:
    """The structured-outputs hook's part of a step (vLLM's GrammarOutput): grammar_bitmask, int32
    [rows, ceil(vocab / 32)], the next tokens each constrained request that samples may take (bit j of word w
    allows token 32w + j); structured_output_request_ids: request id -> its row."""

    structured_output_request_ids: dict[str, int]
    grammar_bitmask: np.ndarray


@dataclass
class ModelRunnerOutput:
    """What one step computed, by request id.

    req_ids: the requests that sampled (in batch order); sampled_token_ids[i]: their new tokens (one, or with
    drafts the accepted ones and one more); logprobs[i]: a Logprob|None per new token. prompt_logprobs: new
    prompt-logprob entries of the requests collecting them, in order. pooler_output: the embedding (float32
    [hidden], pooled and normalised) of each embedding request whose prompt this step finished.
    draft_token_ids: the tokens each request drafts for its next step (speculative decoding).
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[Logprob | None]] = field(default_factory=list)
    prompt_logprobs: dict[str, list[Logprob]] = field(default_factory=dict)
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
