"""Server-Sent Events as OpenAI sends them: `data: {json}\\n\\n` per chunk, then `data: [DONE]`; and typed
events (`event: <type>` before each `data:` line), as Anthropic's Messages API (and OpenAI's Responses API)
send them."""

import logging
from typing import AsyncIterator

import orjson
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from api.errors import APIError
from api.generation import Generation

logger = logging.getLogger("api")


def sse_response(chunks: AsyncIterator[dict], generation: Generation) -> EventSourceResponse:
    """Streams `chunks` as SSE. A failure after the 200 went out is sent as an `{"error": ...}` event
    (the openai SDK raises it) before [DONE]. When the client disconnects, the chunk iterator is
    cancelled, which aborts the engine requests; `generation` is closed after the response in any
    case, also when the client left before streaming began."""

    async def events():
        try:
            async for chunk in chunks:
                yield orjson.dumps(chunk).decode()
        except APIError as e:
            yield orjson.dumps(e.body()).decode()
        except Exception:
            logger.exception("stream failed")
            yield orjson.dumps(APIError(500, "internal server error; the server log has the details").body()).decode()
        yield "[DONE]"

    # No keep-alive comments (ping=0): OpenAI sends none, and strict parsers expect only data lines.
    # On shutdown the engine aborts every request, which ends each stream with finish_reason "abort"
    # and [DONE]; the grace period lets that reach the client before sse-starlette cancels the stream.
    # A client that stops reading for `send_timeout` seconds is dropped, which aborts its request.
    return EventSourceResponse(
        events(),
        sep="\n",
        ping=0,
        background=BackgroundTask(generation.aclose),
        shutdown_grace_period=5,
        send_timeout=30,
    )


def typed_event_response(events: AsyncIterator[dict], generation: Generation) -> EventSourceResponse:
    """Streams `events` (dicts with a `type`) as SSE messages of an `event: <type>` line and a `data: <json>`
    line, with no [DONE], as Anthropic's Messages and OpenAI's Responses streams are sent (the anthropic SDK
    skips messages without an event line).
    `events` reports its own failures as events. Otherwise as `sse_response`: no keep-alive comments, the
    engine requests aborted when the client leaves, `generation` closed after the response in any case."""

    async def encoded():
        async for event in events:
            yield ServerSentEvent(orjson.dumps(event).decode(), event=event["type"], sep="\n")

    return EventSourceResponse(
        encoded(),
        sep="\n",
        ping=0,
        background=BackgroundTask(generation.aclose),
        shutdown_grace_period=5,
        send_timeout=30,
    )


def held_tail(text: str, marker: str) -> int:
    """How many characters at the end of streamed `text` may be the start of `marker` (a tag still
    arriving token by token), to hold back until the next delta tells."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)
