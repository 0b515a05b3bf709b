"""What a router in front of several engines asks of each one (vllm-router; also SGLang's router):
vLLM's render endpoints (a request's prompt token ids, for prefix-aware routing without a /tokenize
round trip), the engine's load, and its serving facts."""

import dataclasses

from starlette.requests import Request
from starlette.responses import Response

from api.errors import JSONResponse
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.serving import ServingContext
from api.serving_chat import prepare_chat
from api.serving_completions import prepare_completion


def _generate_request(ctx: ServingContext, request_id: str, token_ids: list[int], params, stream: bool) -> dict:
    """vLLM's GenerateRequest: what the engine would run for one prompt."""
    return {
        "request_id": request_id,
        "model": ctx.settings.model_id,
        "token_ids": token_ids,
        "sampling_params": dataclasses.asdict(params),
        "stream": stream,
    }


async def render_completion(request: Request) -> Response:
    """POST /v1/completions/render: a completions body -> a list of GenerateRequest, one per prompt
    (vLLM's shape), nothing generated. Raises APIError 400/404 as /v1/completions would."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, CompletionRequest)
    prompts, params = prepare_completion(ctx, req)
    request_id = request.headers.get("x-request-id", "render")
    return JSONResponse(
        [_generate_request(ctx, f"cmpl-{request_id}-{i}", p, params, req.stream) for i, p in enumerate(prompts)]
    )


async def render_chat_completion(request: Request) -> Response:
    """POST /v1/chat/completions/render: a chat body -> one GenerateRequest (vLLM's shape) with the
    templated prompt's token_ids. Raises APIError 400/404 as /v1/chat/completions would."""
    ctx: ServingContext = request.app.state.serving
    req = await ctx.parse(request, ChatCompletionRequest)
    prompt, params, _ = prepare_chat(ctx, req)
    request_id = request.headers.get("x-request-id", "render")
    return JSONResponse(_generate_request(ctx, f"chatcmpl-{request_id}", prompt, params, req.stream))


async def get_load(request: Request) -> Response:
    """GET /get_load: [{"dp_rank", "num_reqs" (running + waiting), "num_waiting_reqs", "num_tokens"
    (KV-cache tokens held by requests)}], the shape vllm-router's load monitor reads."""
    ctx: ServingContext = request.app.state.serving
    stats, engine = ctx.engine.stats(), ctx.engine
    tokens = round(stats.kv_cache_usage * engine.num_kv_blocks) * engine.block_size
    return JSONResponse(
        [
            {
                "dp_rank": ctx.settings.data_parallel_rank or 0,
                "num_reqs": stats.num_running + stats.num_waiting,
                "num_waiting_reqs": stats.num_waiting,
                "num_tokens": tokens,
            }
        ]
    )


async def get_server_info(request: Request) -> Response:
    """GET /get_server_info: the model, context length, KV-cache geometry and serving role."""
    ctx: ServingContext = request.app.state.serving
    engine = ctx.engine
    kv_transfer = engine.config.kv_transfer_config
    return JSONResponse(
        {
            "model_id": ctx.settings.model_id,
            "model_path": engine.model_dir,
            "max_model_len": engine.max_model_len,
            "kv_block_size": engine.block_size,
            "num_kv_blocks": engine.num_kv_blocks,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "data_parallel_rank": ctx.settings.data_parallel_rank,
            "kv_role": kv_transfer.kv_role if kv_transfer else None,
        }
    )
