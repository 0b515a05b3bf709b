"""Schemathesis hooks for scripts/fuzz.py (loaded through SCHEMATHESIS_HOOKS): every error response
must carry OpenAI's error body (Anthropic's on Anthropic's routes)."""

import schemathesis


@schemathesis.check
def openai_error_body(ctx, response, case):
    """A 4xx/5xx answer is JSON {"error": {"message": str, "type": str, "param", "code"}}; on Anthropic's
    routes (/v1/messages...) it is {"type": "error", "error": {"type": str, "message": str}}; on Ollama's
    (/api/...) {"error": str}."""
    if response.status_code < 400:
        return None
    anthropic = case is not None and case.path.startswith("/v1/messages")
    try:
        body = response.json()
        error = body["error"]
    except Exception:
        raise AssertionError(f"{response.status_code} without an error body: {response.text[:200]!r}")
    if case is not None and case.path.startswith("/api/"):
        if set(body) != {"error"} or not isinstance(error, str):
            raise AssertionError(f"{response.status_code} with a malformed Ollama error body: {body!r}")
        return None
    if not (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and (body.get("type") == "error" if anthropic else {"param", "code"} <= error.keys())
    ):
        raise AssertionError(f"{response.status_code} with a malformed error body: {body!r}")
    return None
