"""Continuous (iteration-level) batching in vLLM v1's style.

There are no prefill and decode phases: every request has `num_computed_tokens`, and each step
gives tokens to requests so they catch up with their `num_tokens`, under one token budget. Running
requests go first (their decode token, or the next chunk of a long prompt), then waiting requests
are admitted in FCFS order, their prompts chunked to the budget left. When the KV cache runs out of
blocks, the newest running request is preempted by recompute: its blocks are freed and it goes back
to the front of the waiting queue (Orca, Yu et al. OSDI 2022; vLLM, Kwon et al. SOSP 2023).

With a KV connector (engine.kv_transfer), a waiting request whose prompt K/V comes from a prefill
server gets its blocks, waits off the queue while they are pulled, and comes back to the front of
the queue with its prompt computed but the last token: from there it runs like a prefix-cache hit.

With speculative decoding a running request also asks for its draft tokens (`spec_token_ids`),
under the same budget; the drafts that do not fit are dropped.
"""
import time
from collections import deque

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.step_io import ModelRunnerOutput, SchedulerOutput


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes, and applies what the
    step computed (`update_from_output`): the one place, with the KV manager, where requests change.

    max_num_seqs: running requests at most; max_num_batched_tokens: tokens per step at most;
    max_model_len: tokens per sequence at most. connector: the KV connector (engine.kv_transfer) or
    None. on_free: called with each request whose blocks are freed (a draft model's KV goes too).
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 connector=None, on_free=None):
        self.kv = kv
        self.max_model_len = max_model_len
        self.on_free = on_free
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.connector = connector  # an engine.kv_transfer.NixlConnector, or None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of requests admitted for the first time
        # of those, by where their K/V came from (vLLM's vllm:prompt_tokens_by_source), and how many
        # cached ones were computed again because the last prompt token always is
        self.prompt_tokens_by_source = dict.fromkeys(("local_compute", "local_cache_hit", "external_kv_transfer"), 0)
        self.num_prompt_tokens_recomputed = 0
        self.num_generation_tokens = 0  # tokens sampled
        self._finished_req_ids: list[str] = []  # since the last schedule

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """This step's batch: running requests first (each its remaining tokens, drafts included, within
        the token budget; the newest preempted while blocks run out), then waiting ones in FCFS order
        (prefix-cache hits and pulled K/V skipped, the prompt chunked to the budget left), while no
        request was preempted and max_num_seqs allows. Allocates every scheduled token's KV slots and
        trims drafts that did not fit.
        """
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens + len(req.spec_token_ids) - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append(req)
                counts.append(n)
                budget -= n
                i += 1
                continue
            break  # `req` itself was preempted: nothing below it can run either
        num_running = len(scheduled)
        # New requests only when nothing had to be preempted, so a freed block is not handed straight
        # to a newcomer while older requests wait (FCFS).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self.kv.req_blocks.get(req.request_id):  # back from a KV pull, its blocks allocated
                hits, num_hit_tokens = [], req.num_computed_tokens
            else:
                hits, num_hit_tokens = ([], 0) if req.skip_reading_prefix_cache else self.kv.get_computed_blocks(req)
                num_external = self.connector.get_num_new_matched_tokens(req, num_hit_tokens) if self.connector else 0
                if num_external:
                    if not self.kv.allocate_slots(req, num_external, hits, delay_cache=True):
                        break
                    self.waiting.popleft()
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    req.num_external_computed_tokens = num_external
                    self.connector.start_load(req, self.kv.block_ids(req.request_id)[len(hits):])
                    req.kv_transfer_params = None  # used up: if preempted later, it recomputes like any request
                    continue
            n = min(req.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.metrics.num_cached_tokens = num_hit_tokens
                req.metrics.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens += req.num_prompt_tokens
                self._count_prompt_sources(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)
            counts.append(n)
            budget -= n
        for req, n in zip(scheduled, counts):
            del req.spec_token_ids[max(0, req.num_computed_tokens + n - req.num_tokens):]
        finished, self._finished_req_ids = self._finished_req_ids, []
        return SchedulerOutput(scheduled, counts, [self.kv.block_ids(r.request_id) for r in scheduled],
                               num_new_requests=len(scheduled) - num_running, finished_req_ids=finished,
                               scheduled_spec_decode_tokens={r.request_id: list(r.spec_token_ids)
                                                             for r in scheduled if r.spec_token_ids})

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Applies one step's results; returns the requests that changed (new tokens, or finished).

        Every scheduled request advances by its scheduled tokens; a prompt-only request (max_tokens 0)
        finishes once its prompt is computed; prompt logprobs and pooled hidden states are added. A request that sampled rolls
        back its rejected draft tokens (their K/V slots are simply overwritten by later steps), then
        takes its new tokens one by one with the usual stop checks (tokens after a stop are dropped).
        """
        changed = []
        for req, n in zip(scheduler_output.requests, scheduler_output.num_new_tokens):
            req.num_computed_tokens += n
            if req.request_id in runner_output.prompt_logprobs:
                req.prompt_logprobs.extend(runner_output.prompt_logprobs[req.request_id])
            if req.request_id in runner_output.pooler_output:
                share = runner_output.pooler_output[req.request_id]
                req.pooled = share if req.pooled is None or req.pooling == "LAST" else req.pooled + share
            if req.params.max_tokens == 0 and req.num_computed_tokens == req.num_tokens:
                self.finish(req, "length")
                changed.append(req)
        by_id = {r.request_id: r for r in scheduler_output.requests}
        for req_id, new_tokens, new_logprobs in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                                   runner_output.logprobs):
            req = by_id[req_id]
            req.num_computed_tokens -= len(req.spec_token_ids) + 1 - len(new_tokens)
            req.spec_token_ids, req.spec_token_probs = [], None
            for token, logprob in zip(new_tokens, new_logprobs):
                req.append_token(token, logprob, self.max_model_len)
                self.num_generation_tokens += 1
                if req.finish_reason is not None:
                    self.finish(req, req.finish_reason)
                    break
            changed.append(req)
        return changed

    def update_draft_token_ids(self, drafts: dict[str, tuple[list[int], object]]) -> None:
        """Sets the draft tokens (and the distributions q they were drawn from, None for one-hot) that
        running requests verify in their next step (vLLM's name)."""
        for req in self.running:
            if req.request_id in drafts:
                req.spec_token_ids, req.spec_token_probs = drafts[req.request_id]

    def _count_prompt_sources(self, req: Request) -> None:
        # vLLM's accounting (PromptTokenStats): a fully cached prompt still computes its last token
        cached, external, total = req.num_cached_tokens, req.num_external_computed_tokens, req.num_prompt_tokens
        recomputed = int(cached + 1 == total)
        self.prompt_tokens_by_source["local_compute"] += total - cached
        self.prompt_tokens_by_source["local_cache_hit"] += cached + recomputed - external
        self.prompt_tokens_by_source["external_kv_transfer"] += external
        self.num_prompt_tokens_recomputed += recomputed

    def update_from_kv_connector(self) -> list[tuple[Request, str]]:
        """Applies the connector's news: requests whose K/V arrived go back to the front of the queue
        with all prompt tokens but the last computed; released blocks are freed; requests whose pull
        failed are finished and their blocks freed. Returns those with the reason (none without a
        connector)."""
        if self.connector is None:
            return []
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
        return out.failed

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        if self.on_free is not None:
            self.on_free(req)
        req.spec_token_ids, req.spec_token_probs = [], None
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        req.metrics.num_preemptions += 1

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
        params = self.connector.request_finished(req, self.kv.block_ids(req.request_id)) if self.connector else None
        if free and params is None:
            self.kv.free(req, uncache=uncache)
        if self.on_free is not None:
            self.on_free(req)
        req.kv_transfer_params = params
        req.spec_token_ids, req.spec_token_probs = [], None
        req.status = RequestStatus.FINISHED
        self._finished_req_ids.append(req.request_id)
