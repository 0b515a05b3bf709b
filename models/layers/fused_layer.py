"""One C call per decoder layer, or for a step's whole stack, on the CPU (models/kernels/csrc/decoder_layer.c).

At batch 1 a layer's arithmetic takes less time than the ~10 Python-level ops around it (module calls, ctypes
argument packing, new tensors, OpenMP threads waking for each kernel). `FusedDecoderLayer` describes a Llama-family
layer's tensors to the C entry point once and then runs the whole layer (both norms, the four GGUF linears, Qwen3's
q/k norms, rotary, paged attention, SiLU-and-mul; or a Qwen3-MoE / Mixtral / gpt-oss layer's router and GGUF experts
in place of the MLP's linears; gpt-oss's attention sinks, o_proj bias, expert biases and clamped SwiGLU; partial
rotary and Qwen3.5's sigmoid output gate) per call, with the same kernels the op-by-op path calls, so the output is
the same; a quantized KV cache (--kv-cache-dtype) goes to the same attention kernel's quantized form. A bfloat16
GGUF model computes its norms and MLP in float32 and q, k, v and the attention in bfloat16
(models/layers/attention.py): the call does the same (attn_bf16). `FusedDecoderStack` runs a step's fused layers in
one call. It is a hook with a null default: `build` returns None for a layer it cannot run (another device or dtype,
a float checkpoint's weights, Granite's multipliers, soft caps, shared experts, tensor parallelism), and a call
returns None for a step of more tokens than the layer's GGUF kernels take without dequantizing (`max_rows`: the least
GGUFTensor.kernel_rows of its weights; DECODE_MAX_ROWS at most for a layer with experts); the layer then runs op by
op.
"""

import ctypes
import itertools
import operator
import sys

import torch

from models.attention.base import AttentionMetadata
from models.attention.cpu import CPUBackend
from models.attention.kv_cache_dtype import STORAGE
from models.kernels import cpu_kernels, ops
from models.layers.fused_moe import SparseMoeBlock
from models.layers.mlp import SwiGLUMLP
from models.quantization.gguf import (
    R16_COPY_MIN_ROWS,
    GGUFEmbeddingMethod,
    GGUFLinearMethod,
    GGUFMoEMethod,
    GGUFTensor,
    r16_int8,
)

MAX_SEGMENTS = 4  # decoder_layer.c's: q | k | v | Qwen3.5's output gate
# LayerLinear.kernel: the kernel of a segment (decoder_layer.c's gguf_linear, gguf_q8_linear, gguf_r16_linear)
KERNEL_EXACT, KERNEL_INT8, KERNEL_R16, KERNEL_R16_INT8 = 0, 1, 2, 3
# the most rows a call of a layer with a mixture of experts, or of linear attention, takes: a decode step's. A dense
# attention layer takes any step its kernels take, prompt chunks included: the stack's one parallel region saves a
# prompt the fork of each kernel and the Python between them (pp512 of the default model 3,775 -> 4,036 tok/s on a
# Zen 5 EPYC, alternating in one process)
DECODE_MAX_ROWS = 64
MAX_HEADS_DIM = 16384  # decoder_layer.c's: query heads x head_dim of a layer with q/k norms


class LayerLinear(ctypes.Structure):
    """decoder_layer.c's LayerLinear: a linear's stacked GGUF segments and optional bias (in the output's dtype)."""

    _fields_ = [
        ("n", ctypes.c_int),
        ("data", ctypes.c_void_p * MAX_SEGMENTS),
        ("type", ctypes.c_int * MAX_SEGMENTS),
        ("rows", ctypes.c_int * MAX_SEGMENTS),
        ("kernel", ctypes.c_int * MAX_SEGMENTS),
        ("bias", ctypes.c_void_p),
        ("copy", ctypes.c_void_p * MAX_SEGMENTS),
        ("copy_kernel", ctypes.c_int),
        ("copy_rows", ctypes.c_int),
    ]


