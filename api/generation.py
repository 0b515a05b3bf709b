"""`Generation`: an API request's prompts running on the engine, their output streams merged; and
cancelling work when the client disconnects."""

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from api.errors import JSONResponse
from api.metrics import RequestTracker
from engine import RequestOutput, SamplingParams
from engine.outputs import FinalOutputs


class Generation:
    """The running engine requests of one API request (ids "<request_id>-<prompt index>").

    Iterate it for (prompt index, RequestOutput) pairs as the engine makes them; `aclose()` aborts
    whatever is still running, and is safe to call more than once. Iteration raises APIError when
    an engine request fails (400 bad input, 500 engine step failure, 503 shutting down).
    ctx: the app's `api.serving.ServingContext`.
    """

    def __init__(self, ctx, prompts: list[list[int]], params: SamplingParams, request_id: str, pooling: bool = False):
        self._ctx = ctx
        self._queue: asyncio.Queue = asyncio.Queue()
        ctx.num_queued += len(prompts)
        self._tasks = [
            asyncio.create_task(self._pump(i, p, params, f"{request_id}-{i}", pooling)) for i, p in enumerate(prompts)
        ]

    async def _pump(
        self, index: int, prompt: list[int], params: SamplingParams, request_id: str, pooling: bool
    ) -> None:
        tracker = RequestTracker(self._ctx.metrics, params.n)
        queued = True
        try:
            outputs = self._ctx.engine.generate(prompt, params, request_id, pooling)
            try:
                async for out in outputs:
                    if queued:
                        queued, self._ctx.num_queued = False, self._ctx.num_queued - 1
                    tracker.observe(out)
                    self._queue.put_nowait((index, out))
            finally:
                await outputs.aclose()  # aborts the engine request if it is still running
        except Exception as e:
            self._queue.put_nowait((index, e))
        finally:
            if queued:
                self._ctx.num_queued -= 1
            tracker.close()
            self._queue.put_nowait((index, None))

    async def __aiter__(self):
        remaining = len(self._tasks)
        try:
            while remaining:
                index, item = await self._queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise self._ctx.engine_error(item)
                else:
                    yield index, item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def final_outputs(self) -> list[RequestOutput]:
        """Runs to the end; returns each prompt's last RequestOutput with all its samples, by index."""
        finals, last = FinalOutputs(), {}
        async for index, out in self:
            if (final := finals.add(out)) is not None:
                last[index] = final
        return [last[i] for i in sorted(last)]


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def unless_disconnected(request: Request, work):
    """Awaits `work` (a coroutine), cancelling it if the client disconnects first.

    Raises ClientDisconnected in that case; starlette delivers the request body before this is called,
    so the next ASGI receive message can only be the disconnect.
    """

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def final_response(request: Request, generation: Generation, body) -> Response:
    """Runs a non-streaming request to the end and answers `body(outputs)` as JSON (outputs: each
    prompt's final RequestOutput). A client that left first gets nothing: status 499 in the access
    log, and its engine requests are aborted."""
    try:
        outputs = await unless_disconnected(request, generation.final_outputs())
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the access log shows the client left
    finally:
        await generation.aclose()
    params = outputs[0].kv_transfer_params if outputs else None  # a prefill server's answer to a router
    return JSONResponse(body(outputs) | ({"kv_transfer_params": params} if params else {}))
