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
from dataclasses import dataclass

from engine.block_manager import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's batch: requests with their number of new tokens, in batch order (running first)."""

    requests: list[Request]
    num_new_tokens: list[int]

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes.

    max_num_seqs: running requests at most; max_num_batched_tokens: tokens per step at most.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, connector=None,
                 on_free=None):
        self.kv = kv
        self.on_free = on_free  # called with each request whose blocks are freed (a draft model's KV goes too)
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

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
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
        # New requests only when nothing had to be preempted, so a freed block is not handed straight
        # to a newcomer while older requests wait (FCFS). Requests whose grammar still compiles stay
        # waiting, in order, and do not hold up the others.
        compiling: list[Request] = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.grammar is not None and not req.grammar.ready:
                compiling.append(self.waiting.popleft())
                continue
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
        self.waiting.extendleft(reversed(compiling))
        return SchedulerOutput(scheduled, counts)

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
        failed are finished and their blocks freed. Returns those with the reason."""
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
        req.status = RequestStatus.FINISHED
