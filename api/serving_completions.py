"""POST /v1/completions: OpenAI's completions API with vLLM's sampling extras, streamed or not.

Choice `index` is prompt index * n + sample index. With echo, a choice's text starts with its prompt,
and with logprobs its prompt tokens are scored too (the first one null, as in OpenAI's API); vLLM's
`prompt_logprobs` field adds `choices[i].prompt_logprobs` in vLLM's shape.
"""

import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from api.errors import APIError
from api.generation import Generation, final_response
from api.logprobs import CompletionLogprobs, merge, vllm_prompt_logprobs
from api.protocol import CompletionRequest
from api.serving import ServingContext
from api.streaming import sse_response
from api.structured_outputs import structured_outputs_params
from engine import RequestOutput, SamplingParams
from engine.outputs import RequestMetrics


async def create_completion(request: Request) -> Response:
    """OpenAI's (legacy) completions API, with vLLM's sampling extras; streamed with `stream: true`.

    Raises APIError: 400 invalid request, 404 unknown model, 503 busy; 500 if the engine failed."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, CompletionRequest)
    prompts, params = prepare_completion(ctx, req)
    await ctx.constrain(params, *structured_outputs_params(req))
    view = _Completion(ctx, req, prompts)
    generation = ctx.start(prompts, params, view.id)
    if req.stream:
        return sse_response(view.stream(generation), generation)
    return await final_response(request, generation, view.response)


def prepare_completion(ctx: ServingContext, req: CompletionRequest) -> tuple[list[list[int]], SamplingParams]:
    """The request's prompts as token ids and its sampling parameters (output constraints aside).
    Raises APIError 400."""
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400, "max_tokens 0 generates nothing; it needs echo: true (to score the prompt)", param="max_tokens"
        )
    prompts = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            prompt = ctx.tokenizer.encode(prompt)
            if not prompt:
                raise APIError(400, "prompt encodes to no tokens", param="prompt")
        else:
            ctx.check_token_ids(prompt, "prompt")
        ctx.max_tokens_for(len(prompt), req.max_tokens, "prompt", "max_tokens")
        prompts.append(prompt)
    return prompts, ctx.sampling_params(req, req.max_tokens, req.logprobs)


class _Completion:
    """Turns engine outputs into the response body or stream chunks of one request."""

    def __init__(self, ctx: ServingContext, req: CompletionRequest, prompts: list[list[int]]):
        self.ctx, self.req, self.prompts = ctx, req, prompts
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.echo_texts = (
            [p if isinstance(p, str) else ctx.tokenizer.decode(ids) for p, ids in zip(req.prompts, prompts)]
            if req.echo
            else None
        )

    def _body(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.ctx.settings.model_id,
            "choices": choices,
        }

    def _usage(self, completion_tokens: int, cached_tokens: int) -> dict:
        prompt_tokens = sum(map(len, self.prompts))
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                logprobs = None
                if self.req.logprobs is not None:
                    builder = CompletionLogprobs(self.ctx.token_text)
                    prompt_part = builder.prompt(self.prompts[i], out.prompt_logprobs) if self.req.echo else None
                    logprobs = builder.generated(c.logprobs)
                    logprobs = merge(prompt_part, logprobs) if prompt_part else logprobs
                text = self.echo_texts[i] + c.text if self.req.echo else c.text
                choices.append(
                    {
                        "index": i * self.req.n + c.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    | self._prompt_logprobs(out)
                )
        completion_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        usage = self._usage(completion_tokens, sum(out.num_cached_tokens for out in outputs))
        return self._body(choices) | {"usage": usage, "timings": _timings(outputs)}

    def _prompt_logprobs(self, out: RequestOutput) -> dict:
        """vLLM's `prompt_logprobs` choice field, when the request asked for it."""
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(out.prompt_logprobs or [], self.ctx.token_text)}

    async def stream(self, generation: Generation):
        """Chunks as the engine makes them: each carries the new text of one choice, the last one of a
        choice its finish_reason; with include_usage, `usage` is null in each and a final chunk has it."""
        usage_field = {"usage": None} if self.req.include_usage else {}
        sent_chars, sent_logprobs, builders = {}, {}, {}
        num_tokens, cached, last = {}, {}, {}
        async for i, out in generation:
            cached[i], last[i] = out.num_cached_tokens, out
            for c in out.outputs:
                index = i * self.req.n + c.index
                first = index not in sent_chars
                text = (self.echo_texts[i] if self.req.echo and first else "") + c.text[sent_chars.get(index, 0) :]
                sent_chars[index], num_tokens[index] = len(c.text), len(c.token_ids)
                logprobs = None
                if self.req.logprobs is not None:
                    builder = builders.setdefault(index, CompletionLogprobs(self.ctx.token_text))
                    prompt_part = (
                        builder.prompt(self.prompts[i], out.prompt_logprobs) if self.req.echo and first else None
                    )
                    logprobs = builder.generated(c.logprobs[sent_logprobs.get(index, 0) :])
                    logprobs = merge(prompt_part, logprobs) if prompt_part else logprobs
                    sent_logprobs[index] = len(c.logprobs)
                prompt_field = self._prompt_logprobs(out) if first else {}  # in a choice's first chunk
                if text or c.finish_reason or (logprobs and logprobs["tokens"]) or prompt_field:
                    yield (
                        self._body(
                            [
                                {
                                    "index": index,
                                    "text": text,
                                    "logprobs": logprobs,
                                    "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason,
                                }
                                | prompt_field
                            ]
                        )
                        | usage_field
                    )
        if self.req.include_usage:
            yield self._body([]) | {
                "usage": self._usage(sum(num_tokens.values()), sum(cached.values())),
                "timings": _timings(list(last.values())),
            }


def _timings(outputs: list[RequestOutput]) -> dict:
    """llama.cpp's `timings` of the whole request, over all its prompts and samples."""
    return RequestMetrics.merge([out.metrics for out in outputs]).timings()
