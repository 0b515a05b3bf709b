"""POST /v1/responses: OpenAI's Responses API, stateless, as vLLM serves it. A request runs as the chat completion
it amounts to (`ResponsesRequest.chat_request`: chat template, sampling, tool calls and output constraints as on
/v1/chat/completions) and its output becomes Response items: an assistant `message` with `output_text`, and a
`function_call` item per tool call. Streamed, it is OpenAI's typed events (`openai/types/responses/`)."""

import copy
import itertools
import logging
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from api.errors import APIError
from api.generation import Generation, final_response
from api.protocol_responses import ResponsesRequest
from api.reasoning import ReasoningParser, split_delta, split_reasoning
from api.serving import ServingContext
from api.serving_chat import output_constraint, prepare_chat
from api.streaming import typed_event_response
from api.tool_calls import ToolCalls
from engine import RequestOutput

logger = logging.getLogger("api")

# The chat request fields that errors of `prepare_chat` name, as this API calls them.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens"}


async def create_response(request: Request) -> Response:
    """OpenAI's Responses API (stateless: nothing is stored); streamed as typed events with `stream: true`.

    Raises APIError: 400 invalid or unsupported request, 404 unknown model, 503 busy; 500 if the engine failed."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, ResponsesRequest)
    try:
        prompt, params, tools = prepare_chat(ctx, req.chat_request())
    except APIError as e:
        e.param = _PARAMS.get(e.param, e.param)
        raise
    await ctx.constrain(params, *output_constraint(tools, req.text.structured_outputs(), "text"))
    view = _Response(ctx, req, len(prompt), tools)
    generation = ctx.start([prompt], params, view.id)
    if req.stream:
        return typed_event_response(view.stream(generation), generation)
    return await final_response(request, generation, lambda outputs: view.response(outputs[0]))


def _status(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a response whose output ended with `finish_reason`. An output cut by
    a server shutdown ("abort") is incomplete without a reason (OpenAI's reasons do not cover it)."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return ("incomplete", None) if finish_reason == "abort" else ("completed", None)


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(text: str, status: str) -> dict:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)],
    }


def _reasoning_item(text: str, status: str) -> dict:
    """A `reasoning` output item: the model's reasoning as one reasoning_text part; no summary is written."""
    return {
        "type": "reasoning",
        "id": f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "content": [_reasoning_part(text)],
        "status": status,
    }


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class _Response:
    """Turns the engine outputs of one request into its Response object or its stream of events."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, prompt_tokens: int, tools: ToolCalls):
        self.ctx, self.req, self.prompt_tokens, self.tools = ctx, req, prompt_tokens, tools
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict], details: dict | None = None, usage: dict | None = None) -> dict:
        """The Response object (OpenAI's `Response` type) with these output items."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": details,
            "model": self.ctx.settings.model_id,
            "output": output,
            "usage": usage,
        } | self.req.echo()

    def _usage(self, output: RequestOutput, reasoning: str | None) -> dict:
        """Usage; the reasoning's tokens are counted by encoding its text (the output's own tokens have no marks
        of where the think block ended)."""
        output_tokens = len(output.outputs[0].token_ids)
        reasoning_tokens = len(self.ctx.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, output_tokens)},
            "total_tokens": self.prompt_tokens + output_tokens,
        }

    def response(self, output: RequestOutput) -> dict:
        """The whole Response of a finished request: with --reasoning-parser a reasoning item first, when the
        model reasoned. Every item is "completed" but the last, which has the response's status (only it can
        have been cut off)."""
        completion = output.outputs[0]
        parser = self.ctx.settings.reasoning_parser
        reasoning, answer = split_reasoning(parser, completion.text) if parser else (None, completion.text)
        content, calls = self.tools.parse(answer)
        status, details = _status(completion.finish_reason)
        items = [_reasoning_item(reasoning, "completed")] if reasoning else []
        items += [_message_item(content or "", "completed")] if content or not (calls or reasoning) else []
        # a tool call's id in chat's shape becomes the item's call_id
        items += [
            _function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls
        ]
        items[-1]["status"] = status
        return self.body(status, items, details, self._usage(output, reasoning))

    async def stream(self, generation: Generation) -> AsyncIterator[dict]:
        """The events of OpenAI's Responses stream: response.created and .in_progress; per output item
        .output_item.added, then for a reasoning item .content_part.added, .reasoning_text.delta...,
        .reasoning_text.done, .content_part.done, for a message .content_part.added, .output_text.delta...,
        .output_text.done, .content_part.done, for a function call .function_call_arguments.delta..., .done; then
        .output_item.done; last response.completed, or response.incomplete. A failure after the stream began
        is an `error` event (OpenAI's) and ends it."""
        events = _OutputEvents()
        yield events.event("response.created", response=self.body("in_progress", []))
        yield events.event("response.in_progress", response=self.body("in_progress", []))
        streamer = self.tools.streamer()
        parser = self.ctx.settings.reasoning_parser
        thinking, sent, reasoning = (ReasoningParser(parser) if parser else None), 0, ""
        try:
            async for _, last in generation:
                completion = last.outputs[0]
                finished = completion.finish_reason is not None
                more_reasoning, delta = split_delta(thinking, completion.text[sent:], finished)
                sent, reasoning = len(completion.text), reasoning + more_reasoning
                text, calls = streamer.feed(delta, finished)
                for event in events.reasoning(more_reasoning) + events.text(text):
                    yield event
                for call in calls:
                    for event in events.call(call):
                        yield event
        except APIError as e:
            yield events.event("error", code=e.code, message=e.message, param=e.param)
            return
        except Exception:
            logger.exception("stream failed")
            yield events.event(
                "error", code=None, message="internal server error; the server log has the details", param=None
            )
            return
        status, details = _status(last.outputs[0].finish_reason)
        if not events.items:
            for event in events.text("", force=True):  # an empty answer is an empty message, as in `response`
                yield event
        for event in events.close(status):
            yield event
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield events.event(kind, response=self.body(status, events.items, details, self._usage(last, reasoning)))


