"""Plain ASGI middleware (so SSE streams pass through untouched): `--api-key` and the body size limit."""

import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import APIError

# Probes, scrapers and the API's description must work without the key, as in vLLM; so must the
# dashboard's page and static files, which hold no data (its feed, /dashboard/events, needs the key:
# api/dashboard.py).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/dashboard"})
OPEN_PREFIXES = ("/docs/static/", "/dashboard/static/")


class APIKeyMiddleware:
    """Answers 401 unless the request carries `Authorization: Bearer <api_key>` (OpenAI's clients) or
    `x-api-key: <api_key>` (Anthropic's); OPEN_PATHS and paths under OPEN_PREFIXES are exempt."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES):
            headers = dict(scope["headers"])
            # both compared, so the time taken does not tell which header was close
            bearer_ok = secrets.compare_digest(headers.get(b"authorization", b""), self._bearer)
            key_ok = secrets.compare_digest(headers.get(b"x-api-key", b""), self._key)
            if not (bearer_ok or key_ok):
                response = APIError(
                    401,
                    "Invalid or missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
                    code="invalid_api_key",
                ).response(path)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 for a request body over `max_bytes`: at once when Content-Length says so, else (a
    chunked body) as soon as the bytes read pass it, by raising APIError from `receive`."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"request body larger than {self.max_bytes} bytes", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large().response(scope["path"])(scope, receive, send)
        total = 0

        async def limited_receive() -> Message:
            nonlocal total
            message = await receive()
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)
