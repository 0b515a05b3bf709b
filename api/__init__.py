"""OpenAI-compatible HTTP server for the engine: Starlette app, request models, SSE streaming, metrics."""

__version__ = "0.1.0"
