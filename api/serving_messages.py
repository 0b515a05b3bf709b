"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as vLLM, llama.cpp and SGLang serve
it. A request runs as the chat completion it amounts to (`MessagesRequest.chat_request`: chat template, sampling
and tool calls as on /v1/chat/completions) and its output becomes Anthropic content blocks: with --reasoning-parser
a `thinking` block of what the model wrote between `<think>` and `</think>` (its length capped by
`thinking.budget_tokens`), a `text` block and a `tool_use` block per tool call. Streamed, it is Anthropic's events
(the anthropic SDK's RawMessageStreamEvent). Errors on these routes are in Anthropic's shape (`api.errors`)."""

import logging
import uuid
from typing import AsyncIterator

from pydantic_core import from_json
from starlette.requests import Request
from starlette.responses import Response

from api.errors import APIError, JSONResponse
from api.generation import Generation, final_response
from api.protocol_anthropic import CountTokensRequest, MessagesRequest
from api.reasoning import END, ReasoningParser, split_delta, split_reasoning
from api.serving import ServingContext
from api.serving_chat import prepare_chat, render_chat
from api.streaming import typed_event_response
from api.tool_calls import ToolCalls
from engine import CompletionOutput, RequestOutput

logger = logging.getLogger("api")


async def create_message(request: Request) -> Response:
    """Anthropic's Messages API; streamed as Anthropic's events with `stream: true`.

    Raises APIError (answered in Anthropic's shape): 400 invalid request, 404 unknown model, 503 busy or
    shutting down; 500 if the engine failed."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, MessagesRequest)
    prompt, params, tools = prepare_chat(ctx, req.chat_request(ctx.settings.enable_auto_tool_choice))
    await ctx.constrain(params, tools.constraint, "tools")
    if req.thinking is not None and req.thinking.type == "enabled" and ctx.settings.reasoning_parser:
        params.thinking_token_budget = req.thinking.budget_tokens  # then the think block is closed for it
        params.thinking_end_token_ids = ctx.engine.tokenizer.encode(END, add_special_tokens=False)
    view = _Message(ctx, len(prompt), tools)
    generation = ctx.start([prompt], params, view.id)
    if req.stream:
        return typed_event_response(view.stream(generation), generation)
    return await final_response(request, generation, lambda outputs: view.message(outputs[0]))


async def count_message_tokens(request: Request) -> Response:
    """Anthropic's token counting: `{"input_tokens": N}`, the length of the prompt /v1/messages would run (system,
    messages and tools through the chat template). Raises APIError 400 invalid request, 404 unknown model."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, CountTokensRequest)
    prompt, _ = render_chat(ctx, req.chat_request(ctx.settings.enable_auto_tool_choice))
    return JSONResponse({"input_tokens": len(prompt)})


def _stop(completion: CompletionOutput, calls: list) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output that made tool `calls`.

    Raises APIError 503 for an output the server aborted while shutting down: Anthropic's stop reasons
    cannot say that the message was cut short."""
    if completion.finish_reason == "abort":
        raise APIError(503, "the server shut down before the message was complete", headers={"Retry-After": "5"})
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):  # a stop string; a token id is the model's own end of turn
        return "stop_sequence", completion.stop_reason
    return ("tool_use" if calls else "end_turn"), None


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _thinking_block(thinking: str) -> dict:
    """A `thinking` block; its `signature` is empty (nothing here signs reasoning, and none is checked)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _tool_use_block(call: dict, arguments: str) -> dict:
    """A `tool_use` block for a call in chat's shape; `arguments` is its JSON input so far. Input cut by
    max_tokens keeps what parsed (as the anthropic SDK's stream accumulator does)."""
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": call["function"]["name"],
        "input": from_json(arguments or "{}", allow_partial=True),
    }


class _Message:
    """Turns the engine output of one request into its Message or its stream of events."""

    def __init__(self, ctx: ServingContext, prompt_tokens: int, tools: ToolCalls):
        self.ctx, self.prompt_tokens, self.tools = ctx, prompt_tokens, tools
        self.id = f"msg_{uuid.uuid4().hex}"

    def _body(
        self,
        content: list[dict],
        stop_reason: str | None,
        stop_sequence: str | None,
        output_tokens: int,
        cached_tokens: int,
    ) -> dict:
        """The Message object (the anthropic SDK's `Message` type). Usage as Anthropic counts it: the prompt
        tokens read from the (prefix) cache are `cache_read_input_tokens`, the others `input_tokens`; nothing
        is written to a cache on request here, so `cache_creation_input_tokens` is 0."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.settings.model_id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": self.prompt_tokens - cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached_tokens,
                "output_tokens": output_tokens,
            },
        }

    def message(self, output: RequestOutput) -> dict:
        """The whole Message of a finished output: a thinking block (with --reasoning-parser, when the model
        reasoned), a text block (also for an empty answer, unless there are tool calls or it all was thinking),
        then a tool_use block per call. Raises APIError 503 (see `_stop`)."""
        completion = output.outputs[0]
        parser = self.ctx.settings.reasoning_parser
        reasoning, answer = split_reasoning(parser, completion.text) if parser else (None, completion.text)
        text, calls = self.tools.parse(answer)
        content = [_thinking_block(reasoning)] if reasoning else []
        content += [_text_block(text or "")] if text or not (calls or reasoning) else []
        content += [_tool_use_block(c, c["function"]["arguments"]) for c in calls]
        return self._body(content, *_stop(completion, calls), len(completion.token_ids), output.num_cached_tokens)

    async def stream(self, generation: Generation) -> AsyncIterator[dict]:
        """Anthropic's stream: message_start (empty content; sent with the first output, when the prompt's
        cached tokens are known), per content block content_block_start,
        content_block_delta... (text_delta or input_json_delta), content_block_stop; then message_delta
        (stop_reason, stop_sequence, usage.output_tokens) and message_stop. A failure after the stream began is
        an `error` event (Anthropic's), which ends it."""
        blocks, streamer, started = _ContentBlocks(), self.tools.streamer(), False
        parser = self.ctx.settings.reasoning_parser
        thinking, sent = (ReasoningParser(parser) if parser else None), 0
        try:
            async for _, out in generation:
                if not started:  # once the prompt ran: its cached tokens are known then
                    started = True
                    yield {"type": "message_start", "message": self._body([], None, None, 0, out.num_cached_tokens)}
                completion = out.outputs[0]
                finished = completion.finish_reason is not None
                reasoning, delta = split_delta(thinking, completion.text[sent:], finished)
                sent = len(completion.text)
                text, calls = streamer.feed(delta, finished)
                events = blocks.thinking(reasoning) if reasoning else []
                events += (blocks.text(text) if text else []) + [e for c in calls for e in blocks.tool_call(c)]
                for event in events:
                    yield event
            stop_reason, stop_sequence = _stop(completion, streamer.calls)
        except APIError as e:
            yield e.anthropic_body()
            return
        except Exception:
            logger.exception("stream failed")
            yield APIError(500, "internal server error; the server log has the details").anthropic_body()
            return
        # an empty answer is an empty text block, as in `message`
        for event in blocks.close() if blocks.count else blocks.text("") + blocks.close():
            yield event
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": len(completion.token_ids)},
        }
        yield {"type": "message_stop"}


