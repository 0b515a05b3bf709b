"""Owns the model and its KV cache on one device, and every request the step runs (its InputBatch); turns a
SchedulerOutput into tokens."""

import dataclasses
import logging
import math
import os

import torch

from engine.config import EngineConfig
from engine.core.kv_cache_spec import kv_cache_groups, max_request_tokens
from engine.core.step_io import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from engine.sample import prompt_logprobs
from engine.sample.rejection_sampler import RejectionSampler
from engine.spec_decode.speculator import NoSpeculation, Speculator
from engine.worker import host_memory, pooler
from engine.worker.cuda_graph import CUDAGraphRunner
from engine.worker.input_batch import InputBatch, ModelInputs, StepBatch, build_model_inputs
from models.attention import make_backends
from models.attention.base import AttentionMetadata
from models.config import ModelShape
from models.distributed.group import ParallelGroup, TPGroup
from models.distributed.pipeline import PPStage
from models.gguf import is_gguf
from models.kernels import cpu_kernels
from models.loader import load_config, load_model, resolve_model
from models.quantization.gguf import GGUFConfig, parameter_count, weight_summary

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Loads the model on `device`, allocates the paged KV cache, and executes every step.

    Built in two phases, as vLLM's workers are: the constructor loads the weights; the executor then
    asks how many KV blocks fit (`available_kv_blocks`; ranks agree on the smallest) and calls
    `init_kv_cache`. The KV cache is one tensor [group_size, 2, *backend.kv_cache_shape(num_blocks)] in the
    model dtype (a block's K/V in each layer is contiguous, in the backend's layout): the layers are in KV
    cache groups (`kv_cache_groups`, engine.core.kv_cache_spec; one group, all layers, unless a model mixes
    attention kinds), each with its own block tables, and the i-th layer of each group keeps its K/V in
    tensor i, at its group's blocks. Recurrent layers (LFM2's convolutions: the last group, `state_group`) keep
    instead a float32 state per slot in `state_cache` [layers, max_num_seqs, *model.state_shape], at the slot
    their group's table lists.
    `max_model_len` is capped by what the cache holds, so a request can always run alone and nothing
    deadlocks. The runner keeps its own copy of every request (`input_batch`, updated from each
    SchedulerOutput), so every rank builds its inputs itself; it never sees a scheduler's Request.

    With `group` (tensor and pipeline parallelism, engine/executor) this runner is one rank: it holds its
    stage's layers (`pp`), of each its shard (`tp`), and the KV cache of those layers and heads. A stage but
    the first takes the previous stage's residual stream instead of embedding the tokens, a stage but the
    last sends its own on (models/distributed/group.py). The first rank of the last stage (`is_driver`)
    samples, and drafts with speculative decoding; the others only run the forward pass.
    """

    def __init__(
        self,
        config: EngineConfig,
        hf_config,
        model_dir: str,
        device: torch.device,
        group: ParallelGroup | None = None,
    ):
        self.config, self.device = config, device
        if config.dtype == "auto":
            on_blocks = (  # a GGUF model whose weights stay in their blocks (_quant_config's default)
                device.type == "cpu"
                and config.quantization != "none"
                and (group is None or group.tp is None)
                and is_gguf(model_dir)
                and cpu_kernels.load() is not None
            )
            self.dtype, why = auto_dtype(self.device, gguf_blocks=on_blocks)
            logger.info("dtype %s (auto: %s; --dtype overrides)", str(self.dtype).removeprefix("torch."), why)
        else:
            self.dtype = DTYPES[config.dtype]
        torch.manual_seed(config.seed)
        self.block_size = config.block_size
        self.group = group
        self.tp = tp = group.tp if group is not None else None
        self.is_driver = group is None or group.is_driver
        self.shape = ModelShape.from_hf(hf_config, group.tp_size if group is not None else 1)
        self.pp = (
            PPStage.of(self.shape.num_layers, group.pp_rank, group.pp_size, config.layer_partition)
            if group is not None
            else PPStage.whole(self.shape.num_layers)
        )
        # running requests at most: max_num_seqs, unless the recurrent layers' states cap it (available_kv_blocks)
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = min(
            config.max_model_len or self.shape.max_position_embeddings, self.shape.max_position_embeddings
        )
        # which layers share block tables, and where each of this stage's layers keeps its K/V
        shape = self.shape
        self.kv_cache_groups = kv_cache_groups(
            shape.sliding_windows,
            shape.num_layers,
            shape.state_layers,
            shape.kv_shapes if shape.layer_head_dims else (),
            shape.kv_sharing,
        )
        # the group of the recurrent layers, keeping a state per request instead of K/V (MambaSpec), if any
        self.state_group = len(self.kv_cache_groups) - 1 if shape.state_layers else None
        if self.state_group is not None and device.type != "cpu":
            raise ValueError("models with recurrent layers (LFM2's convolutions) are built for the CPU only")
        # a layer that shares another's K/V (Gemma 4) reads it in that layer's group and KV cache tensor
        sharing = shape.kv_sharing or (None,) * shape.num_layers
        layer_group = {i: g for g, group in enumerate(self.kv_cache_groups) for i in group.layer_indices}
        layer_group |= {i: layer_group[t] for i, t in enumerate(sharing) if t is not None}
        stage_layers = range(self.pp.start_layer, self.pp.end_layer)
        if any(t is not None and t < self.pp.start_layer for t in sharing[self.pp.start_layer : self.pp.end_layer]):
            raise ValueError(
                "a layer that shares an earlier layer's K/V (num_kv_shared_layers) must be on that layer's pipeline "
                "stage; choose another --layer-partition or --pipeline-parallel-size 1"
            )
        self.stage_layer_groups = [layer_group[i] for i in stage_layers]
        # the i-th of a group's layers on this stage is stored in KV cache tensor i (engine.core.kv_cache_spec),
        # the i-th recurrent layer's state in state tensor i; a sharing layer in its target's
        own = [sharing[i] is None for i in stage_layers]
        slots = [
            sum(own[k] and self.stage_layer_groups[k] == g for k in range(j))
            for j, g in enumerate(self.stage_layer_groups)
        ]
        self.kv_cache_slots = [
            slots[j] if own[j] else slots[sharing[i] - self.pp.start_layer] for j, i in enumerate(stage_layers)
        ]
        self.num_kv_cache_slots = 1 + max(
            (k for k, g in zip(self.kv_cache_slots, self.stage_layer_groups) if g != self.state_group), default=0
        )
        # each layer's attention backend, one per group, planned once per step with that group's metadata
        self.layer_backends = make_backends(
            config.attention_backend,
            self.device,
            self.dtype,
            self.shape,
            self.block_size,
            [layer_group[i] for i in range(self.shape.num_layers)],
            config.kv_cache_dtype,
        )
        self.backends = [self.layer_backends[group.layer_indices[0]] for group in self.kv_cache_groups]
        self.backend = self.backends[0]  # the layout, dtype and CUDA-graph support are the same for all
        self.model = load_model(
            model_dir,
            hf_config,
            self.shape,
            self.layer_backends,
            self.max_model_len,
            self.device,
            self.dtype,
            tp,
            self._quant_config(model_dir, tp),
            self.pp,
        )
        if self.device.type == "cpu":
            moved = host_memory.huge_page_weights(self.model)
            logger.debug("%d MB of weights in transparent huge pages", moved >> 20)
            host_memory.keep_freed_memory()  # a step's large outputs reuse the last step's pages
        self.weight_bytes, summary = weight_summary(self.model)
        self.num_parameters = parameter_count(self.model)
        logger.info("weights: %s", summary)
        self.sampler = RejectionSampler()  # without drafts it draws what plain sampling draws
        self.input_batch = InputBatch()
        self.speculator = self._speculator() if self.is_driver else NoSpeculation()
        self.num_blocks = 0
        self.kv_cache = self.kv_caches = self.graphs = None
        self._block_scales: dict[int, int] = {}  # block_scales, once the cache exists

    def _speculator(self) -> Speculator | NoSpeculation:
        """The drafting side of speculative decoding (NoSpeculation when off): n-gram lookup, or a draft
        model loaded here, on this device, whose KV cache shares the target's block tables."""
        spec = self.config.speculative_config
        if spec is None:
            return NoSpeculation()
        draft = None
        if spec.method == "draft_model":
            model_dir = resolve_model(spec.model)
            draft_config = dataclasses.replace(
                self.config,
                model=spec.model,
                tokenizer=None,
                max_model_len=self.max_model_len,
                enforce_eager=True,
                speculative_config=None,
            )
            draft = ModelRunner(draft_config, load_config(model_dir), model_dir, self.device)
        return Speculator(spec, self.config, self.max_model_len, self.device.type, draft)

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
            raise ValueError(
                f"quantization gguf computes in one process on the CPU with float32 or bfloat16 "
                f"activations, not {self.device.type} {self.dtype}; use --quantization none to "
                f"dequantize at load"
            )
        if cpu_kernels.load() is None:
            logger.warning("no C compiler for the GGUF kernels: dequantizing the weights to %s at load", self.dtype)
            return None
        return GGUFConfig()

    def init_kv_cache(self, num_blocks: int, cuda_graphs: bool) -> None:
        """Allocates `num_blocks` KV blocks and caps max_model_len to what they hold; with
        `cuda_graphs` (and a backend whose decode can be captured) captures the decode graphs."""
        self.num_blocks = num_blocks
        capacity = max_request_tokens(
            self.kv_cache_groups, num_blocks, self.block_size, self.config.max_num_batched_tokens, self.max_model_len
        )
        if capacity < 1:
            raise ValueError(
                f"a KV cache of {num_blocks} blocks holds not one token of this model, whose layers keep "
                f"{len(self.kv_cache_groups)} block tables; give it more memory (--kv-cache-memory)"
            )
        if self.max_model_len > capacity:
            log = logger.warning if self.config.max_model_len else logger.info
            log("max_model_len %d capped to %d tokens, what the KV cache holds", self.max_model_len, capacity)
            self.max_model_len = capacity
        # Graphs only where the backend's decode is graph-safe: torch_native would be captured gathering
        # every row at full max_model_len, which costs memory in proportion to it.
        use_graphs = cuda_graphs and self.backend.supports_cuda_graphs
        if use_graphs and not getattr(self.model, "supports_cuda_graphs", True):
            # an MoE layer sizes its per-expert groups on the host each step, which a captured graph cannot
            logger.info("CUDA graphs off: this model's mixture-of-experts layers route on the host")
            use_graphs = False
        if use_graphs and len(self.kv_cache_groups) > 1:
            logger.info("CUDA graphs off: this model's layers keep %d block tables", len(self.kv_cache_groups))
            use_graphs = False
        # With CUDA graphs one extra block, owned by no sequence, takes the padded rows' K/V.
        shape = (self.num_kv_cache_slots, 2, self._slot_elements(num_blocks + use_graphs))
        cache_dtype = self.backend.cache_dtype(self.dtype)  # the model dtype, or a quantized cache's bytes
        flat = (
            host_memory.zeros(shape, cache_dtype)
            if self.device.type == "cpu"
            else torch.zeros(shape, dtype=cache_dtype, device=self.device)
        )
        self._block_scales = self.block_scales
        layer_caches = self._layer_caches(flat, num_blocks + use_graphs)
        # one K/V shape for every layer: the cache is [slots, 2, *that shape] (what a KV connector registers)
        uniform = len({self.backends[g].kv_cache_shape(1) for g in self._kv_groups}) == 1
        self.kv_cache = (
            flat.view(*shape[:2], *self.backend.kv_cache_shape(num_blocks + use_graphs)) if uniform else flat
        )
        # one float32 state per running request (max_num_seqs slots, as the KV cache manager hands them out) in
        # each recurrent layer of this stage
        num_states = self.stage_layer_groups.count(self.state_group) if self.state_group is not None else 0
        self.state_cache = torch.zeros(
            num_states, self.max_num_seqs, *getattr(self.model, "state_shape", ()), device=self.device
        )
        self.kv_caches = [
            self.state_cache[i] if g == self.state_group else cache
            for i, g, cache in zip(self.kv_cache_slots, self.stage_layer_groups, layer_caches)
        ]
        if use_graphs:
            self.graphs = CUDAGraphRunner(
                self.model,
                self.backends,
                self.kv_caches,
                self.config.max_num_seqs,
                max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                block_size=self.block_size,
                dummy_block=num_blocks,
            )
            self.graphs.capture()
        self.speculator.init_kv_cache(num_blocks, self.max_model_len)

    @property
    def _kv_groups(self) -> list[int]:
        """The groups that keep K/V (all but the recurrent layers')."""
        return [g for g in range(len(self.kv_cache_groups)) if g != self.state_group]

    def _slot_elements(self, num_blocks: int) -> int:
        """Elements of one KV cache tensor's K (or V) for `num_blocks` blocks: the largest of the groups' layers'
        (Gemma 4's global layers have heads of their own size)."""
        return max(math.prod(self.backends[g].kv_cache_shape(num_blocks)) for g in self._kv_groups)

    @property
    def block_scales(self) -> dict[int, int]:
        """For each group whose layers' K/V of a block are smaller than the largest group's, how many of its
        blocks one block of the pool spans (an integer: vLLM's page-size unification, by padding): its layers
        view their KV cache tensor as that many times the blocks, and its block tables and slot mapping are
        scaled so that block b of the pool is its block b * scale. Raises ValueError when the sizes do not
        divide."""
        largest, scales = self._slot_elements(1), {}
        for g in self._kv_groups:
            own = math.prod(self.backends[g].kv_cache_shape(1))
            if largest % own:
                raise ValueError(f"a layer's K/V block ({own} elements) does not divide the largest ({largest})")
            if largest != own:
                scales[g] = largest // own
        return scales

    def _layer_caches(self, flat: torch.Tensor, num_blocks: int) -> list:
        """Each of this stage's layers' (k_cache, v_cache): views, in its group's backend layout, of its KV cache
        tensor in `flat` [slots, 2, _slot_elements(num_blocks)] (a smaller layer's as more blocks: block_scales;
        None for a recurrent layer)."""
        caches, scales = [], self.block_scales
        for slot, g in zip(self.kv_cache_slots, self.stage_layer_groups):
            if g == self.state_group:
                caches.append(None)
                continue
            shape = self.backends[g].kv_cache_shape(num_blocks * scales.get(g, 1))
            caches.append(tuple(flat[slot, i].view(shape) for i in (0, 1)))
        return caches

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V for one block over this stage's KV cache tensors (a group's layers; this rank's
        heads; each tensor sized for the largest layer's)."""
        itemsize = self.backend.cache_dtype(self.dtype).itemsize
        return 2 * self.num_kv_cache_slots * self._slot_elements(1) * itemsize

    @property
    def state_bytes(self) -> int:
        """Bytes of this stage's recurrent-layer states (state_cache): float32, one per slot of max_num_seqs."""
        return self.max_num_seqs * self.state_bytes_per_request

    @property
    def state_bytes_per_request(self) -> int:
        """Bytes of one request's float32 states over this stage's recurrent layers (0 without such layers)."""
        if self.state_group is None:
            return 0
        layers = self.stage_layer_groups.count(self.state_group)
        return 4 * layers * math.prod(getattr(self.model, "state_shape", ()))

    def available_kv_blocks(self, kv_cache_memory: int) -> int:
        """KV blocks that fit this rank's budget: `kv_cache_memory` bytes on the CPU (less the recurrent layers'
        states: state_bytes); on CUDA what gpu_memory_utilization leaves after the weights and a profiled forward;
        `num_gpu_blocks_override` when set. The recurrent layers' states take at most half of the budget: where
        max_num_seqs requests' would take more, `max_num_seqs` (what the engine schedules) is capped to what half
        holds, logged. Raises ValueError below one block, or when one request's states exceed half."""
        budget = self._profile_cuda_budget() if self.device.type == "cuda" else kv_cache_memory
        if per_request := self.state_bytes_per_request:
            fits = budget // 2 // per_request
            if fits < 1:
                raise ValueError(
                    f"one request's recurrent-layer states ({per_request} bytes) exceed half the KV cache budget "
                    f"({budget} bytes); raise --kv-cache-memory"
                )
            if fits < self.max_num_seqs:
                logger.warning(
                    "max_num_seqs %d capped to %d: the recurrent layers' states (%d bytes a request) take at most "
                    "half the KV cache budget; raise --kv-cache-memory for more",
                    self.max_num_seqs,
                    fits,
                    per_request,
                )
                self.max_num_seqs = fits
            budget -= self.state_bytes
        num_blocks = budget // self.block_bytes
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes is below one block ({self.block_bytes} bytes)")
        override = self.config.num_gpu_blocks_override
        if override is not None:
            logger.info("%d KV blocks (num_gpu_blocks_override; the budget holds %d)", override, num_blocks)
            return override
        return num_blocks

    def _profile_cuda_budget(self) -> int:
        """Bytes left for the KV cache: gpu_memory_utilization of the GPU minus weights and the peak
        activations of a forward over max_num_batched_tokens tokens (measured with a tiny cache)."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-n // self.block_size)
        kv = torch.zeros(
            self.num_kv_cache_slots,
            2,
            self._slot_elements(blocks),
            dtype=self.backend.cache_dtype(self.dtype),
            device=self.device,
        )
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.arange(n, dtype=torch.int64, device=self.device),
            num_decodes=0,
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[n],
        )
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            for backend in self.backends:
                backend.plan(meta)
            hidden = self.model(
                torch.zeros(n, dtype=torch.long, device=self.device),
                torch.arange(n, device=self.device),
                self._layer_caches(kv, blocks),
                [meta] * len(self.kv_cache_slots),
                None if self.pp.is_first else torch.zeros(n, self.shape.hidden_size, device=self.device),
            )
            if self.pp.is_last:
                self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del kv, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        # CUDA graphs are captured after the cache exists: keep room for their pool and buffers
        graph_reserve = 1 << 30 if self.backend.supports_cuda_graphs and not self.config.enforce_eager else 0
        return int(total * self.config.gpu_memory_utilization) - peak - graph_reserve

    @torch.inference_mode()  # the sampler masks the logits (inference tensors) in place
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput | None:
        """Runs one step, the same on every rank: the requests updated from `scheduler_output`, the inputs
        built from them, the forward pass, prompt logprobs and the sampled rows' logits (collectives under
        tensor parallelism; a stage but the last sends its residual stream on and stops there). The driver then
        pools embeddings, samples (masked by `grammar_output`'s grammars) and drafts, and returns the
        ModelRunnerOutput; the other ranks return None."""
        self.input_batch.update_states(scheduler_output)
        self.speculator.update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput() if self.is_driver else None
        batch = self.input_batch.prepare(scheduler_output, self.block_size, self.device, self.state_group)
        residual = None
        if not self.pp.is_first:
            residual = self.group.recv_hidden(batch.model_inputs.input_ids.shape[0], self.shape.hidden_size)
        hidden = self.forward(batch.model_inputs, residual)
        if not self.pp.is_last:
            self.group.send_hidden(hidden)
            return None
        out = ModelRunnerOutput()
        if batch.prompt_rows:
            out.prompt_logprobs = prompt_logprobs.collect(self.model, hidden, batch.prompt_rows)
        logits, argmax = self._logits(hidden, batch.model_inputs.logits_indices)
        if not self.is_driver:
            return None
        if batch.pooling_rows:
            out.pooler_output = self._pool(hidden, batch)
        if logits is not None:
            self._sample(logits, batch, grammar_output, out, argmax)
            out.draft_token_ids = self.speculator.propose(
                batch.sampled, out.sampled_token_ids, len(scheduler_output.num_scheduled_tokens)
            )
        return out

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The model's hidden states [T, hidden] of one step's inputs (CUDA graphs for decodes where captured);
        on a pipeline stage, from the previous stage's `residual` (float32 [T, hidden]) unless it is the
        first, and this stage's residual stream unless it is the last."""
        metas = list(inputs.attn_metadata)
        if self.graphs is not None and self.graphs.can_run(metas[0]):  # one group
            return self.graphs.run(inputs.input_ids, inputs.positions, metas[0])  # plans the padded batch itself
        for g, scale in self._block_scales.items():  # a smaller layer's blocks: block b of the pool is b * scale
            meta, bs = metas[g], self.block_size
            slots = meta.slot_mapping
            metas[g] = dataclasses.replace(
                meta, block_tables=meta.block_tables * scale, slot_mapping=slots // bs * (scale * bs) + slots % bs
            )
        for backend, meta in zip(self.backends, metas):
            if backend is not None:  # None: the recurrent layers' group
                backend.plan(meta)
        layer_metas = [metas[g] for g in self.stage_layer_groups]
        # a model that can compute its logits with its last C call is told which rows need them (take_step_logits)
        fused = {"logits_indices": inputs.logits_indices} if getattr(self.model, "fuses_logits", False) else {}
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, layer_metas, residual, **fused)

    def _logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits [len(indices), vocab] of hidden's rows `indices` (int64, increasing), and their rows' argmax
        (int64) where the model computed both with the forward (take_step_logits), else compute_logits' and None;
        None for no rows (and on a tensor-parallel rank but the first)."""
        take = getattr(self.model, "take_step_logits", None)
        step = take() if take is not None else None
        if step is not None:
            return step
        return (self.model.compute_logits(hidden[indices]) if indices.shape[0] else None), None

    @torch.inference_mode()
    def compute_logits_of_rows(
        self, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]], num_logits: list[int]
    ) -> torch.Tensor | None:
        """A forward over rows given directly (a draft model's steps, engine/spec_decode): float32 CPU logits
        [sum(num_logits), vocab] at each row's last num_logits[i] positions, None when there are none. Rows
        are as `build_model_inputs` takes them (one-token rows first)."""
        tables = [(t,) for t in block_tables]  # a draft model keeps one KV cache group
        inputs, _ = build_model_inputs(token_ids, starts, tables, num_logits, self.block_size, self.device)
        hidden = self.forward(inputs)
        return self._logits(hidden, inputs.logits_indices)[0].cpu() if sum(num_logits) else None

    def _sample(
        self,
        logits: torch.Tensor,
        batch: StepBatch,
        grammar_output: GrammarOutput | None,
        out: ModelRunnerOutput,
        argmax: torch.Tensor | None = None,
    ) -> None:
        """Each sampling request's new tokens (one, or with drafts the accepted ones and one more: see
        RejectionSampler), masked by the step's grammars, into `out`; `argmax`: the logits rows' argmax where the
        forward computed it."""
        rows = grammar_output.structured_output_request_ids if grammar_output is not None else {}
        grammar_rows = [i for i, r in enumerate(batch.sampled) if r.req_id in rows]
        bitmask = (
            grammar_output.grammar_bitmask[[rows[batch.sampled[i].req_id] for i in grammar_rows]]
            if grammar_rows
            else None
        )
        out.sampled_token_ids, out.logprobs = self.sampler(logits.cpu(), batch.sampled, bitmask, grammar_rows, argmax)
        out.req_ids = [r.req_id for r in batch.sampled]

    def _pool(self, hidden: torch.Tensor, batch: StepBatch) -> dict[str, torch.Tensor]:
        """Adds this step's rows to each embedding request's pooled state; returns the embeddings of those
        whose prompt it finished (float32 [hidden], engine.worker.pooler)."""
        pooling = self.config.pooler_config
        shares = pooler.pool(hidden, batch.pooling_rows, pooling.pooling_type)
        done = {}
        for rows in batch.pooling_rows:
            state = self.input_batch.requests[rows.request_id]
            share = shares.get(rows.request_id)
            if share is not None:
                keep = state.pooled is None or pooling.pooling_type == "LAST"
                state.pooled = share if keep else state.pooled + share
            if rows.last:
                done[rows.request_id] = pooler.finish(state.pooled, state.num_prompt_tokens, pooling)
        return done


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    if not os.path.exists("/proc/cpuinfo"):
        return set()
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def auto_dtype(device: torch.device, gguf_blocks: bool = False) -> tuple[torch.dtype, str]:
    """The model dtype for dtype "auto", and why: bfloat16 on CUDA, and on a CPU with native bfloat16
    arithmetic (AVX512-BF16 or AMX, vLLM-CPU's rule); float32 on other CPUs, where bfloat16 would be
    emulated and slower. A GGUF model on its quantized blocks (`gguf_blocks`) follows the same rule, and takes
    bfloat16 on an AVX-512 CPU with VNNI but no BF16 too: there bfloat16 means q, k, v, the attention and the KV
    cache in bfloat16 (norms and MLP stay float32, models/layers/attention.py), and the R16 kernels round their
    bfloat16 outputs and the attention widens the cache's rows with integer ops, so nothing is emulated. On an AMD
    EPYC with AVX512-BF16 that decodes 10-15% faster at batch 1 and ~25% faster at 64 requests than float32, at
    +0.02% perplexity; on an Intel Xeon with VNNI and no BF16, W64 26% faster, batch 1 the same (docs/benchmarks.md)."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = cpu_flags()
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if native:
        return torch.bfloat16, f"the CPU has {' and '.join(native)}"
    if gguf_blocks and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= flags:
        return torch.bfloat16, "a GGUF model on its blocks, and the CPU has AVX512-VNNI (bfloat16 without emulation)"
    return torch.float32, "the CPU has neither AVX512-BF16 nor AMX"
