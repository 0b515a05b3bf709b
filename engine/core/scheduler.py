"""Continuous (iteration-level) batching in vLLM v1's style.

There are no prefill and decode phases: every request has `num_computed_tokens`, and each step gives
tokens to requests so they catch up with their `num_tokens`, under one token budget. Running requests go
first (their decode token, or the next chunk of a long prompt), then waiting requests are admitted in
FCFS order, their prompts chunked to the budget left. When the KV cache runs out of blocks, the newest
running request is preempted by recompute: its blocks are freed and it goes back to the front of the
waiting queue (Orca, Yu et al. OSDI 2022; vLLM, Kwon et al. SOSP 2023).

With a KV connector (engine.kv_transfer), a waiting request whose prompt K/V comes from a prefill server
gets its blocks, waits off the queue while they are pulled, and comes back to the front of the queue with
its prompt computed but the last token: from there it runs like a prefix-cache hit. Without one the
connector is `NoKVConnector`, which never matches a token.

With speculative decoding a running request also asks for its draft tokens (`spec_token_ids`), under the
same budget; the drafts that do not fit are dropped. A draft model also needs `num_lookahead_tokens` slots
past them, where it writes the K/V of its next proposals.

With pipeline parallelism up to `max_concurrent_batches` steps are in flight at once (vLLM v1's batch queue,
EngineCore.step_with_batch_queue): a request in a step whose output has not come back (`in_flight`) is not
scheduled again, nor preempted, and each step takes at most max_num_seqs / max_concurrent_batches requests,
so that the running requests split into batches that fill the stages in turn.
"""

