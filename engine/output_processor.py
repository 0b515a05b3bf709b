"""Everything a request's results go through after the engine core (vLLM v1's OutputProcessor):
detokenization, stop strings, logprobs, metrics, the embedding, and the merge of an n > 1 request's samples
(ParentRequest) into the RequestOutputs the API and LLM.generate stream."""

import time

from engine.core.outputs import EngineCoreOutput
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


class RequestState:
    """One sample's output side: its tokens, text (with stop strings), logprobs, prompt logprobs and metrics.

    The engine core decides EOS, stop tokens, the grammar's end and the length limits; a stop string is only
    seen here, in the text, and ends the sample ("stop", stop_reason the string); the engine core is then
    told to finish it (OutputProcessor.process_outputs).
    """

    def __init__(
        self,
        request_id: str,
        parent_id: str,
        index: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        detokenizer: IncrementalDetokenizer,
        arrival_time: float,
    ):
        self.request_id, self.parent_id, self.index, self.params = request_id, parent_id, index, params
        self.detokenizer = detokenizer
        self.output_token_ids: list[int] = []
        self.logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # one entry per prompt token, None for the first (vLLM's), filled as the prompt is computed
        self.prompt_logprobs: list[Logprob | None] | None = [None] if params.prompt_logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.kv_transfer_params: dict | None = None
        self.embedding: list[float] | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Applies one step's news. Returns True when a stop string ended the sample here while the engine
        core still runs it (tokens after the stop string are dropped)."""
        m = self.metrics
        m.num_cached_tokens, m.first_scheduled_time, m.num_preemptions = (
            out.num_cached_tokens,
            out.first_scheduled_time,
            out.num_preemptions,
        )
        if out.new_prompt_logprobs and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(out.new_prompt_logprobs)
        if out.pooling_output is not None:
            self.embedding = out.pooling_output.tolist()
        self.kv_transfer_params = out.kv_transfer_params
        last = len(out.new_token_ids) - 1
        for i, (token, logprob) in enumerate(zip(out.new_token_ids, out.new_logprobs)):
            if self._append(token, logprob, out.finish_reason if i == last else None, out.stop_reason):
                return out.finish_reason is None
        if self.finish_reason is None and out.finish_reason is not None:  # without a new token (prompt-only)
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _append(self, token_id: int, logprob: Logprob | None, reason: str | None, stop_reason) -> bool:
        """Adds a token the engine core gave, detokenizes it and checks the stop strings; `reason`: the
        core's finish reason when this token ends the sample. A token that ended it by EOS or a stop token
        ("stop") is not shown as text unless include_stop_str_in_output; no stop string counts before
        min_tokens. Returns True when the sample finished with this token."""
        self.output_token_ids.append(token_id)
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob.logprob
        now = time.monotonic()
        m = self.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        m.num_generation_tokens += 1
        stopped_by_token = reason == "stop"
        if not stopped_by_token or self.params.include_stop_str_in_output:
            self.detokenizer.update(token_id, check_stop=len(self.output_token_ids) >= self.params.min_tokens)
            if not stopped_by_token and self.detokenizer.stop_string is not None:
                reason, stop_reason = "stop", self.detokenizer.stop_string
        if reason is not None:
            self.finish_reason, self.stop_reason = reason, stop_reason
        return reason is not None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text(self.finished),
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class ParentRequest:
    """One request as its caller sees it (vLLM's ParentRequest): the prompt and its n samples."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], samples: list[RequestState]):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.samples = samples

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)

    def output(self, changed: list[RequestState]) -> RequestOutput:
        """The RequestOutput after a step: the samples that changed (all of them on abort), the request's
        metrics (merged over the samples), its prompt logprobs once all are there, and once finished its
        kv_transfer_params and embedding."""
        first, finished = self.samples[0], self.finished
        metrics = first.metrics if len(self.samples) == 1 else RequestMetrics.merge([s.metrics for s in self.samples])
        if finished:
            metrics.finished_time = time.monotonic()
        prompt_logprobs = first.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < len(self.prompt_token_ids):
            prompt_logprobs = None  # aborted before its prompt was computed
        embedding = first.embedding if finished and first.finish_reason == "length" else None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [s.completion() for s in changed],
            finished,
            first.metrics.num_cached_tokens,
            metrics,
            prompt_logprobs,
            first.kv_transfer_params if finished else None,
            embedding,
        )


class OutputProcessor:
    """The requests' output side, by request id (`parents`) and by engine-core id (`samples`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentRequest] = {}
        self.samples: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_token_ids: list[int],
        samples: list[tuple[str, SamplingParams]],
        arrival_time: float,
    ) -> None:
        """Registers a request and its samples: (engine-core id, its params) each, in index order."""
        states = [
            RequestState(
                sample_id,
                request_id,
                i,
                p,
                prompt_token_ids,
                IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, p.stop, p.include_stop_str_in_output, p.skip_special_tokens
                ),
                arrival_time,
            )
            for i, (sample_id, p) in enumerate(samples)
        ]
        self.parents[request_id] = ParentRequest(
            request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, states
        )
        self.samples.update({s.request_id: s for s in states})

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Turns one step's EngineCoreOutputs into a RequestOutput per request that changed (finished ones
        are forgotten). Returns them and the engine-core ids of samples that a stop string ended, which the
        engine core must finish."""
        changed: dict[str, list[RequestState]] = {}
        stopped = []
        for out in outputs:
            state = self.samples.get(out.request_id)
            if state is None:
                continue
            if state.update(out):
                stopped.append(out.request_id)
            changed.setdefault(state.parent_id, []).append(state)
        return [self._output(parent_id, states) for parent_id, states in changed.items()], stopped

    def abort_request(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Finishes a request's unfinished samples ("abort"); returns its final output with all its samples
        (None if unknown) and their engine-core ids."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None, []
        ids = [s.request_id for s in parent.samples if not s.finished]
        for s in parent.samples:
            s.finish_reason = s.finish_reason or "abort"
        return self._output(request_id, parent.samples), ids

    def drop(self, request_ids: list[str]) -> tuple[list[str], list[str]]:
        """Forgets requests whose engine step failed (by engine-core id); returns their request ids and the
        engine-core ids of their other samples, still to finish."""
        parents = list(dict.fromkeys(self.samples[i].parent_id for i in request_ids if i in self.samples))
        others = []
        for parent_id in parents:
            for s in self.parents.pop(parent_id).samples:
                del self.samples[s.request_id]
                if s.request_id not in request_ids:
                    others.append(s.request_id)
        return parents, others

    def _output(self, parent_id: str, changed: list[RequestState]) -> RequestOutput:
        parent = self.parents[parent_id]
        out = parent.output(changed)
        if out.finished:
            del self.parents[parent_id]
            for s in parent.samples:
                del self.samples[s.request_id]
        return out
