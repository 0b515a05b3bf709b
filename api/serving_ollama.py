"""Ollama's API (github.com/ollama/ollama, docs/api.md) on the same engine, for the clients that speak it first
(Open WebUI, VS Code's local models, LangChain's ChatOllama, the `ollama` Python client):

  POST /api/chat, /api/generate   streamed NDJSON (one JSON object a line) unless `stream: false`
  POST /api/embed, /api/embeddings
  GET  /api/tags, /api/ps, /api/version; POST /api/show

A chat or generate request runs as the chat completion it amounts to (api.protocol_ollama), with Ollama's
fields in the answer: `message` (`content`, `thinking` with a --reasoning-parser, `tool_calls` with arguments as
objects), `done_reason`, and its timings in nanoseconds from the engine's own (`total_duration`,
`load_duration` 0: the model is loaded at start-up, `prompt_eval_count`, `prompt_eval_duration`,
`eval_count`, `eval_duration`). Errors are Ollama's `{"error": "..."}` (api.errors), also as the last line of a
stream that fails after it began. The one model answers to its served name, with or without ":latest".
"""

import hashlib
import logging
import os
import time
import uuid
from datetime import datetime, timezone
from typing import AsyncIterator

import orjson
from pydantic import ValidationError
from pydantic_core import from_json
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from api.errors import APIError, JSONResponse, from_validation_error
from api.generation import Generation, final_response
from api.protocol import ChatCompletionRequest
from api.protocol_ollama import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
)
from api.reasoning import ReasoningParser, split_delta, split_reasoning
from api.serving import ServingContext, validated
from api.serving_chat import output_constraint, prepare_chat
from api.structured_outputs import structured_outputs_params
from api.tool_calls import ToolCalls
from engine import CompletionOutput, RequestOutput, SamplingParams

logger = logging.getLogger("api")

# The Ollama API version whose routes and fields this follows; clients gate features on it (VS Code's local
# models need 0.6.4 or later).
OLLAMA_VERSION = "0.12.0"
FAR_FUTURE = "2318-01-01T00:00:00Z"  # /api/ps's expires_at of a model that stays loaded


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


async def _parse(ctx: ServingContext, request: Request, model: type):
    """The body as `model` for the served model (its name with or without ":latest"). Raises APIError.
    Unlike `ctx.parse`, any Content-Type is taken (Ollama's own examples post with curl's form default), and an
    empty body is an empty object."""
    body = await request.body()
    try:
        data = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    name = data.pop("model", None) or data.get("name")
    if name is not None and str(name).removesuffix(":latest") not in ctx.settings.model_names:
        raise APIError(404, f"model '{name}' not found; this server serves '{ctx.settings.model_id}'")
    return validated(model, data)


def _as_chat(build) -> ChatCompletionRequest:
    """The chat request `build()` makes, its validation errors as 400s."""
    try:
        return build()
    except ValidationError as e:
        raise from_validation_error(e) from None


def _check_generating(ctx: ServingContext, req, images: bool) -> None:
    """Raises APIError 400 for what these routes cannot honour: images (a text model), a thinking level
    ("low", "medium", "high": gpt-oss's effort, not built), `think` without a --reasoning-parser."""
    if images:
        raise APIError(400, "images are not supported: this server serves text-only models")
    if isinstance(req.think, str):
        raise APIError(
            400, f"think {req.think!r} is not supported: this server has no thinking levels (use true or false)"
        )
    if req.think and not ctx.settings.reasoning_parser:
        raise APIError(400, f"'{ctx.settings.model_id}' does not support thinking (no --reasoning-parser)")


def _cap_to_num_ctx(req, prompt_len: int, params: SamplingParams) -> None:
    """Honours options.num_ctx (Ollama's context window): output stops where prompt + output fill it.
    Raises APIError 400 for a prompt that does not fit it."""
    num_ctx = req.options.num_ctx if req.options else None
    if num_ctx is None:
        return
    if prompt_len >= num_ctx:
        raise APIError(400, f"the prompt has {prompt_len} tokens, more than fit options.num_ctx {num_ctx}")
    params.max_tokens = min(params.max_tokens, num_ctx - prompt_len)


def _done_reason(completion: CompletionOutput) -> str:
    """Ollama's done_reason. Raises APIError 503 for an output the server aborted while shutting down."""
    if completion.finish_reason == "abort":
        raise APIError(503, "the server shut down before the answer was complete", headers={"Retry-After": "5"})
    return "length" if completion.finish_reason == "length" else "stop"


