"""What the dashboard shows of the engine: the scheduler's requests and every KV block, read between
steps from the engine's own structures, and a ring buffer of recent steps.

`EngineCore.step` records each step in a `StepLog` (a few additions per step). The asyncio step loop
(`AsyncEngine._run`) offers a `SnapshotSlot` the moment between two steps; the slot takes a snapshot
only while a dashboard reads it, at most `max_rate` times per second and never so often that
snapshotting takes more than `max_overhead` of the time (a 100k-block pool costs milliseconds), and
keeps only the latest one. Readers poll the slot, so a slow reader skips snapshots instead of slowing
the engine, and nothing on the hot path takes a lock.
"""

import base64
import itertools
import time
from collections import deque
from operator import attrgetter

import numpy as np

from engine.core.request import Request, RequestStatus
from engine.core.step_io import SchedulerOutput

# Per-block states in `kv.state`: free (no hash), cached (free, hash kept: a prefix-cache entry that
# allocation may evict), in use by one request, shared (ref count > 1: prefix hits, n > 1 samples).
FREE, CACHED, USED, SHARED = 0, 1, 2, 3
FINISHED_SHOWN_S = 5.0  # finished requests stay in snapshots this long (the page fades them out)
_block_id = attrgetter("block_id")


class StepLog:
    """The last `capacity` engine steps and the requests that finished in them.

    steps: (end time, prefill tokens, decode tokens, step seconds, preemptions) per step; a decode
    token is the one token of a request past its prompt, everything else (prompt chunks, recomputation
    after a preemption) counts as prefill. finished: (end time, request) of requests that finished.
    """

    def __init__(self, capacity: int = 300):
        self.steps: deque[tuple[float, int, int, float, int]] = deque(maxlen=capacity)
        self.finished: deque[tuple[float, Request]] = deque(maxlen=256)
        self._preemptions = 0

    def record(self, batch: SchedulerOutput, requests: dict[str, Request], start: float, num_preemptions: int) -> None:
        """Records a step that began at `start` (time.monotonic()) and whose model step just ended; call
        before its requests' `num_computed_tokens` advance. `requests`: the scheduler's, by id;
        `num_preemptions`: the scheduler's running total."""
        end = time.monotonic()
        prefill = decode = 0
        for req_id, n in batch.num_scheduled_tokens.items():
            req = requests[req_id]
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                decode += 1
            else:
                prefill += n
        self.steps.append((end, prefill, decode, end - start, num_preemptions - self._preemptions))
        self._preemptions = num_preemptions

    def record_finished(self, requests: list[Request]) -> None:
        """Records requests that just finished."""
        now = time.monotonic()
        self.finished.extend((now, req) for req in requests)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode()