import time
from collections import deque

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request, RequestStatus
from engine.core.step_io import ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.outputs import SpecDecodingStats


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes, and applies what the step
    computed (`update_from_output`): the one place, with the KV manager, where requests change.

    max_num_seqs: running requests at most; max_num_batched_tokens: tokens per step at most; max_model_len:
    tokens per sequence at most. connector: the KV connector (engine.kv_transfer: a NixlConnector, or
    NoKVConnector). num_speculative_tokens: drafts per request and step at most (0: no speculative decoding;
    otherwise the scheduler keeps vLLM's SpecDecodingStats); num_lookahead_tokens: slots allocated past each
    step's tokens for a draft model's proposals.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        connector,
        num_speculative_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        max_concurrent_batches: int = 1,
    ):
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.connector = connector
        self.num_lookahead_tokens = num_lookahead_tokens
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: set[str] = set()  # requests of steps whose output has not come back (when pipelining)
        self.pipelined = max_concurrent_batches > 1
        self.max_batch_seqs = -(-max_num_seqs // max_concurrent_batches)  # requests per step
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of requests admitted for the first time
        # of those, by where their K/V came from (vLLM's vllm:prompt_tokens_by_source), and how many cached
        # ones were computed again because the last prompt token always is
        self.prompt_tokens_by_source = dict.fromkeys(("local_compute", "local_cache_hit", "external_kv_transfer"), 0)
        self.num_prompt_tokens_recomputed = 0
        self.num_generation_tokens = 0  # tokens sampled
        self.spec_decoding_stats = SpecDecodingStats(num_speculative_tokens) if num_speculative_tokens else None
        self._finished_req_ids: set[str] = set()  # since the last schedule, for the workers
        self._finished: list[Request] = []  # since the last pop_finished, for the dashboard

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """This step's batch: the running pass, then (unless it had to preempt) the admission pass; every
        scheduled token gets its KV slot, drafts that did not fit are trimmed, and the batch is described
        for the workers."""
        budget = self.max_num_batched_tokens
        scheduled, new_blocks, preempted = self._schedule_running(budget)
        budget -= sum(n for _, n in scheduled)
        # New requests only when nothing had to be preempted, so a freed block is not handed straight to a
        # newcomer while older requests wait (FCFS).
        admitted = [] if preempted else self._schedule_waiting(budget, self.max_batch_seqs - len(scheduled))
        for req, n in scheduled + admitted:
            del req.spec_token_ids[max(0, req.num_computed_tokens + n - req.num_tokens) :]
        return self._describe(scheduled, new_blocks, admitted)

    def _schedule_running(
        self, budget: int
    ) -> tuple[list[tuple[Request, int]], dict[str, tuple[list[int], ...]], bool]:
        """The running pass: each running request in order (but those in flight) gets its remaining tokens
        (drafts included) within the budget; while blocks run out, the newest running request not in flight
        is preempted. Returns the scheduled (request, tokens), each one's newly allocated block ids (per group), and
        whether any was preempted."""
        scheduled, new_blocks, preempted = [], {}, False
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < self.max_batch_seqs:
            req = self.running[i]
            if req.request_id in self.in_flight:
                i += 1
                continue
            n = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, budget)
            before = self.kv.table_lengths(req.request_id)
            while not self.kv.allocate_slots(req, n, num_lookahead_tokens=self.num_lookahead_tokens):
                # the newest one at or after req that is not in flight (req itself at worst)
                victim = next(r for r in reversed(self.running) if r.request_id not in self.in_flight)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:  # nothing below it can run either
                    return scheduled, new_blocks, preempted
            scheduled.append((req, n))
            new_blocks[req.request_id] = self.kv.block_ids(req.request_id, before)
            budget -= n
            i += 1
        return scheduled, new_blocks, preempted

    def _schedule_waiting(self, budget: int, room: int) -> list[tuple[Request, int]]:
        """The admission pass: waiting requests in FCFS order while the budget, max_num_seqs, the step's
        `room` for more requests and the free blocks allow, each after its prefix-cache hit (or its pulled
        K/V), its prompt chunked to the budget left. A request whose prompt K/V is to be pulled leaves the
        queue until it has arrived."""
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(admitted) < room:
            req = self.waiting[0]
            if self.kv.req_blocks.get(req.request_id):  # back from a KV pull, its blocks allocated
                hits, num_hit_tokens = None, req.num_computed_tokens
            else:
                hits, num_hit_tokens = (None, 0) if req.skip_reading_prefix_cache else self.kv.get_computed_blocks(req)
                num_external = self.connector.get_num_new_matched_tokens(req, num_hit_tokens)
                if num_external:
                    if not self._start_load(req, hits, num_external):
                        break
                    continue
            n = min(req.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(req, n, hits, num_lookahead_tokens=self.num_lookahead_tokens):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.num_cached_tokens = num_hit_tokens
                req.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens += req.num_prompt_tokens
                self._count_prompt_sources(req)
            self.running.append(req)
            admitted.append((req, n))
            budget -= n
        return admitted

    def _start_load(self, req: Request, hits: tuple[list, ...] | None, num_external: int) -> bool:
        """Allocates the blocks a remote prefill's K/V is pulled into and starts the pull; the request waits
        off the queue until it arrives. False (nothing changed) when the blocks are not free."""
        if not self.kv.allocate_slots(req, num_external, hits, delay_cache=True):
            return False
        self.waiting.popleft()
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_external_computed_tokens = num_external
        # KV transfer runs only with one KV cache group (full attention everywhere)
        self.connector.start_load(req, self.kv.block_ids(req.request_id)[0][len(hits[0]) if hits else 0 :])
        req.kv_transfer_params = None  # used up: if preempted later, it recomputes like any request
        return True

    def _describe(
        self,
        scheduled: list[tuple[Request, int]],
        new_blocks: dict[str, tuple[list[int], ...]],
        admitted: list[tuple[Request, int]],
    ) -> SchedulerOutput:
        """The step as the workers see it: new requests whole, the others as what changed since they last
        ran (sampled tokens, blocks, computed count; resumed ones with all their blocks)."""
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        cached = out.scheduled_cached_reqs
        for req, n in scheduled + admitted:
            resumed = req.status == RequestStatus.PREEMPTED
            if req.status == RequestStatus.WAITING:  # never sent: new, or back from a KV pull
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        req.request_id,
                        req.prompt_token_ids,
                        req.params,
                        req.eos_token_ids,
                        self.kv.block_ids(req.request_id),
                        req.num_computed_tokens,
                        req.pooling,
                    )
                )
            else:
                cached.req_ids.append(req.request_id)
                cached.resumed_from_preemption.append(resumed)
                cached.new_token_ids.append(req.output_token_ids[req.num_output_tokens_sent :])
                cached.new_block_ids.append(
                    self.kv.block_ids(req.request_id) if resumed else new_blocks[req.request_id]
                )
                cached.num_computed_tokens.append(req.num_computed_tokens)
            req.num_output_tokens_sent = len(req.output_token_ids)
            req.status = RequestStatus.RUNNING
            if self.pipelined:
                self.in_flight.add(req.request_id)
            out.num_scheduled_tokens[req.request_id] = n
            if req.spec_token_ids:
                out.scheduled_spec_decode_tokens[req.request_id] = list(req.spec_token_ids)
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Applies one step's results; returns an EngineCoreOutput for each request that changed.

        Every scheduled request advances by its scheduled tokens; a prompt-only request (max_tokens 0)
        finishes once its prompt is computed; prompt logprobs and embeddings are passed on. A request that
        sampled rolls back its rejected draft tokens (their K/V slots are simply overwritten by later steps),
        then takes its new tokens one by one with the stop checks (tokens after a stop are dropped). The
        drafts the runner proposed become the next step's `spec_token_ids`.
        """
        outputs: dict[str, tuple[Request, EngineCoreOutput]] = {}

        def output(req: Request) -> EngineCoreOutput:
            return outputs.setdefault(req.request_id, (req, EngineCoreOutput(req.request_id)))[1]

        self.in_flight.difference_update(scheduler_output.num_scheduled_tokens)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None:  # finished while the step ran
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_prompt_tokens:
                req.prompt_logprobs_pending = False
            if req_id in runner_output.prompt_logprobs:
                output(req).new_prompt_logprobs = runner_output.prompt_logprobs[req_id]
            if req_id in runner_output.pooler_output:
                output(req).pooling_output = runner_output.pooler_output[req_id]
            if req.params.max_tokens == 0 and req.num_computed_tokens >= req.num_tokens:
                self.finish(req, "length")
                output(req)
        now = time.monotonic()
        for req_id, new_tokens, new_logprobs in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, runner_output.logprobs
        ):
            req = self.requests.get(req_id)
            if req is None:
                continue
            req.first_token_time, req.last_token_time = req.first_token_time or now, now
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())
            req.num_computed_tokens -= len(drafts) + 1 - len(new_tokens)
            if drafts and self.spec_decoding_stats is not None:
                self.spec_decoding_stats.observe_draft(len(drafts), len(new_tokens) - 1)
            req.spec_token_ids = []
            out = output(req)
            for token, logprob in zip(new_tokens, new_logprobs):
                req.append_output_token(token, self.max_model_len)
                out.new_token_ids.append(token)
                out.new_logprobs.append(logprob)
                self.num_generation_tokens += 1
                if req.finish_reason is not None:
                    self.finish(req, req.finish_reason)
                    break
        for req_id, drafts in runner_output.draft_token_ids.items():
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.spec_token_ids = list(drafts)
        for req, out in outputs.values():
            out.finish_reason, out.stop_reason = req.finish_reason, req.stop_reason
            out.kv_transfer_params = req.kv_transfer_params if req.is_finished else None
            out.num_cached_tokens = max(req.num_cached_tokens, 0)
            out.first_scheduled_time, out.num_preemptions = req.first_scheduled_time, req.num_preemptions
        return [out for _, out in outputs.values()]

    def _count_prompt_sources(self, req: Request) -> None:
        # vLLM's accounting (PromptTokenStats): a fully cached prompt still computes its last token
        cached, external, total = req.num_cached_tokens, req.num_external_computed_tokens, req.num_prompt_tokens
        recomputed = int(cached + 1 == total)
        self.prompt_tokens_by_source["local_compute"] += total - cached
        self.prompt_tokens_by_source["local_cache_hit"] += cached + recomputed - external
        self.prompt_tokens_by_source["external_kv_transfer"] += external
        self.num_prompt_tokens_recomputed += recomputed

    def update_from_kv_connector(self) -> list[tuple[Request, str]]:
        """Applies the connector's news: requests whose K/V arrived go back to the front of the queue with
        all prompt tokens but the last computed; released blocks are freed; requests whose pull failed are
        finished ("abort") and their blocks freed. Returns those with the reason."""
        out = self.connector.poll()
        for req in reversed(out.loaded):
            req.num_computed_tokens = req.num_prompt_tokens - 1
            self.kv.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        for req in out.released:
            self.kv.free(req)
        for req, _ in out.failed:
            self.kv.free(req, uncache=True)
            req.status, req.finish_reason = RequestStatus.FINISHED, "abort"
            self.requests.pop(req.request_id, None)
            self._finished.append(req)
        return out.failed

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        req.num_preemptions += 1

    def finish_requests(self, request_ids, reason: str, uncache: bool = False) -> None:
        """Finishes the unfinished requests among `request_ids` (aborted, failed, or stopped by a stop
        string, which only the output processor sees) and frees their blocks."""
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                self.finish(req, reason, uncache)

    def finish(self, req: Request, reason: str, uncache: bool = False) -> None:
        """Removes a request (finished, aborted or failed) and frees its blocks at once, unless the KV
        connector keeps them (for a remote decode, or while a pull into them is in flight)."""
        free = True
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            free = self.connector.abort_load(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason = req.finish_reason or reason
        # KV transfer runs only with one KV cache group
        params = self.connector.request_finished(req, self.kv.block_ids(req.request_id)[0])
        if free and params is None:
            self.kv.free(req, uncache=uncache)
        req.kv_transfer_params = params
        req.spec_token_ids = []
        req.status = RequestStatus.FINISHED
        self.in_flight.discard(req.request_id)
        self.requests.pop(req.request_id, None)
        self._finished_req_ids.add(req.request_id)
        self._finished.append(req)

    def finished_req_ids_unsent(self, request_ids: set[str]) -> None:
        """Finished requests whose SchedulerOutput may not have reached the workers (its step failed): they
        go with the next one again (dropping a request twice is harmless)."""
        self._finished_req_ids |= request_ids

    def pop_finished(self) -> list[Request]:
        """The requests finished since the last call."""
        finished, self._finished = self._finished, []
        return finished