def _ollama_call(call: dict) -> dict:
    """A chat-shaped tool call as Ollama sends it: arguments as an object (what parsed of a cut one)."""
    arguments = from_json(call["function"]["arguments"] or "{}", allow_partial=True)
    return {"function": {"name": call["function"]["name"], "arguments": arguments}}


def ndjson_response(lines: AsyncIterator[dict], generation: Generation) -> StreamingResponse:
    """Streams `lines` as newline-delimited JSON (Ollama's streams). A failure after the 200 went out is sent
    as a last `{"error": ...}` line, which the ollama client raises. The engine requests are aborted when the
    client leaves, and `generation` is closed after the response in any case."""

    async def encoded():
        try:
            async for line in lines:
                yield orjson.dumps(line) + b"\n"
        except APIError as e:
            yield orjson.dumps(e.ollama_body()) + b"\n"
        except Exception:
            logger.exception("stream failed")
            yield orjson.dumps({"error": "internal server error; the server log has the details"}) + b"\n"

    return StreamingResponse(encoded(), media_type="application/x-ndjson", background=BackgroundTask(generation.aclose))


class _Answer:
    """Turns one engine request's output into Ollama's objects: chat's `message` or generate's `response`."""

    def __init__(self, ctx: ServingContext, prompt: list[int], tools: ToolCalls | None, chat: bool):
        self.ctx, self.prompt, self.tools, self.chat = ctx, prompt, tools, chat
        self.start = time.perf_counter()
        self.parser = ctx.settings.reasoning_parser

    def _head(self) -> dict:
        return {"model": self.ctx.settings.model_id, "created_at": _now()}

    def _fields(self, content: str, thinking: str | None, calls: list[dict]) -> dict:
        if not self.chat:
            return {"response": content} | ({"thinking": thinking} if thinking else {})
        message = {"role": "assistant", "content": content} | ({"thinking": thinking} if thinking else {})
        return {"message": message | ({"tool_calls": [_ollama_call(c) for c in calls]} if calls else {})}

    def _done(self, out: RequestOutput) -> dict:
        """The last object's fields: done_reason, generate's `context`, and the timings in nanoseconds."""
        completion = out.outputs[0]
        timings = out.metrics.timings()
        done = {
            "done": True,
            "done_reason": _done_reason(completion),
            "total_duration": int((time.perf_counter() - self.start) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": len(self.prompt),
            "prompt_eval_duration": int(timings["prompt_ms"] * 1e6),
            "eval_count": len(completion.token_ids),
            "eval_duration": int(timings["predicted_ms"] * 1e6),
        }
        return done if self.chat else done | {"context": self.prompt + list(completion.token_ids)}

    def final(self, out: RequestOutput) -> dict:
        """The whole answer of a finished request (`stream: false`)."""
        text = out.outputs[0].text
        thinking, text = split_reasoning(self.parser, text) if self.parser else (None, text)
        content, calls = self.tools.parse(text) if self.tools else (text, [])
        return self._head() | self._fields(content or "", thinking, calls) | self._done(out)

    async def stream(self, generation: Generation) -> AsyncIterator[dict]:
        """An object per new piece of text (and of thinking), `done: false`; the tool calls, once parsed, in
        one more; then the last object, with empty text, `done: true` and the timings."""
        thinking = ReasoningParser(self.parser) if self.parser else None
        calls = self.tools.streamer() if self.tools else None
        sent, out = 0, None
        async for _, out in generation:
            completion = out.outputs[0]
            finished = completion.finish_reason is not None
            reasoning, new_text = split_delta(thinking, completion.text[sent:], finished)
            sent = len(completion.text)
            text = calls.feed(new_text, finished)[0] if calls else new_text
            if text or reasoning:
                yield self._head() | self._fields(text, reasoning, []) | {"done": False}
        if calls is not None and calls.calls:
            yield self._head() | self._fields("", None, calls.calls) | {"done": False}
        yield self._head() | self._fields("", None, []) | self._done(out)


async def _answer(request: Request, ctx: ServingContext, req, prompt, params, answer: _Answer) -> Response:
    generation = ctx.start([prompt], params, f"ollama-{uuid.uuid4().hex}")
    if req.stream:
        return ndjson_response(answer.stream(generation), generation)
    return await final_response(request, generation, lambda outputs: answer.final(outputs[0]))


async def chat(request: Request) -> Response:
    """POST /api/chat. Raises APIError (Ollama's shape): 400 bad request, 404 other model, 503 busy."""
    ctx: ServingContext = request.app.state.serving
    req = await _parse(ctx, request, OllamaChatRequest)
    _check_generating(ctx, req, any(m.images for m in req.messages))
    chat_req = _as_chat(lambda: req.chat_request(ctx.settings.enable_auto_tool_choice))
    prompt, params, tools = prepare_chat(ctx, chat_req)
    _cap_to_num_ctx(req, len(prompt), params)
    await ctx.constrain(params, *output_constraint(tools, *structured_outputs_params(chat_req)))
    return await _answer(request, ctx, req, prompt, params, _Answer(ctx, prompt, tools, chat=True))


async def generate(request: Request) -> Response:
    """POST /api/generate: the prompt through the chat template (not with `raw`), after `context`'s tokens.
    An empty prompt only loads the model (done_reason "load"). Raises APIError 400 for `suffix` (no
    fill-in-the-middle here), `template` (Go templates are not run; the model's chat template is), images."""
    ctx: ServingContext = request.app.state.serving
    req = await _parse(ctx, request, OllamaGenerateRequest)
    _check_generating(ctx, req, bool(req.images))
    if req.suffix:
        raise APIError(400, "suffix is not supported: this server has no fill-in-the-middle")
    if req.template:
        raise APIError(400, "template is not supported: the model's own chat template renders prompts")
    if not req.prompt and not req.context:
        return JSONResponse(
            {
                "model": ctx.settings.model_id,
                "created_at": _now(),
                "response": "",
                "done": True,
                "done_reason": "load",
            }
        )
    chat_req = _as_chat(req.chat_request)
    ctx.check_token_ids(req.context or [], "context")
    if req.raw:
        prompt = (req.context or []) + ctx.tokenizer.encode(req.prompt, add_special_tokens=not req.context)
        max_tokens = ctx.max_tokens_for(len(prompt), chat_req.requested_max_tokens, "prompt", "num_predict")
        params = ctx.sampling_params(chat_req, max_tokens, None)
    else:
        prompt, params, _ = prepare_chat(ctx, chat_req)
        if req.context:
            prompt = req.context + prompt
            params.max_tokens = ctx.max_tokens_for(len(prompt), chat_req.requested_max_tokens, "prompt", "num_predict")
    _cap_to_num_ctx(req, len(prompt), params)
    await ctx.constrain(params, *structured_outputs_params(chat_req))
    return await _answer(request, ctx, req, prompt, params, _Answer(ctx, prompt, None, chat=False))


async def _embeddings(request: Request, ctx: ServingContext, inputs: list[str], truncate: bool, body) -> Response:
    prompts = [ctx.tokenizer.encode(x) for x in inputs]
    limit = ctx.engine.max_model_len - 1
    for i, prompt in enumerate(prompts):
        if truncate:
            prompts[i] = prompt[:limit]
        else:
            ctx.max_tokens_for(len(prompt), 0, "input", "input")
    if not prompts:
        return JSONResponse(body([], prompts))
    generation = ctx.start(prompts, SamplingParams(max_tokens=0), f"ollama-embd-{uuid.uuid4().hex}", pooling=True)
    return await final_response(request, generation, lambda outputs: body(outputs, prompts))


async def embed(request: Request) -> Response:
    """POST /api/embed: one normalised embedding per input (the engine's pooler, --pooler-config).
    Raises APIError 400 for `dimensions` other than the model's, an input over the context with truncate false."""
    ctx: ServingContext = request.app.state.serving
    req = await _parse(ctx, request, OllamaEmbedRequest)
    if req.dimensions is not None and req.dimensions != ctx.engine.hidden_size:
        raise APIError(
            400, f"dimensions {req.dimensions} is not supported: this model's embeddings have {ctx.engine.hidden_size}"
        )
    start = time.perf_counter()

    def body(outputs, prompts) -> dict:
        return {
            "model": ctx.settings.model_id,
            "embeddings": [out.embedding for out in outputs],
            "total_duration": int((time.perf_counter() - start) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": sum(len(p) for p in prompts),
        }

    return await _embeddings(request, ctx, [req.input] if isinstance(req.input, str) else req.input, req.truncate, body)


async def embeddings(request: Request) -> Response:
    """POST /api/embeddings (Ollama's older route): `{"embedding": [...]}` of one prompt."""
    ctx: ServingContext = request.app.state.serving
    req = await _parse(ctx, request, OllamaEmbeddingsRequest)
    return await _embeddings(request, ctx, [req.prompt], True, lambda outputs, _: {"embedding": outputs[0].embedding})


def _model_entry(ctx: ServingContext) -> dict:
    """The served model as /api/tags and /api/ps list it."""
    d = ctx.engine.details
    path = ctx.engine.model_dir
    files = [path] if os.path.isfile(path) else [os.path.join(path, f) for f in os.listdir(path)]
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    modified = max((os.path.getmtime(f) for f in files if os.path.isfile(f)), default=0.0)
    name = ctx.settings.model_id
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(modified, timezone.utc).isoformat().replace("+00:00", "Z"),
        "size": size,
        "digest": hashlib.sha256(f"{path}:{size}:{modified}".encode()).hexdigest(),  # the file's identity
        "details": {
            "parent_model": "",
            "format": d.file_format,
            "family": d.architecture,
            "families": [d.architecture],
            "parameter_size": _human(d.num_parameters),
            "quantization_level": d.quantization,
        },
    }


def _human(n: int) -> str:
    """A parameter count as Ollama writes it: 135M, 1.2B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + unit
    return str(n)


async def tags(request: Request) -> Response:
    """GET /api/tags: the models this server has (the one it serves)."""
    return JSONResponse({"models": [_model_entry(request.app.state.serving)]})


async def ps(request: Request) -> Response:
    """GET /api/ps: the loaded models (the one served, with its weights and KV cache in `size`)."""
    ctx: ServingContext = request.app.state.serving
    entry = _model_entry(ctx)
    d = ctx.engine.details
    size = sum(d.weight_formats.values()) + d.kv_cache_bytes
    entry |= {
        "size": size,
        "size_vram": size if ctx.engine.device.type == "cuda" else 0,
        "expires_at": FAR_FUTURE,
        "context_length": ctx.engine.max_model_len,
    }
    return JSONResponse({"models": [entry]})


async def show(request: Request) -> Response:
    """POST /api/show: the model's details, chat template, parameters and capabilities."""
    ctx: ServingContext = request.app.state.serving
    await _parse(ctx, request, OllamaShowRequest)
    entry, d = _model_entry(ctx), ctx.engine.details
    capabilities = ["completion", "embedding"]
    if ctx.settings.enable_auto_tool_choice:
        capabilities.append("tools")
    if ctx.settings.reasoning_parser:
        capabilities.append("thinking")
    arch = d.architecture
    return JSONResponse(
        {
            "modelfile": f"FROM {ctx.engine.model_dir}\n",
            "parameters": "",
            "template": getattr(ctx.tokenizer, "chat_template", None) or "",
            "details": entry["details"],
            "model_info": {
                "general.architecture": arch,
                "general.parameter_count": d.num_parameters,
                f"{arch}.context_length": ctx.engine.max_model_len,
                f"{arch}.embedding_length": ctx.engine.hidden_size,
            },
            "capabilities": capabilities,
            "modified_at": entry["modified_at"],
        }
    )


async def version(request: Request) -> Response:
    """GET /api/version."""
    return JSONResponse({"version": OLLAMA_VERSION})


# the request model of each route with a body, for /openapi.json
OLLAMA_BODIES = {
    "/api/chat": OllamaChatRequest,
    "/api/generate": OllamaGenerateRequest,
    "/api/embed": OllamaEmbedRequest,
    "/api/embeddings": OllamaEmbeddingsRequest,
    "/api/show": OllamaShowRequest,
}


def ollama_routes() -> list:
    """Starlette routes of Ollama's API."""
    from starlette.routing import Route

    return [
        Route("/api/chat", chat, methods=["POST"]),
        Route("/api/generate", generate, methods=["POST"]),
        Route("/api/embed", embed, methods=["POST"]),
        Route("/api/embeddings", embeddings, methods=["POST"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/api/ps", ps, methods=["GET"]),
        Route("/api/show", show, methods=["POST"]),
        Route("/api/version", version, methods=["GET"]),
    ]