class Snapshotter:
    """Builds snapshots of one `LLMEngine`; call `take()` only between steps.

    It remembers the hash-chain position of every block it saw held by a request, so that a cached
    block whose holders are gone still shows its position while it keeps the same hash.
    """

    def __init__(self, engine):
        self.engine = engine
        n = engine.engine_core.kv.num_blocks
        max_pos = -(-engine.max_model_len // engine.engine_core.kv.block_size)
        self._pos_dtype = np.uint16 if max_pos < np.iinfo(np.uint16).max else np.uint32
        self._unknown = np.iinfo(self._pos_dtype).max
        self._seen_pos = np.full(n, self._unknown, self._pos_dtype)
        self._seen_hash = np.zeros(n, np.int64)
        self._seen_valid = np.zeros(n, bool)

    def take(self) -> dict:
        """The engine now, as JSON-ready data (times in seconds, sizes in tokens and blocks):

        requests: running then waiting requests, each with its kind ("generate", or "embed" for an
            embedding request), state ("prefilling", "decoding", "waiting", "preempted"), token counts,
            latencies and block table (`blocks`, block ids in hash-chain order); finished: requests finished
            in the last few seconds.
        kv: block counts by state, and per block `state` (uint8, FREE/CACHED/USED/SHARED) and `pos`
            (its hash-chain position, `pos_unknown` if not known), little-endian arrays in base64.
        steps: the step log as columns (`end`: time.monotonic() at each step's end, like `time`).
        """
        eng = self.engine
        core = eng.engine_core
        sched, kv = core.scheduler, core.kv
        now = time.monotonic()
        n = kv.num_blocks
        # every block table as one array (a pool can hold 100k+ blocks: no Python loop per block)
        reqs = list(itertools.chain(sched.running, sched.waiting))
        tables = [kv.held_blocks(req.request_id) for req in reqs]  # its groups' tables one after another
        lengths = np.fromiter(map(len, tables), np.int64, len(tables))
        ids = np.fromiter(itertools.chain.from_iterable(map(_block_id, t) for t in tables), np.int64, lengths.sum())
        starts = np.cumsum(lengths) - lengths
        refs = np.bincount(ids, minlength=n)  # a request holds each of its blocks once
        pos = np.full(n, self._unknown, self._pos_dtype)
        pos[ids] = np.arange(len(ids)) - np.repeat(starts, lengths)
        rows = [self._row(req, ids[s : s + k].tolist(), now) for req, s, k in zip(reqs, starts, lengths)]
        finished = [
            dict(self._row(req, [], now), state="finished", reason=req.finish_reason, age=now - t)
            for t, req in core.step_log.finished
            if now - t < FINISHED_SHOWN_S
        ]

        # blocks registered in the prefix cache: the ones no request holds are evictable
        cached = kv.pool.cached
        cached_ids = np.fromiter(map(_block_id, cached.values()), np.int64, len(cached))
        cached_hash = np.fromiter(cached.keys(), np.int64, len(cached))
        free_cached = cached_ids[refs[cached_ids] == 0]
        state = np.where(refs > 1, SHARED, np.where(refs == 1, USED, FREE)).astype(np.uint8)
        state[free_cached] = CACHED
        # chain positions: remember those of held blocks with their hash, recall them for cached ones
        held = np.flatnonzero(refs)
        hashes = np.zeros(n, np.int64)
        hashes[cached_ids] = cached_hash
        is_cached = np.zeros(n, bool)
        is_cached[cached_ids] = True
        self._seen_pos[held], self._seen_hash[held], self._seen_valid[held] = pos[held], hashes[held], is_cached[held]
        known = free_cached[self._seen_valid[free_cached] & (self._seen_hash[free_cached] == hashes[free_cached])]
        pos[known] = self._seen_pos[known]

        counts = np.bincount(state, minlength=4)
        steps = list(core.step_log.steps)
        return {
            "time": now,
            "config": {
                "max_num_seqs": sched.max_num_seqs,
                "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_model_len": eng.max_model_len,
            },
            "requests": rows,
            "finished": finished,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_preemptions": sched.num_preemptions,
            "kv": {
                "num_blocks": n,
                "block_size": kv.block_size,
                "usage": kv.usage,
                "free": int(counts[FREE]),
                "cached": int(counts[CACHED]),
                "used": int(counts[USED]),
                "shared": int(counts[SHARED]),
                "state": _b64(state),
                "pos": _b64(pos.astype(pos.dtype.newbyteorder("<"))),
                "pos_bytes": pos.itemsize,
                "pos_unknown": int(self._unknown),
            },
            "steps": {
                "end": [s[0] for s in steps],
                "prefill": [s[1] for s in steps],
                "decode": [s[2] for s in steps],
                "seconds": [s[3] for s in steps],
                "preemptions": [s[4] for s in steps],
            },
        }

    def _row(self, req: Request, block_ids: list[int], now: float) -> dict:
        num_out = len(req.output_token_ids)
        chunk = None
        if req.status is RequestStatus.PREEMPTED:
            state = "preempted"
        elif req.status is RequestStatus.WAITING:
            state = "waiting"
        elif num_out and req.num_tokens - req.num_computed_tokens == 1:
            state = "decoding"
        else:
            state = "prefilling"
            # chunks of the full token budget from where this pass started (the cache hit of the
            # first admission; 0 after a preemption, whose hit is not recorded)
            budget = self.engine.engine_core.scheduler.max_num_batched_tokens
            start = max(req.num_cached_tokens, 0) if not req.num_preemptions else 0
            total = max(1, -(-(req.num_tokens - start) // budget))
            chunk = [min(total, max(0, req.num_computed_tokens - start) // budget + 1), total]
        decode_s = (req.last_token_time or 0.0) - (req.first_token_time or 0.0)
        return {
            "id": req.request_id,
            "kind": "embed" if req.pooling else "generate",
            "state": state,
            "chunk": chunk,
            "prompt": req.num_prompt_tokens,
            "computed": min(req.num_computed_tokens, req.num_prompt_tokens),
            "cached": max(req.num_cached_tokens, 0),
            "output": num_out,
            "max_tokens": req.params.max_tokens,
            "queue": (req.first_scheduled_time or now) - req.arrival_time,
            "ttft": req.first_token_time - req.arrival_time if req.first_token_time is not None else None,
            "tokens_per_s": (num_out - 1) / decode_s if num_out > 1 and decode_s > 0 else None,
            "preemptions": req.num_preemptions,
            "blocks": block_ids,
        }


class SnapshotSlot:
    """The latest snapshot of an engine, for any number of readers (dashboards).

    The step loop calls `offer()` between steps and, when idle, waits at most `next_due()` seconds;
    readers register with `add_reader`/`remove_reader` and poll `seq` / `latest`. Snapshots are taken
    only while a reader is registered, at most `max_rate` per second, and spaced so that taking them
    costs at most `max_overhead` of the wall time; the engine's return to idle is always published.
    """

    def __init__(self, engine, max_rate: float = 5.0, max_overhead: float = 0.01):
        self._engine = engine
        self._snapshotter = Snapshotter(engine)
        self.min_interval, self.max_overhead = 1.0 / max_rate, max_overhead
        self.readers = 0
        self.seq = 0  # incremented with every snapshot
        self.latest: dict | None = None
        self.cost = 0.0  # seconds the last snapshot took
        self._next = 0.0  # time.monotonic() from which the next snapshot may be taken
        self._idle_published = False  # the latest snapshot shows the engine idle: nothing can change

    @property
    def interval(self) -> float:
        """Seconds between snapshots now: 1 / max_rate, or longer when they are costly."""
        return max(self.min_interval, self.cost / self.max_overhead)

    def add_reader(self) -> None:
        self.readers += 1
        self._next, self._idle_published = 0.0, False  # the new reader gets a snapshot at once

    def remove_reader(self) -> None:
        self.readers -= 1

    def offer(self) -> None:
        """Takes a snapshot if a reader is registered and one is due. Call only between steps."""
        if not self.readers:
            return
        idle = not self._engine.has_unfinished_requests()
        if idle and self._idle_published:
            return
        self._idle_published = False  # steps ran since: the engine changed
        start = time.monotonic()
        if start < self._next:
            return
        snapshot = self._snapshotter.take()
        self.cost = time.monotonic() - start
        snapshot["snapshot_seconds"] = self.cost
        self.latest, self.seq, self._idle_published = snapshot, self.seq + 1, idle
        self._next = start + self.interval

    def next_due(self) -> float | None:
        """Seconds until a deferred snapshot is due, or None if none is (the idle loop may sleep)."""
        if not self.readers or self._idle_published:
            return None
        return max(0.0, self._next - time.monotonic())
