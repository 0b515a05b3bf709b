"""One sequence being generated: its tokens, progress, sampling state and detokenizer."""
import enum
import time

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import Logprob, RequestMetrics
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prompt's K/V is being pulled from a prefill server
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """A sequence: prompt + generated tokens, and how many of them have K/V in the cache.

    vLLM v1's model: there are no prefill or decode phases; each step the scheduler gives the request
    up to `num_tokens - num_computed_tokens` tokens, and when it has caught up a new token is sampled.
    With n > 1 the engine makes n Requests (`index` 0..n-1) that share `parent_id` and the prompt's
    KV blocks through the prefix cache.
    """

    def __init__(self, request_id: str, parent_id: str, index: int, prompt: str | None,
                 prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer, eos_token_ids: frozenset[int], arrival_time: float,
                 grammar=None, pooling: str | None = None):
        self.request_id, self.parent_id, self.index = request_id, parent_id, index
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.params = params
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first admission; -1 until admitted
        self.num_external_computed_tokens = 0  # prompt tokens whose K/V was pulled from a prefill server
        # vLLM's kv_transfer_params: what the client sent; once finished, what goes back to it (see
        # engine.kv_transfer; None unless its blocks wait for a remote decode)
        self.kv_transfer_params: dict | None = (params.extra_args or {}).get("kv_transfer_params")
        self.block_hashes: list[int] = []
        # speculative decoding: draft tokens to verify after the last token in the next step, and the
        # distributions q [len, vocab] they were drawn from (None: one-hot, as n-gram drafts)
        self.spec_token_ids: list[int] = []
        self.spec_token_probs = None
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.detokenizer = detokenizer
        self.logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
        # filled by the model runner as the prompt is computed (engine.sample.prompt_logprobs); sample 0 only
        self.prompt_logprobs: list[Logprob | None] | None = \
            [None] if params.prompt_logprobs is not None and index == 0 else None
        self.cumulative_logprob = 0.0
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.grammar = grammar  # structured outputs (engine.structured.RequestGrammar): advanced with every token
        # an embedding request: its pooling type (engine.config.PoolerConfig), and the float32 [hidden]
        # state pooled so far (engine.worker.pooler)
        self.pooling, self.pooled = pooling, None
        self.generator = None
        if params.seed is not None:
            # index keeps the n samples of one seeded request apart while each stays reproducible
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True while prompt logprobs are being collected, and for mean-pooled embeddings: their
        positions' hidden states must be computed (the last prompt token always is)."""
        return (self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens) \
            or self.pooling == "MEAN"

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int, logprob: Logprob | None, max_model_len: int) -> None:
        """Adds a sampled token, detokenizes it and sets `finish_reason` / `stop_reason` if it ends
        the request: EOS or a stop token ("stop"; not shown as text unless
        include_stop_str_in_output), a stop string ("stop"), max_tokens or max_model_len ("length").
        No stop applies before min_tokens, except the end of the request's grammar ("stop")."""
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob.logprob
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.metrics.num_generation_tokens += 1

        p, n_out = self.params, len(self.output_token_ids)
        may_stop = n_out >= p.min_tokens
        if may_stop and token_id in self.eos_token_ids:
            self.finish_reason = "stop"
        elif may_stop and token_id in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        # A grammar ends with its stop token; it rejects a token only when min_tokens banned that stop
        # token and nothing else was allowed: the structure is complete either way.
        if self.grammar is not None and (self.grammar.accept_tokens([token_id]) == 0 or self.grammar.is_terminated):
            self.finish_reason = self.finish_reason or "stop"
        if self.finish_reason is None or p.include_stop_str_in_output:
            self.detokenizer.update(token_id, check_stop=may_stop)
            if self.finish_reason is None and self.detokenizer.stop_string is not None:
                self.finish_reason, self.stop_reason = "stop", self.detokenizer.stop_string
        if self.finish_reason is None and (
                (p.max_tokens is not None and n_out >= p.max_tokens) or self.num_tokens >= max_model_len):
            self.finish_reason = "length"