class _OutputEvents:
    """The output items of one streamed response and the events that build them. The last item stays open
    (its deltas may follow) until another item starts or `close` is called; events carry copies of the items,
    which change afterwards."""

    def __init__(self):
        self.items: list[dict] = []
        self._open = False
        self._sequence = itertools.count()

    def event(self, kind: str, **fields) -> dict:
        """An event of type `kind`, numbered in the stream's order."""
        return {"type": kind, "sequence_number": next(self._sequence)} | fields

    def _ids(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict) -> list[dict]:
        events = self.close("completed")
        self.items.append(item)
        self._open = True
        return events + [
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))
        ]

    def text(self, delta: str, force: bool = False) -> list[dict]:
        """Events for more text of the answer (a message item is opened for it; `force` opens one for none)."""
        if not delta and not force:
            return []
        events = []
        if not (self._open and self.items[-1]["type"] == "message"):
            events += self._add(_message_item("", "in_progress"))
            events.append(
                self.event("response.content_part.added", **self._ids(), content_index=0, part=_text_part(""))
            )
        if delta:
            self.items[-1]["content"][0]["text"] += delta
            events.append(
                self.event("response.output_text.delta", **self._ids(), content_index=0, delta=delta, logprobs=[])
            )
        return events

    def reasoning(self, delta: str) -> list[dict]:
        """Events for more of the model's reasoning (a reasoning item is opened for it)."""
        if not delta:
            return []
        events = []
        if not (self._open and self.items[-1]["type"] == "reasoning"):
            events += self._add(_reasoning_item("", "in_progress"))
            events.append(
                self.event("response.content_part.added", **self._ids(), content_index=0, part=_reasoning_part(""))
            )
        self.items[-1]["content"][0]["text"] += delta
        events.append(self.event("response.reasoning_text.delta", **self._ids(), content_index=0, delta=delta))
        return events

    def call(self, delta: dict) -> list[dict]:
        """Events for a tool-call delta of `ToolCallStream.feed` (one with an `id` starts a call)."""
        events = (
            self._add(_function_call_item(delta["id"], delta["function"]["name"], "", "in_progress"))
            if "id" in delta
            else []
        )
        if arguments := delta["function"].get("arguments"):
            self.items[-1]["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._ids(), delta=arguments))
        return events

    def close(self, status: str) -> list[dict]:
        """Events finishing the open item, which gets `status`; none when no item is open."""
        if not self._open:
            return []
        self._open = False
        item = self.items[-1]
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self.event("response.output_text.done", **self._ids(), content_index=0, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **self._ids(), content_index=0, part=dict(part)),
            ]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events = [
                self.event("response.reasoning_text.done", **self._ids(), content_index=0, text=part["text"]),
                self.event("response.content_part.done", **self._ids(), content_index=0, part=dict(part)),
            ]
        else:
            events = [self.event("response.function_call_arguments.done", **self._ids(), arguments=item["arguments"])]
        return events + [
            self.event("response.output_item.done", output_index=len(self.items) - 1, item=copy.deepcopy(item))
        ]
