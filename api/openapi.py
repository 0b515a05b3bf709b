"""GET /openapi.json, generated from the routes and the pydantic request models (never written by hand),
and GET /docs, Swagger UI rendering it from the assets the `swagger-ui-py` package ships (the page
fetches nothing from a CDN, so it works offline)."""

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Route

from api.errors import APIError, JSONResponse, is_anthropic_path

# Status codes any route may answer with the OpenAI error body, Anthropic's and Ollama's on theirs (413 body limit,
# 415 content type and 401 with --api-key come from middleware and parsing; 503 from admission and shutdown).
_ERROR_STATUSES = {
    "400": "Invalid request",
    "401": "Missing or wrong API key (with --api-key)",
    "404": "Unknown model",
    "413": "Request body too large",
    "415": "Body not sent as `Content-Type: application/json`",
    "503": "Busy, shutting down or not ready (with Retry-After)",
}
# The only Swagger UI files the page loads.
_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every 4xx and 5xx of this server carries (but Anthropic's routes')."""

    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body, which every 4xx and 5xx of its routes (/v1/messages...) carries."""

    type: Literal["error"]
    error: AnthropicErrorInfo


class OllamaErrorResponse(BaseModel):
    """Ollama's error body, which every 4xx and 5xx of its routes (/api/...) carries."""

    error: str


def _error_body(path: str) -> type[BaseModel]:
    """The error body the route at `path` answers with."""
    if is_anthropic_path(path):
        return AnthropicErrorResponse
    return OllamaErrorResponse if path.startswith("/api/") else ErrorResponse


def openapi_document(routes: list[Route], request_bodies: dict[str, type[BaseModel]], title: str, version: str) -> dict:
    """An OpenAPI 3.1 document for `routes` (their methods, and the first docstring line of their
    endpoint as summary); `request_bodies` maps a path to the model its JSON body is validated with.
    """
    bodies = (ErrorResponse, AnthropicErrorResponse, OllamaErrorResponse)
    models = [*request_bodies.values(), *bodies]
    names, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    errors = {
        body: {
            code: {"description": text, "content": {"application/json": {"schema": names[(body, "validation")]}}}
            for code, text in _ERROR_STATUSES.items()
        }
        for body in bodies
    }
    paths: dict[str, dict] = {}
    for route in routes:
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        doc = (route.endpoint.__doc__ or "").strip()
        for method in sorted(route.methods - {"HEAD"}):
            op = {
                "summary": doc.splitlines()[0] if doc else route.path,
                "operationId": f"{method.lower()}_{route.name}",
            }
            model = request_bodies.get(route.path)
            if model is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": names[(model, "validation")]}},
                }
                op["responses"] = {
                    "200": {"description": "Success; `stream: true` answers text/event-stream"}
                } | errors[_error_body(route.path)]
            else:
                op["responses"] = {"200": {"description": "Success"}}
            paths.setdefault(route.path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }


def docs_routes(document: dict) -> list[Route]:
    """/openapi.json, /docs and the Swagger UI assets under /docs/static/."""
    static = _swagger_ui_static()
    page = _PAGE.replace("TITLE", document["info"]["title"])

    async def openapi_json(request: Request) -> Response:
        """The OpenAPI document of this server."""
        return JSONResponse(document)

    async def docs(request: Request) -> Response:
        """Interactive API documentation (Swagger UI)."""
        return HTMLResponse(page)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _ASSETS:
            raise APIError(404, f"Invalid URL (GET {request.url.path})")
        return FileResponse(static / name, media_type=_ASSETS[name])

    return [
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", docs, methods=["GET"]),
        Route("/docs/static/{name}", asset, methods=["GET"], include_in_schema=False),
    ]


def _swagger_ui_static() -> Path:
    """The swagger-ui-py package's asset folder (located, not imported: its handlers are not needed).

    Raises FileNotFoundError with the install command when the package is missing."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("/docs needs the swagger-ui-py package: pip install swagger-ui-py")
    return Path(spec.origin).parent / "static"


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>TITLE - Swagger UI</title>
<link rel="icon" type="image/png" href="/docs/static/favicon-32x32.png">
<link rel="stylesheet" href="/docs/static/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/static/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui", deepLinking: true});
</script>
</body>
</html>
"""