class LayerDesc(ctypes.Structure):
    """decoder_layer.c's LayerDesc: a layer's shape, norms, attention settings and linears."""

    _fields_ = [
        ("hidden", ctypes.c_int),
        ("num_heads", ctypes.c_int),
        ("num_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("use_rope", ctypes.c_int),
        ("window", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("kvq", ctypes.c_int),
        ("attn_bf16", ctypes.c_int),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", LayerLinear),
        ("o", LayerLinear),
        ("gate_up", LayerLinear),
        ("down", LayerLinear),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qk_eps", ctypes.c_float),
        ("num_experts", ctypes.c_int),
        ("top_k", ctypes.c_int),
        ("renormalize", ctypes.c_int),
        ("moe_kernel", ctypes.c_int),
        ("router", ctypes.c_void_p),
        ("router_bias", ctypes.c_void_p),
        ("experts", ctypes.c_void_p * 3),
        ("expert_type", ctypes.c_int * 3),
        ("expert_b13", ctypes.c_void_p),
        ("expert_b2", ctypes.c_void_p),
        ("swiglu_limit", ctypes.c_float),
        ("swiglu_alpha", ctypes.c_float),
        ("sinks", ctypes.c_void_p),
        ("rotary_dim", ctypes.c_int),
        ("output_gate", ctypes.c_int),
    ]


def _segments(module, bias_dtype: torch.dtype = torch.float32) -> list[GGUFTensor] | None:
    """The stacked GGUF weights of a ColumnParallelLinear / RowParallelLinear that are all blocks the CPU kernels
    take, as the file has them or repacked to R16 (a bias allowed in `bias_dtype`, the output's, or in bfloat16 for
    a float32 output: _float32 widens it), else None."""
    method = module.quant_method
    if not isinstance(method, GGUFLinearMethod) or getattr(module, "tp", None) is not None:
        return None
    segments = [w for _, w in method.segments]
    if not 1 <= len(segments) <= MAX_SEGMENTS or any(not isinstance(w, GGUFTensor) for w in segments):
        return None
    bias = getattr(module, "bias", None)
    widens = bias_dtype == torch.float32 and bias is not None and bias.dtype == torch.bfloat16
    if bias is not None and ((bias.dtype != bias_dtype and not widens) or bias.device.type != "cpu"):
        return None
    return segments


def _float32(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as the float32 the op-by-op layer adds or passes (a bfloat16 model's biases and sinks widened, exactly, as
    torch's promotion and the kernels' `.float()` do), contiguous; None for None."""
    return None if t is None else t.float().contiguous()


def _linear(module, segments: list[GGUFTensor], bias: torch.Tensor | None) -> LayerLinear:
    """decoder_layer.c's description of `module` with weights `segments` (from _segments) and `bias` (the module's,
    in the output's dtype: kept referenced by the caller)."""
    desc = LayerLinear(n=len(segments), bias=None if bias is None else bias.data_ptr())
    copies = [w.copy_min_rows for w in segments if w.r16_copy is not None]
    desc.copy_kernel = KERNEL_R16_INT8 if r16_int8() else KERNEL_R16
    desc.copy_rows = min(copies, default=R16_COPY_MIN_ROWS)  # GGUFTensor.matmul's rule (an LM head's from one row)
    for i, w in enumerate(segments):
        if w.r16_copy is not None:  # a large Q8_0 weight's blocks for a few rows, its R16 copy for more
            desc.copy[i] = w.r16_copy.data_ptr()
        if w.r16:
            kernel = KERNEL_R16_INT8 if w.int8 else KERNEL_R16
        else:
            kernel = KERNEL_INT8 if w.int8 else KERNEL_EXACT
        desc.data[i], desc.type[i], desc.rows[i], desc.kernel[i] = w.data.data_ptr(), int(w.qtype), w.rows, kernel
    return desc


def _experts(mlp) -> tuple[list[GGUFTensor], int] | None:
    """A SparseMoeBlock's expert weights and gguf_moe's kernel for them (ops.moe_kernel), where decoder_layer.c
    computes the block as its forward does: quantized experts on one rank with SiLU or gpt-oss's clamped SwiGLU,
    float32 biases if any, no shared expert, a float32 router; else None."""
    experts = getattr(mlp, "experts", None)
    if not isinstance(mlp, SparseMoeBlock) or mlp.shared_expert is not None or not 0 < mlp.top_k <= 64:
        return None
    method = experts.quant_method
    if (
        not isinstance(method, GGUFMoEMethod)
        or experts.tp is not None
        or experts.activation != "silu"
        or any(not isinstance(b, GGUFTensor) for b in method.blocks)
    ):
        return None
    router = [mlp.gate.weight] if mlp.gate.bias is None else [mlp.gate.weight, mlp.gate.bias]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in router):
        return None
    kernel = ops.moe_kernel(method.blocks)
    return None if kernel is None else (method.blocks, kernel)


class FusedDecoderLayer:
    """A LlamaDecoderLayer (models/llama.py) run by one `decoder_layer_float` call per step (attn_dtype: q, k, v's).

    __call__(residual, x, rope, kv_cache, meta) takes and returns what the layer's forward does: residual float32
    [T, hidden] updated in place, x the previous layer's MLP output [T, hidden] or None, rope float32 (cos, sin)
    [T, head_dim // 2], kv_cache this layer's (k_cache, v_cache) (the model dtype, or a --kv-cache-dtype's
    storage), meta the step's AttentionMetadata; returns this layer's MLP output [T, hidden], or None (nothing
    done) when T > max_rows or the kernels are off (ops.torch_ops()). Raises ValueError when a kernel refuses a
    shape.
    """

    def __init__(self, lib, desc: LayerDesc, backend: CPUBackend, keep: list[torch.Tensor], max_rows: int, attn_dtype):
        self.lib, self.desc, self.backend, self.max_rows = lib, desc, backend, max_rows
        self.attn_dtype = attn_dtype  # q, k, v and the attention's: the model dtype (norms and MLP in float32)
        self._keep = keep  # the tensors whose addresses `desc` holds
        self._desc_ref = ctypes.byref(desc)

    @classmethod
    def build(cls, layer) -> "FusedDecoderLayer | None":
        """The fused form of `layer`, or None when it has something decoder_layer.c does not compute."""
        lib = cpu_kernels.load()
        attn, mlp = layer.self_attn, layer.mlp
        backend = attn.backend
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if (
            lib is None
            or not isinstance(backend, CPUBackend)
            or backend.logits_soft_cap
            or backend.dtype not in (None, torch.float32, torch.bfloat16)
            or (attn.sinks is not None and attn.sinks.device.type != "cpu")
            or getattr(layer, "residual_multiplier", 1.0) != 1.0
            or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in norms)
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps
        ):
            return None
        experts = _experts(mlp)
        if not isinstance(mlp, SwiGLUMLP) and experts is None:
            return None
        modules = (attn.qkv_proj, attn.o_proj) + ((mlp.gate_up_proj, mlp.down_proj) if experts is None else ())
        attn_bf16 = backend.dtype == torch.bfloat16
        attn_dtype = torch.bfloat16 if attn_bf16 else torch.float32
        head_norms = (attn.q_norm, attn.k_norm)
        if attn.q_norm is not None and (
            attn.k_norm is None
            or attn.q_norm.eps != attn.k_norm.eps
            or any(n.weight.dtype != attn_dtype or n.weight.device.type != "cpu" for n in head_norms)
            or attn.num_heads * attn.head_dim > MAX_HEADS_DIM
        ):
            return None
        # q | k | v come out in the attention's dtype, their bias (Qwen2's) with them
        weights = [_segments(attn.qkv_proj, attn_dtype)]
        weights += [_segments(m) for m in modules[1:]]
        if any(w is None for w in weights):
            return None
        # q | k | v's bias in their dtype; o_proj's and the MLP's added to float32 outputs, widened as torch does
        qkv_bias = getattr(attn.qkv_proj, "bias", None)
        qkv_bias = qkv_bias if qkv_bias is None or qkv_bias.dtype == attn_dtype else _float32(qkv_bias)
        biases = [qkv_bias] + [_float32(getattr(m, "bias", None)) for m in modules[1:]]
        qkv, o, *mlp_linears = (_linear(m, w, b) for m, w, b in zip(modules, weights, biases))
        gate_up, down = mlp_linears or (LayerLinear(), LayerLinear())
        desc = LayerDesc(
            hidden=norms[0].shape[0],
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            inter=mlp.experts.inter if experts else mlp.down_proj.quant_method.input_size,
            eps=layer.input_layernorm.eps,
            scale=backend.scale,
            use_rope=int(attn.use_rope),
            window=backend.sliding_window or 0,
            block_size=backend.block_size,
            kvq=backend.kv_quant,
            attn_bf16=int(attn_bf16),
            input_norm=norms[0].data_ptr(),
            post_norm=norms[1].data_ptr(),
            qkv=qkv,
            o=o,
            gate_up=gate_up,
            down=down,
            q_norm=None if attn.q_norm is None else attn.q_norm.weight.data_ptr(),
            k_norm=None if attn.k_norm is None else attn.k_norm.weight.data_ptr(),
            qk_eps=0.0 if attn.q_norm is None else attn.q_norm.eps,
            rotary_dim=attn.rotary_dim,
            output_gate=int(attn.output_gate),
        )
        keep = list(norms) + [n.weight for n in head_norms if n is not None] + [b for b in biases if b is not None]
        if attn.sinks is not None:
            keep.append(sinks := _float32(attn.sinks))
            desc.sinks = sinks.data_ptr()
        if experts is not None:
            blocks, desc.moe_kernel = experts
            desc.num_experts, desc.top_k, desc.renormalize = mlp.experts.num_experts, mlp.top_k, int(mlp.renormalize)
            desc.router = mlp.gate.weight.data_ptr()
            desc.router_bias = None if mlp.gate.bias is None else mlp.gate.bias.data_ptr()
            for i, b in enumerate(blocks):
                desc.experts[i], desc.expert_type[i] = b.data.data_ptr(), int(b.qtype)
            weights.append(blocks)
            keep += [mlp.gate.weight] + [b.data for b in blocks]
            moe = mlp.experts  # gguf_moe's biases float32, as ops.gguf_moe passes them
            for field, bias in (("expert_b13", _float32(moe.w13_bias)), ("expert_b2", _float32(moe.w2_bias))):
                if bias is not None:
                    setattr(desc, field, bias.data_ptr())
                    keep.append(bias)
            desc.swiglu_limit, desc.swiglu_alpha = moe.swiglu_limit or 0.0, moe.swiglu_alpha
        cap = DECODE_MAX_ROWS if experts else sys.maxsize
        max_rows = min([cap] + [w.kernel_rows for segments in weights for w in segments])
        return cls(lib, desc, backend, keep, max_rows, attn_dtype)

    def takes(self, residual, x, rope, k_cache, max_rows: int) -> bool:
        """Whether a step of `residual`'s rows (at most `max_rows`) with these tensors is one the call computes."""
        tensors = (residual, *rope) if x is None else (residual, x, *rope)
        return self.takes_rows(residual.shape[0], k_cache, max_rows) and all(
            t.dtype == torch.float32 and t.is_contiguous() for t in tensors
        )

    def takes_rows(self, rows: int, k_cache, max_rows: int) -> bool:
        """Whether a step of `rows` rows (at most `max_rows`) over `k_cache` is one the call computes."""
        return (
            rows <= max_rows
            and ops.kernels_enabled()
            and k_cache.dtype == (STORAGE[self.backend.kv_quant] if self.backend.kv_quant else self.attn_dtype)
        )

    def step_args(self, residual, x, rope, meta: AttentionMetadata) -> tuple[torch.Tensor, tuple, tuple]:
        """The output tensor [T, hidden] and the C call's arguments before the caches and after them."""
        out = torch.empty_like(residual)
        cos, sin = rope
        head = (residual.data_ptr(), None if x is None else x.data_ptr(), out.data_ptr(), residual.shape[0])
        return out, head + (cos.data_ptr(), sin.data_ptr()), self.meta_args(meta)

    def meta_args(self, meta: AttentionMetadata) -> tuple:
        """The C calls' arguments after the caches: the step's metadata, the attention ISA and the thread count."""
        return (
            meta.slot_mapping.data_ptr(),
            meta.block_tables.data_ptr(),
            meta.seq_lens.data_ptr(),
            meta.query_start_loc.data_ptr(),
            meta.num_seqs,
            meta.block_tables.shape[1],
            self.backend.isa,
            torch.get_num_threads(),
        )

    def __call__(self, residual, x, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor | None:
        k_cache, v_cache = kv_cache
        if not self.takes(residual, x, rope, k_cache, self.max_rows):
            return None
        out, head, tail = self.step_args(residual, x, rope, meta)
        rc = self.lib.decoder_layer_float(self._desc_ref, *head, k_cache.data_ptr(), v_cache.data_ptr(), *tail)
        if rc != 0:
            raise ValueError(f"decoder_layer_float: a kernel refused the layer's shapes (status {rc})")
        return out


class StepEnds(ctypes.Structure):
    """decoder_layer.c's StepEnds: the token embedding and rotary tables of a model's first pipeline stage, and the
    final norm and LM head of its last, that decoder_step_float computes with the layers (NULL: the caller's)."""

    _fields_ = [
        ("embed", ctypes.c_void_p),
        ("embed_type", ctypes.c_int),
        ("embed_r16", ctypes.c_int),
        ("embed_rows", ctypes.c_int),
        ("embed_bf16", ctypes.c_int),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("table_rows", ctypes.c_int),
        ("half", ctypes.c_int),
        ("norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("head", LayerLinear),
        ("head_blocks", ctypes.c_void_p),
        ("head_type", ctypes.c_int),
        ("head_r16", ctypes.c_int),
        ("vocab", ctypes.c_int),
        ("refine_k", ctypes.c_int),
    ]


def _gguf_table(module) -> GGUFTensor | None:
    """The GGUF weight of a token embedding or LM head (VocabParallelEmbedding) held whole on one rank, else None."""
    method = getattr(module, "quant_method", None)
    if not isinstance(method, GGUFEmbeddingMethod) or getattr(module, "tp", None) is not None:
        return None
    w = method.weight
    return w if isinstance(w, GGUFTensor) and w.data.device.type == "cpu" else None


def _cpu_float32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _int64(t: torch.Tensor) -> bool:
    return t.dtype == torch.int64 and t.is_contiguous()


class FusedDecoderStack:
    """Consecutive fused layers (a model's, or a pipeline stage's) run by one `decoder_layers_float` call per step:
    the per-layer Python of FusedDecoderLayer (argument checks, a new output tensor, a ctypes call of 17 arguments:
    ~15 us a layer, 0.45 ms a token over the default model's 30) once a step. The same kernels in the same order,
    so the output is the per-layer calls'.

    __call__(residual, x, rope, kv_caches, metas) takes what the layers' forwards take (kv_caches and metas: each
    layer's) and returns the last layer's MLP output [T, hidden], or None (nothing done) where a layer would
    decline the step (FusedDecoderLayer's rules) or the layers do not share one metadata (several KV cache groups).
    The layers' fused forms are the ones built with the stack: to run them otherwise, drop the model's stack too
    (its `fused_stack` False). Raises ValueError when a kernel refuses a shape.
    """

    def __init__(self, layers: list[FusedDecoderLayer]):
        self.layers = layers
        self.lib, self.first = layers[0].lib, layers[0]
        self.max_rows = min(layer.max_rows for layer in layers)
        self._descs = (ctypes.c_void_p * len(layers))(*(ctypes.addressof(layer.desc) for layer in layers))
        self._caches: tuple | None = None  # (the caches' addresses, k array, v array), rebuilt when they move
        self.ends: StepEnds | None = None  # add_ends: the model's ends computed in the same call (`step`)
        self._ends_keep: list[torch.Tensor] = []  # the tensors whose addresses `ends` holds
        self._ends_ref = None  # ctypes.byref(ends)
        self.head_rows = 0  # the most logits rows the ends' LM head takes (0: no head; compute_logits)

    @classmethod
    def build(cls, modules: list) -> "FusedDecoderStack | None":
        """The stack of `modules` (decoder layers with a `fused` hook), building their fused forms where not yet
        built; None unless every one has one, all with the same attention dtype."""
        for module in modules:
            if module.fused is None:
                module.fused = FusedDecoderLayer.build(module) or False
        layers = [module.fused for module in modules]
        if not layers or not all(isinstance(f, FusedDecoderLayer) for f in layers):
            return None
        if len({f.attn_dtype for f in layers}) != 1:
            return None
        return cls(layers)

    def add_ends(self, embed, rotary, norm, head) -> bool:
        """Lets `step` compute the model's ends with the layers: `embed` the token embedding of a first pipeline
        stage (None: `step` takes the stream the caller made), `rotary` the RotaryEmbedding, `norm` the final RMSNorm
        and `head` the module whose `logits` are the LM head's on the last stage (None on the others, and for a head
        left to compute_logits). An embedding or head is taken where its weight is a GGUFTensor held whole on the
        CPU, the same one that module's ops compute with; the head's logits are then the ones its `logits` gives,
        rescored as it rescores them. Returns False, `step` off, where the rotary tables or the final norm are not
        float32 CPU tensors."""
        tables = (rotary.cos, rotary.sin)
        if not all(_cpu_float32(t) and t.dim() == 2 for t in tables):
            return False
        if norm is not None and not _cpu_float32(norm.weight):
            return False
        e = StepEnds(cos=tables[0].data_ptr(), sin=tables[1].data_ptr(), table_rows=tables[0].shape[0])
        e.half = tables[0].shape[1]
        keep = list(tables)
        if embed is not None and (w := _gguf_table(embed)) is not None:
            e.embed, e.embed_type, e.embed_r16, e.embed_rows = w.data.data_ptr(), int(w.qtype), int(w.r16), w.rows
            e.embed_bf16 = int(embed.quant_method.dtype == torch.bfloat16)  # looked up in the model dtype
            keep.append(w.data)
        if norm is not None:
            e.norm, e.eps = norm.weight.data_ptr(), norm.eps
            keep.append(norm.weight)
            if head is not None and (w := _gguf_table(head)) is not None:
                e.head = _linear(head, [w], None)
                e.head_blocks, e.head_type, e.head_r16, e.vocab = w.data.data_ptr(), int(w.qtype), int(w.r16), w.rows
                e.refine_k = min(ops.REFINE_TOP, w.rows)  # GGUFEmbeddingMethod.logits' rescoring
                keep += [w.data] + ([] if w.r16_copy is None else [w.r16_copy])
                self.head_rows = w.kernel_rows
        self.ends, self._ends_keep, self._ends_ref = e, keep, ctypes.byref(e)
        return True

    def step(self, input_ids, positions, residual, kv_caches, metas, logits_indices=None) -> tuple | None:
        """A step of the stage in one decoder_step_float call, with the ends add_ends gave: the embedding of
        input_ids (int64 [T]) where `residual` is None (a first stage whose embedding the call takes), else the
        stream `residual` (float32 [T, hidden]: the previous stage's, or the caller's embedding; updated in place);
        the rotary tables' rows at positions (int64 [T]); the layers (kv_caches and metas as __call__ takes them);
        on the last stage the final norm and, for the increasing rows `logits_indices` (int64 [N]) of its output,
        the LM head's logits as its `logits` computes them, and their rows' argmax. Returns (the normed hidden states
        [T, hidden], or on a stage but the last the residual stream after its layers; float32 logits [N, vocab] and
        int64 argmax [N] (ops.argmax's), or None and None where the head was left to compute_logits), or None,
        nothing done, where __call__ would decline the step or `step` is off. Raises ValueError when a kernel
        refuses a shape or a token id or position is outside its table.

        The metadata check runs in C (map, operator.is_): with the caches cold from the layers' weights, generators
        over 30 layers and the step's buffers as torch tensors cost 0.1 ms a batch-1 step."""
        e, first = self.ends, self.first
        T = positions.shape[0]
        if (
            e is None
            or (residual is None and not e.embed)
            or (residual is not None and not _cpu_float32(residual))
            or not _int64(positions)
            or (residual is None and not _int64(input_ids))
            or (logits_indices is not None and not _int64(logits_indices))
            or len(kv_caches) != len(self.layers)
            or not all(map(operator.is_, metas, itertools.repeat(metas[0])))
            or not first.takes_rows(T, kv_caches[0][0], self.max_rows)
        ):
            return None
        n = 0 if logits_indices is None or not e.head.n else logits_indices.shape[0]
        n = n if n <= self.head_rows else 0  # more rows than the head's kernel takes: compute_logits
        last = bool(e.norm)
        if residual is None and not last:  # a first stage's stream, passed on
            residual = torch.empty(T, first.desc.hidden, dtype=torch.float32)
        hidden = torch.empty(T, first.desc.hidden, dtype=torch.float32) if last else None
        logits = torch.empty(n, e.vocab, dtype=torch.float32) if n else None
        argmax = torch.empty(n, dtype=torch.int64) if n else None
        k_caches, v_caches = self._cache_arrays(kv_caches)
        rc = self.lib.decoder_step_float(
            self._ends_ref, self._descs, len(self.layers), input_ids.data_ptr(),
            positions.data_ptr(), None if residual is None else residual.data_ptr(),
            None if hidden is None else hidden.data_ptr(), T, k_caches, v_caches, *first.meta_args(metas[0]),
            logits_indices.data_ptr() if n else None, n, None if logits is None else logits.data_ptr(),
            None if argmax is None else argmax.data_ptr(),
        )  # fmt: skip
        if rc != 0:
            why = "a token id or position outside its table" if rc == -2 else "a kernel refused a layer's shapes"
            raise ValueError(f"decoder_step_float: {why} (status {rc})")
        return (hidden if last else residual), logits, argmax

    def _cache_arrays(self, kv_caches) -> tuple:
        """The layers' K and V cache addresses as C arrays, rebuilt when the caches are others (the runner's list
        of them is kept for the engine's life; its first and last tensors' addresses are checked too)."""
        key = (id(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr())
        if self._caches is None or self._caches[0] != key:
            n = len(self.layers)
            self._caches = (
                key,
                (ctypes.c_void_p * n)(*(k.data_ptr() for k, _ in kv_caches)),
                (ctypes.c_void_p * n)(*(v.data_ptr() for _, v in kv_caches)),
            )
        return self._caches[1:]

    def __call__(self, residual, x, rope, kv_caches, metas) -> torch.Tensor | None:
        meta, first = metas[0], self.first
        if (
            len(kv_caches) != len(self.layers)
            or not all(map(operator.is_, metas, itertools.repeat(meta)))
            or not first.takes(residual, x, rope, kv_caches[0][0], self.max_rows)
        ):
            return None
        k_caches, v_caches = self._cache_arrays(kv_caches)
        out, head, tail = first.step_args(residual, x, rope, meta)
        rc = self.lib.decoder_layers_float(self._descs, len(self.layers), *head, k_caches, v_caches, *tail)
        if rc != 0:
            raise ValueError(f"decoder_layers_float: a kernel refused a layer's shapes (status {rc})")
        return out


class DeltaDesc(ctypes.Structure):
    """decoder_layer.c's DeltaDesc: a Gated DeltaNet decoder layer's shape, norms, DeltaNet weights and linears."""

    _fields_ = [
        ("hidden", ctypes.c_int),
        ("inter", ctypes.c_int),
        ("nk", ctypes.c_int),
        ("nv", ctypes.c_int),
        ("dk", ctypes.c_int),
        ("dv", ctypes.c_int),
        ("kernel", ctypes.c_int),
        ("tiled", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("norm_eps", ctypes.c_float),
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("conv_w", ctypes.c_void_p),
        ("A_log", ctypes.c_void_p),
        ("dt_bias", ctypes.c_void_p),
        ("norm_w", ctypes.c_void_p),
        ("qkvz", LayerLinear),
        ("ba", LayerLinear),
        ("out", LayerLinear),
        ("gate_up", LayerLinear),
        ("down", LayerLinear),
    ]


class FusedDeltaLayer:
    """A Qwen3.5 decoder layer of linear attention (models/qwen3_5.py: input norm, the Gated DeltaNet's projections,
    its one-token step, out_proj, post norm, SwiGLU MLP) run by one `delta_layer_float` call per decode step, with
    the kernels the op-by-op layer calls (the DeltaNet step is ops.gated_delta_net_decode_'s), so the output is the
    same. At batch 1 its ~12 Python-level ops cost about what its arithmetic does.

    __call__(residual, x, state, meta) takes what the layer's forward does (state: the layer's float32 [slots,
    state_size]; meta: the step's StateMetadata) and returns its MLP output [T, hidden], or None (nothing done)
    unless every one of the T <= max_rows tokens is a decode of a sequence with a state, the tensors are float32 on
    the CPU and the kernels are on. Raises ValueError when a kernel refuses a shape.
    """

    def __init__(self, lib, desc: DeltaDesc, keep: list[torch.Tensor], max_rows: int):
        self.lib, self.desc, self.max_rows = lib, desc, max_rows
        self._keep = keep  # the tensors whose addresses `desc` holds
        self._desc_ref = ctypes.byref(desc)

    @classmethod
    def build(cls, layer) -> "FusedDeltaLayer | None":
        """The fused form of `layer` (a Qwen3_5DecoderLayer of linear attention), or None where it has something
        delta_layer_float does not compute (tensor parallelism, float weights, a mixture of experts, heads over
        1024 wide)."""
        lib = cpu_kernels.load()
        net, mlp = getattr(layer, "linear_attn", None), layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if (
            lib is None
            or net is None
            or not isinstance(mlp, SwiGLUMLP)
            or max(net.dk, net.dv) > 1024
            or any(w.dtype != torch.float32 or w.device.type != "cpu" for w in norms)
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps
        ):
            return None
        modules = (net.in_proj_qkvz, net.in_proj_ba, net.out_proj, mlp.gate_up_proj, mlp.down_proj)
        weights = [_segments(m) for m in modules]
        if any(w is None for w in weights):
            return None
        # the DeltaNet's float32 tensors as the kernel reads them (the same tensors where they already are)
        floats = [t.float().contiguous() for t in (net.conv1d.weight, net.A_log, net.dt_bias, net.norm.weight)]
        biases = [_float32(getattr(m, "bias", None)) for m in modules]
        qkvz, ba, out, gate_up, down = (_linear(m, w, b) for m, w, b in zip(modules, weights, biases))
        desc = DeltaDesc(
            hidden=norms[0].shape[0],
            inter=mlp.down_proj.quant_method.input_size,
            nk=net.nk,
            nv=net.nv,
            dk=net.dk,
            dv=net.dv,
            kernel=net.kernel,
            tiled=int(net.tiled_heads),
            eps=layer.input_layernorm.eps,
            norm_eps=net.norm.eps,
            input_norm=norms[0].data_ptr(),
            post_norm=norms[1].data_ptr(),
            conv_w=floats[0].data_ptr(),
            A_log=floats[1].data_ptr(),
            dt_bias=floats[2].data_ptr(),
            norm_w=floats[3].data_ptr(),
            qkvz=qkvz,
            ba=ba,
            out=out,
            gate_up=gate_up,
            down=down,
        )
        max_rows = min([DECODE_MAX_ROWS] + [w.kernel_rows for segments in weights for w in segments])
        return cls(lib, desc, list(norms) + floats + [b for b in biases if b is not None], max_rows)

    def __call__(self, residual, x, state, meta) -> torch.Tensor | None:
        n = residual.shape[0]
        tensors = (residual,) if x is None else (residual, x)
        if (
            n > self.max_rows
            or not ops.kernels_enabled()
            or meta.num_decodes != n
            or not all(meta.has_initial_state[:n])
            or state.dtype != torch.float32
            or state.stride(1) != 1
            or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors)
        ):
            return None
        out = torch.empty_like(residual)
        slots = meta.state_indices[:n].to(torch.int64).contiguous()
        rc = self.lib.delta_layer_float(
            self._desc_ref, residual.data_ptr(), None if x is None else x.data_ptr(), out.data_ptr(), n,
            state.data_ptr(), state.stride(0), slots.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"delta_layer_float: a kernel refused the layer's shapes (status {rc})")
        return out
