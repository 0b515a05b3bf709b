"""The Starlette app: routes, middleware, error handlers, and a lifespan that runs the engine loop."""

import contextlib
import dataclasses
import logging

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api import __version__
from api.dashboard import DashboardFeed, dashboard_routes
from api.drain import DrainMiddleware
from api.errors import APIError, JSONResponse, handle_api_error, handle_http_exception, handle_unexpected
from api.middleware import APIKeyMiddleware, BodyLimitMiddleware
from api.openapi import docs_routes, openapi_document
from api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest
from api.protocol_anthropic import CountTokensRequest, MessagesRequest
from api.protocol_responses import ResponsesRequest
from api.protocol_score import RerankRequest, ScoreRequest
from api.serving import ServingContext
from api.serving_chat import create_chat_completion
from api.serving_completions import create_completion
from api.serving_embeddings import create_embedding
from api.serving_messages import count_message_tokens, create_message
from api.serving_ollama import OLLAMA_BODIES, ollama_routes
from api.serving_responses import create_response
from api.serving_router import get_load, get_server_info, render_chat_completion, render_completion
from api.serving_score import rerank, score
from api.serving_tokenize import apply_template, detokenize, tokenize
from api.settings import ServerSettings
from api.tool_parsers import detect_tool_parser

logger = logging.getLogger("api")


async def list_models(request: Request) -> Response:
    """The served model, once per name it answers to (OpenAI's model list, as vLLM lists its served names)."""
    ctx: ServingContext = request.app.state.serving
    models = [
        {
            "id": name,
            "object": "model",
            "created": ctx.created,
            # "vllm" as vLLM reports it, for clients that expect its /v1/models.
            "owned_by": "vllm",
            "root": ctx.engine.model_name,
            "parent": None,
            "max_model_len": ctx.engine.max_model_len,
        }
        for name in ctx.settings.model_names
    ]
    return JSONResponse({"object": "list", "data": models})


async def health(request: Request) -> Response:
    """200 while the engine loop runs, 503 otherwise."""
    alive = request.app.state.serving.engine.is_alive
    return Response(status_code=200 if alive else 503)


async def version(request: Request) -> Response:
    """The server's version."""
    return JSONResponse({"version": __version__})


async def metrics(request: Request) -> Response:
    """Prometheus metrics, under vLLM's names."""
    return Response(request.app.state.serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def with_detected_tool_parser(settings: ServerSettings, tokenizer_template: str | None) -> ServerSettings:
    """`settings` with tool_choice "auto" on when no --tool-call-parser was given and the chat template (the
    --chat-template file, else the tokenizer's) asks the model for calls of a format a parser reads, as
    llama.cpp picks its format from the template; logged either way. An explicit --tool-call-parser wins."""
    if settings.tool_call_parser is not None:
        return settings
    parser = detect_tool_parser(settings.chat_template or tokenizer_template)
    if parser is None:
        logger.info("tools: the chat template has no tool-call format; tool_choice auto needs --tool-call-parser")
        return settings
    logger.info(
        "tools: the chat template writes %s tool calls; tool_choice auto on (--tool-call-parser overrides)", parser
    )
    return dataclasses.replace(settings, enable_auto_tool_choice=True, tool_call_parser=parser)


def build_app(engine, settings: ServerSettings) -> Starlette:
    """The app serving `engine` (an AsyncEngine, not yet started): the lifespan starts its step loop
    on the server's event loop and shuts it down (aborting what still runs) when the server stops. The API's
    model ids are `settings.served_model_name`, else the engine's model name."""
    if settings.model_id is None:
        settings = dataclasses.replace(settings, served_model_name=[engine.model_name])
    settings = with_detected_tool_parser(settings, getattr(engine.tokenizer, "chat_template", None))
    ctx = ServingContext(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.start()
        try:
            yield
        finally:
            if engine.is_alive:
                await engine.shutdown()

    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/embeddings", create_embedding, methods=["POST"]),
        Route("/v1/rerank", rerank, methods=["POST"]),
        Route("/v1/score", score, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_message_tokens, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/apply-template", apply_template, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/completions/render", render_completion, methods=["POST"]),
        Route("/v1/chat/completions/render", render_chat_completion, methods=["POST"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
    ]
    # the OpenAI and Anthropic routes also without /v1, as llama.cpp's server answers them (left out of the
    # OpenAPI document: the same operations)
    routes += [
        Route(r.path.removeprefix("/v1"), r.endpoint, methods=list(r.methods - {"HEAD"}), include_in_schema=False)
        for r in list(routes)
        if r.path.startswith("/v1/") and not r.path.endswith("/render")
    ]
    # Cohere's v2 client posts to /v2/rerank (vLLM answers it too)
    routes.append(Route("/v2/rerank", rerank, methods=["POST"], include_in_schema=False))
    routes += ollama_routes()
    if settings.enable_dashboard:
        routes += dashboard_routes()
    bodies = {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/embeddings": EmbeddingRequest,
        "/v1/rerank": RerankRequest,
        "/v1/score": ScoreRequest,
        "/v1/responses": ResponsesRequest,
        "/v1/messages": MessagesRequest,
        "/v1/messages/count_tokens": CountTokensRequest,
        "/tokenize": TokenizeRequest,
        "/detokenize": DetokenizeRequest,
        "/apply-template": ChatCompletionRequest,
    } | OLLAMA_BODIES
    routes += docs_routes(openapi_document(routes, bodies, "minivllm OpenAI-compatible API", __version__))
    middleware = [
        Middleware(DrainMiddleware, drain=ctx.drain),
        Middleware(BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes),
    ]
    if settings.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=settings.api_key))
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: handle_http_exception,
            Exception: handle_unexpected,
        },
    )
    app.state.serving = ctx
    app.state.dashboard = DashboardFeed(ctx) if settings.enable_dashboard else None
    return app
