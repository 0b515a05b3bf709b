"""Owns the model and its KV cache on one device; turns a scheduled batch into tensors and tokens."""
import glob
import logging
import os

import numpy as np
import torch
from safetensors import safe_open

from engine.attention import make_backend
from engine.attention.base import AttentionMetadata
from engine.attention.flashinfer import FlashInferBackend  # imports without flashinfer installed
from engine import host_memory, prompt_logprobs
from engine.config import EngineConfig
from engine.cuda_graph import CUDAGraphRunner
from engine.distributed.group import TPGroup
from engine.distributed.layers import partition_heads
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.spec_decode.rejection_sampler import RejectionSampler
from models import get_model_class
from models.llama import head_dim_of

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Loads the model, allocates the paged KV cache, and executes scheduled batches.

    The KV cache is one tensor [num_layers, 2, *backend.kv_cache_shape(num_blocks)] in the model
    dtype (a block's K/V in each layer is contiguous, in the backend's layout); its size comes from
    `kv_cache_memory` bytes on CPU and from `gpu_memory_utilization` on CUDA. `max_model_len` is capped by what the cache holds, so a
    request can always run alone and nothing deadlocks.

    With `tp` (tensor parallelism, engine/distributed) this runner is one rank: it holds its shard of
    the model and the KV cache of its heads, and rank 0 broadcasts each step's inputs to the others.
    """

    def __init__(self, config: EngineConfig, hf_config, model_dir: str, tp: TPGroup | None = None,
                 num_blocks: int | None = None):
        self.config = config
        self.tp = tp
        world = tp.world_size if tp else 1
        default_device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = tp.device if tp else torch.device(default_device)
        if config.dtype == "auto":
            self.dtype, why = auto_dtype(self.device)
            logger.info("dtype %s (auto: %s; --dtype overrides)", str(self.dtype).removeprefix("torch."), why)
        else:
            self.dtype = DTYPES[config.dtype]
        if self.device.type == "cpu":  # ranks share the cores
            torch.set_num_threads(config.num_threads or max(1, os.cpu_count() // world))
        torch.manual_seed(config.seed)
        self.block_size = config.block_size
        self.num_layers = hf_config.num_hidden_layers
        _, self.num_kv_heads = partition_heads(hf_config, world)  # this rank's
        self.head_dim = head_dim_of(hf_config)
        model_limit = getattr(hf_config, "max_position_embeddings", None) or 1 << 20
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)
        self.backend = make_backend(config.attention_backend, self.device, self.dtype, hf_config, self.block_size,
                                    world)
        cls, kwargs = get_model_class(hf_config)
        with torch.device("meta"):  # no random init (0.8 s for 135M parameters): the checkpoint fills all
            model = cls(hf_config, self.backend, self.max_model_len, tp=tp, **kwargs)
        self.model = model.to_empty(device=self.device).to(self.dtype)
        self.model.load_weights(_iter_safetensors(model_dir))
        self.model.eval()
        # a draft model's runner gets `num_blocks`: as many as the target's
        self.num_blocks = num_blocks or (self._num_kv_blocks() if tp is None else tp.min(self._num_kv_blocks()))
        capacity = self.num_blocks * self.block_size
        if self.max_model_len > capacity:
            log = logger.warning if config.max_model_len else logger.info
            log("max_model_len %d capped to %d tokens, what the KV cache holds", self.max_model_len, capacity)
            self.max_model_len = capacity
        # Graphs only with FlashInfer's graph-safe decode: torch_native would be captured gathering
        # every row at full max_model_len, which costs memory in proportion to it.
        # Not with tensor parallelism: its collectives would have to be captured too.
        use_graphs = isinstance(self.backend, FlashInferBackend) and not config.enforce_eager and tp is None
        # With CUDA graphs one extra block, owned by no sequence, takes the padded rows' K/V.
        shape = (self.num_layers, 2, *self.backend.kv_cache_shape(self.num_blocks + use_graphs))
        self.kv_cache = host_memory.zeros(shape, self.dtype) if self.device.type == "cpu" else \
            torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.graphs = None
        if use_graphs:
            self.graphs = CUDAGraphRunner(self.model, self.backend, self.kv_caches, config.max_num_seqs,
                                          max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                                          block_size=self.block_size, dummy_block=self.num_blocks)
            self.graphs.capture()

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V for one block over all layers."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def _num_kv_blocks(self) -> int:
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:  # the ranks share the machine's memory: kv_cache_memory is for all of them
            budget = self.config.kv_cache_memory // (self.tp.world_size if self.tp else 1)
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes is below one block ({self.block_bytes} bytes)")
        return num_blocks

    def _profile_cuda_budget(self) -> int:
        """Bytes left for the KV cache: gpu_memory_utilization of the GPU minus weights and the peak
        activations of a forward over max_num_batched_tokens tokens (measured with a tiny cache)."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        kv = torch.zeros(self.num_layers, 2, *self.backend.kv_cache_shape(blocks), dtype=self.dtype, device=self.device)
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
        graph_reserve = 1 << 30 if isinstance(self.backend, FlashInferBackend) and not self.config.enforce_eager else 0
        return int(total * self.config.gpu_memory_utilization) - peak - graph_reserve

    def prepare(self, batch: SchedulerOutput, block_tables: list[list[int]]):
        """Builds the step's flat input tensors and attention metadata.

        Rows with one new token (decodes) go first, as the attention backends want. Returns
        (input_ids int64 [T], positions int64 [T], meta, logits_indices int64 [N], sampled requests,
        prompt-logprob rows): a request is sampled when its new tokens reach its last token (unless it
        is prompt-only, max_tokens 0). A row that goes on past it into d draft tokens (`spec_token_ids`)
        gets logits at its last 1 + d positions, so N >= the number of sampled requests.
        """
        order = sorted(range(len(batch.requests)), key=lambda i: batch.num_new_tokens[i] != 1)
        reqs = [batch.requests[i] for i in order]
        counts = np.array([batch.num_new_tokens[i] for i in order], dtype=np.int64)
        tables = [block_tables[i] for i in order]
        starts = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        seq_lens = starts + counts
        qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        # position of every token: its row's start + its rank inside the row
        row_of_token = np.repeat(np.arange(len(reqs)), counts)
        positions = starts[row_of_token] + np.arange(qsl[-1]) - qsl[row_of_token]
        input_ids = np.concatenate([_new_token_ids(r, s, e) for r, s, e in zip(reqs, starts, seq_lens)])
        max_blocks = max(len(t) for t in tables)
        bt = np.zeros((len(reqs), max_blocks), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        bs = self.block_size
        slots = bt[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        num_drafts = seq_lens - np.array([r.num_tokens for r in reqs], dtype=np.int64)  # -k: still prefilling
        sampled = np.flatnonzero((num_drafts >= 0) & np.array([r.params.max_tokens != 0 for r in reqs], dtype=bool))
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(bt).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            num_decodes=int((counts == 1).sum()),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist())
        # the last 1 + d tokens of each sampled row: row end - width + rank inside the row
        widths = num_drafts[sampled] + 1
        rank = np.arange(widths.sum()) - np.repeat(np.cumsum(widths) - widths, widths)
        logits_indices = torch.from_numpy(np.repeat(qsl[1:][sampled] - widths, widths) + rank).to(dev)
        return (torch.from_numpy(input_ids.astype(np.int64)).to(dev), torch.from_numpy(positions).to(dev),
                meta, logits_indices, [reqs[i] for i in sampled],
                prompt_logprobs.select_rows(reqs, starts, counts, qsl))

    @torch.inference_mode()  # the samplers mask the logits (inference tensors) in place
    def execute(self, batch: SchedulerOutput, block_tables: list[list[int]]):
        """Runs one step. Returns (requests that sampled, their new token ids, their Logprob|None):
        one token per request, or with drafts the accepted ones and one more (see RejectionSampler)."""
        logits, sampled = self.compute_logits(batch, block_tables)
        if not sampled:
            return [], [], []
        if any(r.spec_token_ids for r in sampled):
            return sampled, *self.rejection_sampler(logits, sampled)
        tokens, logprobs = self.sampler(logits, sampled)
        return sampled, [[t] for t in tokens], [[lp] for lp in logprobs]

    def compute_logits(self, batch: SchedulerOutput, block_tables: list[list[int]]):
        """The step's forward, its inputs broadcast to the other tensor-parallel ranks first. Returns
        (float32 CPU logits [N, vocab] at `prepare`'s logits_indices, or None when N is 0; the requests
        that sampled)."""
        input_ids, positions, meta, logits_indices, sampled, prompt_rows = self.prepare(batch, block_tables)
        if self.tp is not None:
            self.tp.broadcast_step(input_ids, positions, meta, logits_indices)
        logits = self.run_model(input_ids, positions, meta, logits_indices, prompt_rows)
        return (logits.cpu() if logits is not None else None), sampled

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  logits_indices: torch.Tensor, prompt_rows=()) -> torch.Tensor | None:
        """The forward pass of one step (what every tensor-parallel rank runs): float32 logits
        [N, vocab] of the rows at logits_indices; None when N is 0 and on ranks other than 0.
        `prompt_rows` (rank 0, no tensor parallelism) also collects those rows' prompt logprobs."""
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)  # plans for the padded batch itself
        else:
            self.backend.plan(meta)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if prompt_rows:
            prompt_logprobs.collect(self.model, hidden, prompt_rows)
        if logits_indices.shape[0] == 0:
            return None
        return self.model.compute_logits(hidden[logits_indices])


def _new_token_ids(request, start: int, end: int) -> list[int]:
    """Token ids at positions [start, end) of a request, its draft tokens after its last token."""
    ids = request.all_token_ids[start:end]
    if end > request.num_tokens:
        ids = ids + request.spec_token_ids[:end - request.num_tokens]
    return ids


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


def _iter_safetensors(model_dir: str):
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
