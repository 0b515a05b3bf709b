"""Continuous (iteration-level) batching in vLLM v1's style.

There are no prefill and decode phases: every request has `num_computed_tokens`, and each step
gives tokens to requests so they catch up with their `num_tokens`, under one token budget. Running
requests go first (their decode token, or the next chunk of a long prompt), then waiting requests
are admitted in FCFS order, their prompts chunked to the budget left. When the KV cache runs out of
blocks, the newest running request is preempted by recompute: its blocks are freed and it goes back
to the front of the waiting queue (Orca, Yu et al. OSDI 2022; vLLM, Kwon et al. SOSP 2023).
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

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, on_free=None):
        self.kv = kv
        self.on_free = on_free  # called with each request whose blocks are freed (a draft model's KV goes too)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of requests admitted for the first time

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
            hits, num_hit_tokens = ([], 0) if req.skip_reading_prefix_cache else self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = req.metrics.num_cached_tokens = num_hit_tokens
                req.metrics.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens += req.num_prompt_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(req)
            counts.append(n)
            budget -= n
        for req, n in zip(scheduled, counts):
            del req.spec_token_ids[max(0, req.num_computed_tokens + n - req.num_tokens):]
        self.waiting.extendleft(reversed(compiling))
        return SchedulerOutput(scheduled, counts)

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
        """Removes a request (finished, aborted or failed) and frees its blocks at once."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req, uncache=uncache)
        if self.on_free is not None:
            self.on_free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
