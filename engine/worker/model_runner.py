"""Owns the model and its KV cache on one device; turns a scheduled batch into tokens."""
import logging
import os

import torch

from models.attention import make_backend
from models.attention.base import AttentionMetadata
from engine.config import EngineConfig
from engine.core.step_io import ModelRunnerOutput, SchedulerOutput
from models.distributed.group import TPGroup
from engine.sample import prompt_logprobs
from engine.sample.rejection_sampler import RejectionSampler
from engine.worker import host_memory, pooler
from engine.worker.cuda_graph import CUDAGraphRunner
from engine.worker.input_batch import InputBatch, ModelInputs, prepare_inputs
from models.registry import get_model_class
from models.config import ModelShape
from models.kernels import cpu_kernels
from models.quantization.gguf import GGUFConfig, weight_summary
from models.gguf import is_gguf
from models.loader import iter_weights

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Loads the model on `device`, allocates the paged KV cache, and executes scheduled batches.

    Built in two phases, as vLLM's workers are: the constructor loads the weights; the executor then
    asks how many KV blocks fit (`available_kv_blocks`; ranks agree on the smallest) and calls
    `init_kv_cache`. The KV cache is one tensor [num_layers, 2, *backend.kv_cache_shape(num_blocks)]
    in the model dtype (a block's K/V in each layer is contiguous, in the backend's layout).
    `max_model_len` is capped by what the cache holds, so a request can always run alone and nothing
    deadlocks. The runner reads the scheduler's requests and never changes them.

    With `tp` (tensor parallelism, engine/executor) this runner is one rank: it holds its shard of the
    model and the KV cache of its heads.
    """

    def __init__(self, config: EngineConfig, hf_config, model_dir: str, device: torch.device,
                 tp: TPGroup | None = None):
        self.config, self.device = config, device
        if config.dtype == "auto":
            self.dtype, why = auto_dtype(self.device)
            logger.info("dtype %s (auto: %s; --dtype overrides)", str(self.dtype).removeprefix("torch."), why)
        else:
            self.dtype = DTYPES[config.dtype]
        torch.manual_seed(config.seed)
        self.block_size = config.block_size
        self.shape = ModelShape.from_hf(hf_config, tp.world_size if tp is not None else 1)
        self.max_model_len = min(config.max_model_len or self.shape.max_position_embeddings,
                                 self.shape.max_position_embeddings)
        self.backend = make_backend(config.attention_backend, self.device, self.dtype, self.shape, self.block_size)
        cls, kwargs = get_model_class(hf_config)
        quant_config = self._quant_config(model_dir, tp)
        with torch.device("meta"):  # no random init (0.8 s for 135M parameters): the checkpoint fills all
            model = cls(hf_config, self.shape, self.backend, self.max_model_len, tp=tp, quant_config=quant_config,
                        **kwargs)
        self.model = materialize(model, self.device, self.dtype)
        self.model.load_weights(iter_weights(model_dir, quantized=quant_config is not None))
        self.model.eval()
        self.weight_bytes, summary = weight_summary(self.model)
        logger.info("weights: %s", summary)
        self.sampler = RejectionSampler()  # without drafts it draws what plain sampling draws
        self.num_blocks = 0
        self.kv_cache = self.kv_caches = self.graphs = None

    def _quant_config(self, model_path: str, tp: TPGroup | None) -> GGUFConfig | None:
        """GGUFConfig when a .gguf model's quantized weights stay in their blocks (the default on the CPU in
        one process), None for float weights (other checkpoints; GGUF files on CUDA, with float16 or under
        tensor parallelism, dequantized at load, unless quantization "gguf" asks otherwise: ValueError)."""
        wanted = self.config.quantization
        if not is_gguf(model_path):
            if wanted == "gguf":
                raise ValueError(f"quantization gguf needs a .gguf model, got {model_path}")
            return None
        if wanted == "none":
            return None
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16) or tp is not None:
            if wanted is None:  # the default: dequantize where the kernels do not run
                return None
            raise ValueError(f"quantization gguf computes in one process on the CPU with float32 or bfloat16 "
                             f"activations, not {self.device.type} {self.dtype}; use --quantization none to "
                             f"dequantize at load")
        if cpu_kernels.load() is None:
            logger.warning("no C compiler for the GGUF kernels: dequantizing the weights to %s at load", self.dtype)
            return None
        return GGUFConfig()

    def init_kv_cache(self, num_blocks: int, cuda_graphs: bool) -> None:
        """Allocates `num_blocks` KV blocks and caps max_model_len to what they hold; with
        `cuda_graphs` (and a backend whose decode can be captured) captures the decode graphs."""
        self.num_blocks = num_blocks
        capacity = num_blocks * self.block_size
        if self.max_model_len > capacity:
            log = logger.warning if self.config.max_model_len else logger.info
            log("max_model_len %d capped to %d tokens, what the KV cache holds", self.max_model_len, capacity)
            self.max_model_len = capacity
        # Graphs only where the backend's decode is graph-safe: torch_native would be captured gathering
        # every row at full max_model_len, which costs memory in proportion to it.
        use_graphs = cuda_graphs and self.backend.supports_cuda_graphs
        # With CUDA graphs one extra block, owned by no sequence, takes the padded rows' K/V.
        shape = (self.shape.num_layers, 2, *self.backend.kv_cache_shape(num_blocks + use_graphs))
        self.kv_cache = host_memory.zeros(shape, self.dtype) if self.device.type == "cpu" else \
            torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        if use_graphs:
            self.graphs = CUDAGraphRunner(self.model, self.backend, self.kv_caches, self.config.max_num_seqs,
                                          max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                                          block_size=self.block_size, dummy_block=num_blocks)
            self.graphs.capture()

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V for one block over all layers (this rank's heads)."""
        return 2 * self.shape.num_layers * self.block_size * self.shape.num_kv_heads * self.shape.head_dim \
            * self.dtype.itemsize

    def available_kv_blocks(self, kv_cache_memory: int) -> int:
        """KV blocks that fit this rank's budget: `kv_cache_memory` bytes on the CPU; on CUDA what
        gpu_memory_utilization leaves after the weights and a profiled forward. Raises ValueError
        below one block."""
        budget = self._profile_cuda_budget() if self.device.type == "cuda" else kv_cache_memory
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes is below one block ({self.block_bytes} bytes)")
        return num_blocks

    def _profile_cuda_budget(self) -> int:
        """Bytes left for the KV cache: gpu_memory_utilization of the GPU minus weights and the peak
        activations of a forward over max_num_batched_tokens tokens (measured with a tiny cache)."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        kv = torch.zeros(self.shape.num_layers, 2, *self.backend.kv_cache_shape(blocks), dtype=self.dtype, device=self.device)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.arange(n, dtype=torch.int64, device=self.device),
            num_decodes=0, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            self.backend.plan(meta)
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device), [(l[0], l[1]) for l in kv], meta)
            self.model.compute_logits(hidden[-self.config.max_num_seqs:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del kv, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        # CUDA graphs are captured after the cache exists: keep room for their pool and buffers
        graph_reserve = 1 << 30 if self.backend.supports_cuda_graphs and not self.config.enforce_eager else 0
        return int(total * self.config.gpu_memory_utilization) - peak - graph_reserve

    @torch.inference_mode()  # the sampler masks the logits (inference tensors) in place
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step on this process alone: inputs, forward, sampling."""
        batch = prepare_inputs(scheduler_output, self.block_size, self.device)
        return self.sample(scheduler_output, batch, self.forward(batch.model_inputs, batch))

    def compute_logits(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor | None, list]:
        """The step's forward alone (a draft model's proposals): (float32 CPU logits [N, vocab] at the
        sampled rows, None when N is 0; the sequences that sample, in logits order)."""
        batch = prepare_inputs(scheduler_output, self.block_size, self.device)
        logits, _ = self.forward(batch.model_inputs)
        return (logits.cpu() if logits is not None else None), batch.sampled

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, batch: InputBatch | None = None) \
            -> tuple[torch.Tensor | None, ModelRunnerOutput]:
        """The forward pass of one step (what every tensor-parallel rank runs): float32 logits [N, vocab]
        of the rows at logits_indices (None when N is 0 and on ranks other than 0), and, given rank 0's
        `batch`, the output of everything but sampling: prompt logprobs and pooled hidden states."""
        meta = inputs.attn_metadata
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, meta)  # plans for the padded batch itself
        else:
            self.backend.plan(meta)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
        out = ModelRunnerOutput()
        if batch is not None and batch.prompt_rows:
            out.prompt_logprobs = prompt_logprobs.collect(self.model, hidden, batch.prompt_rows)
        if batch is not None and batch.pooling_rows:
            out.pooler_output = pooler.pool(hidden, batch.pooling_rows, self.config.pooler_config.pooling_type)
        if inputs.logits_indices.shape[0] == 0:
            return None, out
        return self.model.compute_logits(hidden[inputs.logits_indices]), out

    @torch.inference_mode()
    def sample(self, scheduler_output: SchedulerOutput, batch: InputBatch,
               forward_output: tuple[torch.Tensor | None, ModelRunnerOutput]) -> ModelRunnerOutput:
        """Rank 0: turns the forward's logits into each sampling request's new tokens (one, or with
        drafts the accepted ones and one more: see RejectionSampler), masked by the step's grammars."""
        logits, out = forward_output
        if logits is None:
            return out
        rows = scheduler_output.structured_rows
        grammar_rows = [i for i, r in enumerate(batch.sampled) if r.request_id in rows]
        bitmask = scheduler_output.grammar_bitmask[[rows[batch.sampled[i].request_id] for i in grammar_rows]] \
            if grammar_rows else None
        out.sampled_token_ids, out.logprobs = self.sampler(logits.cpu(), batch.sampled, bitmask, grammar_rows)
        out.req_ids = [r.request_id for r in batch.sampled]
        return out


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A model built on the meta device with its parameters and buffers made uninitialised tensors on
    `device`, floating ones in `dtype`: what `model.to_empty(device).to(dtype)` does, but through
    torch.empty. to_empty's empty_like on a meta tensor runs torch's reference decompositions, whose first
    use imports sympy: 0.5 s of every start-up. Returns `model`."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(empty(p), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, empty(b))
    return model


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """The model dtype for dtype "auto", and why: bfloat16 on CUDA, and on a CPU with native bfloat16
    arithmetic (AVX512-BF16 or AMX, vLLM-CPU's rule); float32 on other CPUs, where bfloat16 would be
    emulated and slower."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if native:
        return torch.bfloat16, f"the CPU has {' and '.join(native)}"
    return torch.float32, "the CPU has neither AVX512-BF16 nor AMX"
