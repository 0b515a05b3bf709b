"""POST /v1/chat/completions: messages through the chat template (the model's or --chat-template),
then the same sampling as completions; streamed as OpenAI's chat.completion.chunk deltas or not."""

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from api.errors import APIError
from api.generation import Generation, final_response
from api.logprobs import chat_logprobs, vllm_prompt_logprobs
from api.protocol import ChatCompletionRequest
from api.reasoning import ReasoningParser, split_delta, split_reasoning
from api.serving import ServingContext
from api.streaming import sse_response
from api.structured_outputs import structured_outputs_params
from api.tool_calls import ToolCalls, finish_reason
from engine import RequestOutput, SamplingParams, StructuredOutputsParams


async def create_chat_completion(request: Request) -> Response:
    """OpenAI's chat completions API, with vLLM's sampling extras; streamed with `stream: true`.

    Raises APIError: 400 invalid request, 404 unknown model, 503 busy; 500 if the engine failed."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, ChatCompletionRequest)
    prompt, params, tools = prepare_chat(ctx, req)
    await ctx.constrain(params, *output_constraint(tools, *structured_outputs_params(req)))
    view = _ChatCompletion(ctx, req, len(prompt), tools)
    generation = ctx.start([prompt], params, view.id)
    if req.stream:
        return sse_response(view.stream(generation), generation)
    return await final_response(request, generation, lambda outputs: view.response(outputs[0]))


def prepare_chat(ctx: ServingContext, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, ToolCalls]:
    """The conversation as token ids (through the chat template, with the tools), the sampling parameters
    (output constraints aside) and the request's tool calling. Raises APIError 400."""
    prompt, tools = render_chat(ctx, req)
    max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_tokens = ctx.max_tokens_for(len(prompt), req.requested_max_tokens, "messages", max_param)
    params = ctx.sampling_params(req, max_tokens, req.engine_logprobs)
    if tools.skip_special_tokens is not None:
        params.skip_special_tokens = tools.skip_special_tokens
    return prompt, params, tools


def render_chat(ctx: ServingContext, req: ChatCompletionRequest) -> tuple[list[int], ToolCalls]:
    """The conversation as token ids (through the chat template, with the tools it renders) and the request's
    tool calling. Raises APIError 400 for bad tools or tool_choice, or a conversation the template rejects."""
    s = ctx.settings
    tools = ToolCalls(req, s.tool_call_parser if s.enable_auto_tool_choice else None)
    prompt = ctx.encode_chat(
        req.messages, req.add_generation_prompt, tools=tools.template_tools, template_kwargs=req.chat_template_kwargs
    )
    return prompt, tools


