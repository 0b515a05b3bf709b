"""Graceful drain on shutdown: count the HTTP requests in flight and, once draining, answer new ones 503
with Retry-After (so load balancers and clients go elsewhere) while those in flight finish."""

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import APIError

# Scrapers still see the server while it drains; everything else (/health included) answers 503.
_SERVED_WHILE_DRAINING = frozenset({"/metrics"})


class Drain:
    """The drain state of one app: `in_flight` requests, and `draining` once shutdown began."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float, interrupted=lambda: False) -> bool:
        """Starts draining and waits up to `timeout` seconds for the requests in flight to finish, or
        until `interrupted()` turns true (polled every 0.1 s). Returns whether they all finished."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and not interrupted() and loop.time() < deadline:
            try:
                await asyncio.wait_for(self._idle.wait(), min(0.1, max(deadline - loop.time(), 0)))
            except asyncio.TimeoutError:
                pass
        return self.in_flight == 0


class DrainMiddleware:
    """Plain ASGI middleware (streams pass through untouched): counts each HTTP request until its
    response is sent; while draining, new requests get 503 with Retry-After and the OpenAI (on Anthropic's
    routes, Anthropic's) error body."""

    def __init__(self, app: ASGIApp, drain: Drain, retry_after: int = 5):
        self.app = app
        self.drain = drain
        self.retry_after = str(retry_after)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.drain.draining and scope["path"] not in _SERVED_WHILE_DRAINING:
            error = APIError(
                503,
                "the server is shutting down; retry on another replica or later",
                code="shutting_down",
                headers={"Retry-After": self.retry_after},
            )
            return await error.response(scope["path"])(scope, receive, send)
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
