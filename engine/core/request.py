"""One sequence as the scheduler sees it: its tokens, progress and the state that decides when it stops."""

import enum
import time

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prompt's K/V is being pulled from a prefill server
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """A sequence: prompt + generated tokens, and how many of them have K/V in the cache.

    vLLM v1's model: there are no prefill or decode phases; each step the scheduler gives the request up to
    `num_tokens - num_computed_tokens` tokens, and when it has caught up a new token is sampled. A request
    with n > 1 is n of these (ids "<id>#<i>", made by engine.input_processor), which share the prompt's KV
    blocks through the prefix cache. Only the scheduler changes a Request; text, logprobs and metrics are
    the output processor's (engine.output_processor).

    eos_token_ids: the ids that end it (empty with ignore_eos); grammar: its structured-outputs state
    (engine.structured.RequestGrammar), advanced by every token; pooling: an embedding request's pooling
    type, else None. Raises nothing.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        grammar=None,
        pooling: str | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids, self.params = prompt_token_ids, params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first admission; -1 until admitted
        self.num_external_computed_tokens = 0  # prompt tokens whose K/V was pulled from a prefill server
        # vLLM's kv_transfer_params: what the client sent; once finished, what goes back to it (see
        # engine.kv_transfer; None unless its blocks wait for a remote decode)
        self.kv_transfer_params: dict | None = (params.extra_args or {}).get("kv_transfer_params")
        self.block_hashes: list[int] = []
        self.spec_token_ids: list[int] = []  # draft tokens to verify after the last token in the next step
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.grammar = grammar
        self.pooling = pooling
        # prompt logprobs need every prompt position computed, so the prefix cache is not read until the
        # prompt has been computed once (as vLLM does)
        self.prompt_logprobs_pending = params.prompt_logprobs is not None
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None  # when the scheduler gave it its first / last token
        self.last_token_time: float | None = None
        self.num_preemptions = 0
        self.num_output_tokens_sent = 0  # output tokens the workers have been sent (SchedulerOutput)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True while prompt logprobs are pending, and for mean-pooled embeddings: their positions' hidden
        states must be computed (the last prompt token always is)."""
        return self.prompt_logprobs_pending or self.pooling == "MEAN"

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int, max_model_len: int) -> None:
        """Adds a sampled token and sets `finish_reason` / `stop_reason` if it ends the request (vLLM's
        check_stop): EOS or a stop token ("stop", stop_reason the token id for a stop token), the end of its
        grammar ("stop"), max_tokens or max_model_len ("length"). No EOS or stop token counts before
        min_tokens. Stop strings are the output processor's, which sees the text."""
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        p, n_out = self.params, len(self.output_token_ids)
        if n_out >= p.min_tokens:
            if token_id in self.eos_token_ids:
                self.finish_reason = "stop"
            elif token_id in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", token_id
        # A grammar ends with its stop token; it rejects a token only when min_tokens banned that stop
        # token and nothing else was allowed: the structure is complete either way.
        if self.grammar is not None and (self.grammar.accept_tokens([token_id]) == 0 or self.grammar.is_terminated):
            self.finish_reason = self.finish_reason or "stop"
        if self.finish_reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens) or self.num_tokens >= max_model_len
        ):
            self.finish_reason = "length"
