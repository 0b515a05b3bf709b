"""A small vLLM-style inference engine: paged KV cache, continuous batching, Llama-family models."""
from engine.async_engine import AsyncEngine, EngineStepError, KVTransferError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputsConfig, StructuredOutputsParams

__all__ = ["EngineConfig", "SamplingParams", "StructuredOutputsParams", "StructuredOutputsConfig", "RequestOutput",
           "CompletionOutput", "Logprob", "EngineStats", "LLM", "AsyncEngine", "EngineStepError", "KVTransferError"]
