"""Schemathesis hooks for scripts/fuzz.py (loaded through SCHEMATHESIS_HOOKS): every error response
must carry OpenAI's error body."""
import schemathesis


@schemathesis.check
def openai_error_body(ctx, response, case):
    """A 4xx/5xx answer is JSON {"error": {"message": str, "type": str, "param", "code"}}."""
    if response.status_code < 400:
        return None
    try:
        error = response.json()["error"]
    except Exception:
        raise AssertionError(f"{response.status_code} without OpenAI's error body: {response.text[:200]!r}")
    if not (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and {"param", "code"} <= error.keys()):
        raise AssertionError(f"{response.status_code} with a malformed error body: {error!r}")
    return None