class _ContentBlocks:
    """The content blocks of one streamed message, as the events that build them. The last block stays open
    (more deltas may follow) until another one starts or `close` is called."""

    def __init__(self):
        self.count = 0  # blocks started; the open one, if any, is the last
        self._open: str | None = None  # the open block's type

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.count, self._open = self.count + 1, block["type"]
        return events + [{"type": "content_block_start", "index": self.count - 1, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.count - 1, "delta": delta}

    def thinking(self, thinking: str) -> list[dict]:
        """Events for more of the model's reasoning (a thinking block is opened for it)."""
        events = [] if self._open == "thinking" else self._start(_thinking_block(""))
        return events + [self._delta({"type": "thinking_delta", "thinking": thinking})]

    def text(self, text: str) -> list[dict]:
        """Events for more text of the answer (a text block is opened for it, even for none)."""
        events = [] if self._open == "text" else self._start(_text_block(""))
        return events + ([self._delta({"type": "text_delta", "text": text})] if text else [])

    def tool_call(self, delta: dict) -> list[dict]:
        """Events for a tool-call delta of `ToolCallStream.feed` (one with an `id` starts a call)."""
        events = self._start(_tool_use_block(delta, "")) if "id" in delta else []
        if arguments := delta["function"].get("arguments"):
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[dict]:
        """The events finishing the open block (a thinking block's signature first, as Anthropic sends it); none
        when no block is open."""
        if self._open is None:
            return []
        signature = [self._delta({"type": "signature_delta", "signature": ""})] if self._open == "thinking" else []
        self._open = None
        return signature + [{"type": "content_block_stop", "index": self.count - 1}]
