"""POST /v1/chat/completions: messages through the chat template (the model's or --chat-template),
then the same sampling as completions; streamed as OpenAI's chat.completion.chunk deltas or not."""
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from api.generation import Generation, final_response
from api.logprobs import chat_logprobs, vllm_prompt_logprobs
from api.protocol import ChatCompletionRequest
from api.serving import ServingContext
from api.streaming import sse_response
from engine import RequestOutput


async def create_chat_completion(request: Request) -> Response:
    """OpenAI's chat completions API, with vLLM's sampling extras; streamed with `stream: true`.

    Raises APIError: 400 invalid request, 404 unknown model, 503 busy; 500 if the engine failed."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, ChatCompletionRequest)
    prompt = ctx.encode_chat(req.messages, req.add_generation_prompt)
    max_param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_tokens = ctx.max_tokens_for(len(prompt), req.requested_max_tokens, "messages", max_param)
    params = ctx.sampling_params(req, max_tokens, req.engine_logprobs)
    view = _ChatCompletion(ctx, req, len(prompt))
    generation = ctx.start([prompt], params, view.id)
    if req.stream:
        return sse_response(view.stream(generation), generation)
    return await final_response(request, generation, lambda outputs: view.response(outputs[0]))


class _ChatCompletion:
    """Turns engine outputs into the response body or stream chunks of one chat request."""

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, prompt_tokens: int):
        self.ctx, self.req, self.prompt_tokens = ctx, req, prompt_tokens
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.ctx.settings.served_model_name, "choices": choices}

    def _usage(self, completion_tokens: int, cached_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def _logprobs(self, logprobs) -> dict | None:
        return chat_logprobs(logprobs, self.ctx.token_text) if self.req.logprobs else None

    def response(self, output: RequestOutput) -> dict:
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for c in output.outputs]
        usage = self._usage(sum(len(c.token_ids) for c in output.outputs), output.num_cached_tokens)
        return self._body("chat.completion", choices) | {"usage": usage, "timings": output.metrics.timings()} \
            | self._prompt_logprobs(output)

    def _prompt_logprobs(self, output: RequestOutput) -> dict:
        """vLLM's top-level `prompt_logprobs` field (in the first content chunk when streaming)."""
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(output.prompt_logprobs or [], self.ctx.token_text)}

    async def stream(self, generation: Generation):
        """First a `delta.role` chunk per choice, then `delta.content` chunks; a choice's last chunk
        carries its finish_reason. With include_usage, `usage` is null in each chunk and a final chunk
        with no choices has it."""
        usage_field = {"usage": None} if self.req.include_usage else {}
        for index in range(self.req.n):
            yield self._body("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]) | usage_field
        sent_chars, sent_logprobs, num_tokens, cached, metrics = {}, {}, {}, 0, None
        prompt_field = None
        async for _, out in generation:
            cached, metrics = out.num_cached_tokens, out.metrics
            if prompt_field is None:
                prompt_field = self._prompt_logprobs(out)
                if prompt_field:
                    yield self._body("chat.completion.chunk", []) | prompt_field | usage_field
            for c in out.outputs:
                text = c.text[sent_chars.get(c.index, 0):]
                logprobs = self._logprobs(c.logprobs[sent_logprobs.get(c.index, 0):]) if self.req.logprobs else None
                sent_chars[c.index], num_tokens[c.index] = len(c.text), len(c.token_ids)
                sent_logprobs[c.index] = len(c.logprobs or ())
                if text or c.finish_reason or (logprobs and logprobs["content"]):
                    delta = {"content": text} if text else {}
                    yield self._body("chat.completion.chunk", [
                        {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason}]) | usage_field
        if self.req.include_usage:
            yield self._body("chat.completion.chunk", []) | {"usage": self._usage(sum(num_tokens.values()), cached),
                                                             "timings": metrics.timings()}