def output_constraint(
    tools: ToolCalls, spec: StructuredOutputsParams | None, param: str | None
) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the request field it came from) of a request whose own output constraint is `spec`
    (from field `param`): that, or the grammar of its forced tool calls ("tools"), or (None, None).

    Raises APIError 400 naming `param` when the request has both."""
    if tools.constraint is None:
        return spec, param
    if spec is not None:
        raise APIError(
            400,
            f'use either an output constraint ({param}) or tool_choice "required" / a named function, not both',
            param=param,
        )
    return tools.constraint, "tools"


class _ChatCompletion:
    """Turns engine outputs into the response body or stream chunks of one chat request."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, prompt_tokens: int, tools: ToolCalls):
        self.ctx, self.req, self.prompt_tokens, self.tools = ctx, req, prompt_tokens, tools
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, kind: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.ctx.settings.model_id,
            "choices": choices,
        }

    def _usage(self, completion_tokens: int, cached_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def _logprobs(self, logprobs) -> dict | None:
        return chat_logprobs(logprobs, self.ctx.token_text) if self.req.logprobs else None

    def _reasoning(self, reasoning: str | None) -> dict:
        """vLLM's `reasoning_content` and newer `reasoning` fields, with a --reasoning-parser only."""
        return {"reasoning_content": reasoning, "reasoning": reasoning} if self.ctx.settings.reasoning_parser else {}

    def response(self, output: RequestOutput) -> dict:
        choices = []
        for c in output.outputs:
            reasoning, text = (
                split_reasoning(self.ctx.settings.reasoning_parser, c.text)
                if self.ctx.settings.reasoning_parser
                else (None, c.text)
            )
            content, calls = self.tools.parse(text)
            if reasoning is not None and not content:
                content = None  # all of it was reasoning (cut while thinking), as vLLM reports it
            message = (
                {"role": "assistant", "content": content}
                | self._reasoning(reasoning)
                | ({"tool_calls": calls} if calls else {})
            )
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c.logprobs),
                    "finish_reason": finish_reason(c.finish_reason, calls, self.tools.mode),
                    "stop_reason": c.stop_reason,
                }
            )
        usage = self._usage(sum(len(c.token_ids) for c in output.outputs), output.num_cached_tokens)
        return (
            self._body("chat.completion", choices)
            | {"usage": usage, "timings": output.metrics.timings()}
            | self._prompt_logprobs(output)
        )

    def _prompt_logprobs(self, output: RequestOutput) -> dict:
        """vLLM's top-level `prompt_logprobs` field (in the first content chunk when streaming)."""
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(output.prompt_logprobs or [], self.ctx.token_text)}

    async def stream(self, generation: Generation):
        """First a `delta.role` chunk per choice, then `delta.content` (and `delta.tool_calls`) chunks; a
        choice's last chunk carries its finish_reason. With include_usage, `usage` is null in each chunk
        and a final chunk with no choices has it."""
        usage_field = {"usage": None} if self.req.include_usage else {}
        for index in range(self.req.n):
            yield (
                self._body(
                    "chat.completion.chunk",
                    [
                        {
                            "index": index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                )
                | usage_field
            )
        sent_chars, sent_logprobs, num_tokens, cached, metrics = {}, {}, {}, 0, None
        prompt_field = None
        streams = [self.tools.streamer() for _ in range(self.req.n)]
        parser = self.ctx.settings.reasoning_parser
        thinking = [ReasoningParser(parser) if parser else None for _ in range(self.req.n)]
        async for _, out in generation:
            cached, metrics = out.num_cached_tokens, out.metrics
            if prompt_field is None:
                prompt_field = self._prompt_logprobs(out)
                if prompt_field:
                    yield self._body("chat.completion.chunk", []) | prompt_field | usage_field
            for c in out.outputs:
                finished = c.finish_reason is not None
                reasoning, new_text = split_delta(thinking[c.index], c.text[sent_chars.get(c.index, 0) :], finished)
                text, calls = streams[c.index].feed(new_text, finished)
                logprobs = self._logprobs(c.logprobs[sent_logprobs.get(c.index, 0) :]) if self.req.logprobs else None
                sent_chars[c.index], num_tokens[c.index] = len(c.text), len(c.token_ids)
                sent_logprobs[c.index] = len(c.logprobs or ())
                if text or calls or reasoning or finished or (logprobs and logprobs["content"]):
                    delta = (
                        ({"content": text} if text else {})
                        | (self._reasoning(reasoning) if reasoning else {})
                        | ({"tool_calls": calls} if calls else {})
                    )
                    reason = finish_reason(c.finish_reason, streams[c.index].calls, self.tools.mode)
                    yield (
                        self._body(
                            "chat.completion.chunk",
                            [
                                {
                                    "index": c.index,
                                    "delta": delta,
                                    "logprobs": logprobs,
                                    "finish_reason": reason,
                                    "stop_reason": c.stop_reason,
                                }
                            ],
                        )
                        | usage_field
                    )
        if self.req.include_usage:
            yield self._body("chat.completion.chunk", []) | {
                "usage": self._usage(sum(num_tokens.values()), cached),
                "timings": metrics.timings(),
            }
