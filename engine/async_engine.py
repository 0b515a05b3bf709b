"""The asyncio front of the engine: one step coroutine, per-request queues (what the server uses)."""

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Iterator

from engine.config import EngineConfig
from engine.llm_engine import EngineStepError, KVTransferError, LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.snapshot import SnapshotSlot

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "EngineStepError", "KVTransferError"]


class AsyncEngine:
    """Runs `LLMEngine.step()` in a loop on one worker thread, so the event loop stays free, and fans
    each step's outputs out to per-request `asyncio.Queue`s.

    New requests and aborts are applied by the step coroutine between steps, so the engine's state
    is only touched while no step runs; an aborted request's blocks are freed before the next step.
    """

    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.model_dir = self.engine.model_dir
        self.max_model_len = self.engine.max_model_len
        self.hidden_size = self.engine.hidden_size  # of an embedding
        self.num_kv_blocks = self.engine.num_kv_blocks
        self.block_size = config.block_size
        self.device, self.dtype = self.engine.device, self.engine.dtype
        self.details = self.engine.details  # what it serves (engine.outputs.ModelDetails)
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[tuple] = []  # ("add", id, prompt, params, arrival, token ids, pooling) / ("abort", id)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopping = False
        self.snapshots = SnapshotSlot(self.engine)

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def dead_error(self) -> str | None:
        """Why the engine can run no more steps (a tensor-parallel rank died), or None."""
        return self.engine.dead_error

    async def start(self) -> None:
        """Starts the step coroutine on the running loop (idempotent)."""
        if not self.is_alive:
            self._stopping = False
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._run(), name="engine-step-loop")

    async def shutdown(self) -> None:
        """Aborts every request (their generators end with finish_reason "abort") and stops the loop."""
        if self._task is not None:
            # let the step in flight finish: the engine must not be touched while it runs
            self._stopping = True
            self._wakeup.set()
            await self._task
        self._apply_pending()
        for rid in self.engine.request_ids():
            self._deliver(self.engine.abort_request(rid))
        self._executor.shutdown(wait=True)
        self.engine.shutdown()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, pooling: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs, one RequestOutput per step that changed it, the last with
        `finished` True. Leaving the loop early (or a client disconnect cancelling it) aborts it.
        `pooling`: an embedding request (LLMEngine.add_request); its last output has the embedding.

        Raises ValueError for bad input (before any output, including a grammar that does not compile
        in time) and EngineStepError if its step failed.
        """
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.engine.tokenize(prompt)  # now, so the caller gets the error, not the loop
        if params.structured_outputs is not None:
            await self.compile_grammar(params.structured_outputs)
        if not self.is_alive:
            raise RuntimeError("the engine loop is not running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending.append(("add", request_id, prompt, params, time.monotonic(), ids, pooling))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def compile_grammar(self, spec: StructuredOutputsParams) -> None:
        """Compiles a structured-outputs constraint on the engine's compile pool (or finds it in the cache),
        waiting `compile_timeout` seconds at most; the event loop and the step loop keep running.

        Raises ValueError: the constraint is invalid, xgrammar is missing, or the compile took too long
        (it goes on in the background and fills the cache).
        """
        structured = self.engine.structured
        future = structured.compile(spec)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), structured.config.compile_timeout)
        except TimeoutError:
            raise structured.timeout_error() from None

    @contextlib.contextmanager
    def watch(self) -> Iterator[SnapshotSlot]:
        """Registers a reader of engine snapshots (a dashboard) for the duration of the block: while
        any is registered, the step loop keeps the returned slot's `latest` snapshot fresh."""
        self.snapshots.add_reader()
        if self._wakeup is not None:
            self._wakeup.set()  # an idle loop takes the first snapshot now
        try:
            yield self.snapshots
        finally:
            self.snapshots.remove_reader()

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its blocks are freed before the next step runs."""
        self._pending.append(("abort", request_id))
        if self._wakeup is not None:
            self._wakeup.set()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            if item[0] == "add":
                _, rid, prompt, params, arrival, ids, pooling = item
                try:
                    self.engine.add_request(rid, prompt, params, arrival, ids, pooling)
                except ValueError as e:
                    self._deliver_error(rid, e)
            else:
                self._deliver(self.engine.abort_request(item[1]))

    def _deliver(self, out: RequestOutput | None) -> None:
        if out is not None and out.request_id in self._queues:
            self._queues[out.request_id].put_nowait(out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        if request_id in self._queues:
            self._queues[request_id].put_nowait(error)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._apply_pending()
            self.snapshots.offer()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                poll = self.engine.kv_poll_interval()  # KV transfers in flight need steps to move on
                if not self._pending:
                    # woken by a request, or when KV transfers need polling or a deferred snapshot is due
                    timeout = min((t for t in (poll, self.snapshots.next_due()) if t is not None), default=None)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), timeout)
                if poll is None:
                    continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except EngineStepError as e:
                for rid in e.request_ids:
                    self._deliver_error(rid, e)
                continue
            except Exception as e:  # a bug outside the model step: fail everyone, keep the loop alive
                logger.exception("engine step raised outside the model; aborting all requests")
                for rid in self.engine.request_ids():
                    self.engine.abort_request(rid)
                    self._deliver_error(rid, EngineStepError([rid], e))
                continue
            for out in outputs:
                self._deliver(out)
            await asyncio.sleep(0)  # let handlers run between steps
