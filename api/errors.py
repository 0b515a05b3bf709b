"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, and the app's handlers.

Every failure the server reports goes through `APIError`, so a client always gets the same JSON shape
and never a traceback; unexpected exceptions are logged here with theirs and answered with a plain 500.
Anthropic's routes (`/v1/messages...`) answer the same errors in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, which the anthropic SDK reads; Ollama's (`/api/...`) in
Ollama's, `{"error": "..."}`.
"""

import orjson
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

# OpenAI's `type` for each status we send.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}
# Anthropic's `type` for each status we send (its API's error types; "invalid_request_error" also covers the
# other 4xx). 503 (busy, shutting down) is what Anthropic's 529 "overloaded_error" says.
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
}
_ANTHROPIC_PATH = "/messages"


def is_anthropic_path(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes (/v1/messages and the paths under it, with or without /v1)."""
    path = path.removeprefix("/v1")
    return path == _ANTHROPIC_PATH or path.startswith(_ANTHROPIC_PATH + "/")


class JSONResponse(Response):
    """A JSON response encoded with orjson (non-str dict keys allowed, non-finite floats become null)."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


class APIError(Exception):
    """A request failure to report to the client as an OpenAI (or Anthropic) error body with HTTP `status`.

    param: the request field at fault (None when no single field is); code: OpenAI's machine-readable code.
    headers: extra response headers, e.g. Retry-After for 503.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        """The `{"error": {...}}` body, also used as an SSE event when a stream fails after it started."""
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        """The body in Anthropic's shape (no param or code: Anthropic's has none), also used as the `error`
        event when a Messages stream fails after it started."""
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_ERROR_TYPES.get(self.status, "api_error"), "message": self.message},
        }

    def ollama_body(self) -> dict:
        """The body in Ollama's shape, `{"error": "..."}`, also the last line of an Ollama stream that fails."""
        return {"error": self.message}

    def response(self, path: str = "") -> JSONResponse:
        """The error response to a request for `path`: in Anthropic's shape on its routes, Ollama's on its
        (/api/...), OpenAI's elsewhere."""
        body = (
            self.anthropic_body()
            if is_anthropic_path(path)
            else self.ollama_body()
            if path.startswith("/api/")
            else self.body()
        )
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def from_validation_error(exc: ValidationError) -> APIError:
    """A 400 whose `param` is the top-level request field of the first problem pydantic found."""
    errors = exc.errors(include_url=False)
    loc = errors[0]["loc"] if errors else ()
    # A union field fails once per member, so a few problems are listed to show what was expected.
    problems = dict.fromkeys(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:4])
    return APIError(400, "; ".join(problems) or str(exc), param=str(loc[0]) if loc else None)


async def handle_api_error(request: Request, exc: APIError) -> Response:
    return exc.response(request.url.path)


async def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown route, wrong method) in OpenAI's (or Anthropic's) shape."""
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=exc.headers).response(request.url.path)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    """Last resort: answer without the traceback (Starlette re-raises the exception afterwards, and
    uvicorn logs it with its traceback)."""
    return APIError(500, "internal server error; the server log has the details").response(request.url.path)
