"""A small vLLM-style inference engine: paged KV cache, continuous batching, Llama-family models.

The public names below load on first use (PEP 562), so importing a light module of the package
(`engine.config`, `engine.sampling_params`) does not import torch or transformers.
"""

import importlib

_EXPORTS = {
    "EngineConfig": "engine.config",
    "StructuredOutputsConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "EngineStats": "engine.outputs",
    "LLM": "engine.llm",
    "AsyncEngine": "engine.async_engine",
    "EngineStepError": "engine.async_engine",
    "KVTransferError": "engine.async_engine",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
