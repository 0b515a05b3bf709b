"""OpenAI-compatible HTTP server for the engine: Starlette app, request models, SSE streaming, metrics."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("minivllm")
except PackageNotFoundError:  # a source checkout that was not pip-installed
    __version__ = "unknown"
