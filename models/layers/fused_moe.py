"""Mixture-of-experts feed-forward (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen2/3-MoE; gpt-oss, OpenAI
2025): a router picks each token's top-k experts, each a SwiGLU MLP, and sums their outputs weighted by the
router's probabilities (plus, in Qwen2-MoE, a shared expert every token takes, behind a sigmoid gate; gpt-oss's
router and experts have biases and its SwiGLU is clamped).

The step's tokens are grouped by expert, so each active expert's weights are read once per step however many
tokens chose it (vLLM's `FusedMoE` does the same on the GPU). Expert weights are one tensor per projection for
all experts: float [E, rows, cols], or the GGUF file's quantized blocks (`GGUFTensor` of E * rows rows, each
expert's rows a byte range), as llama.cpp's converter stacks them (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`). Under tensor parallelism each rank keeps its slice of every expert's intermediate dimension
(gate/up rows, down columns) and the block's output is summed over ranks, as the dense MLP is.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from models.distributed.group import TPGroup
from models.kernels import ops
from models.layers.linear import _rank_size
from models.layers.mlp import SwiGLUMLP
from models.quantization.gguf import GGUFConfig, GGUFTensor

# a checkpoint's expert tensors: one expert's (Hugging Face hub layout) or every expert's stacked (GGUF, as
# models/gguf.py names them); the projection names of Qwen-MoE / OLMoE and of Mixtral
EXPERT = re.compile(
    r"(?P<prefix>.*\.experts)\.(?:(?P<expert>\d+)\.)?(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\."
    r"(?P<kind>weight|bias)"
)
PROJECTIONS = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
# gpt-oss's clamped SwiGLU (its config's swiglu_alpha and swiglu_limit; llama.cpp fixes these for the architecture)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
# the values of MXFP4's 4-bit codes (OCP Microscaling FP4 E2M1: sign, 2 exponent bits, 1 mantissa bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expert_shard(name: str) -> tuple[str, tuple[int | None, int]] | None:
    """(FusedMoE parameter name, its weight_loader's shard) of a checkpoint's expert tensor name (after the
    "model." prefix), or None for any other tensor: `layers.0.mlp.experts.3.up_proj.weight` ->
    (`layers.0.mlp.experts.w13_weight`, (3, 1)); `layers.0.mlp.experts.down_proj.weight` (every expert) ->
    (`layers.0.mlp.experts.w2_weight`, (None, 2)); `.bias` (gpt-oss) -> `w13_bias` / `w2_bias`."""
    m = EXPERT.fullmatch(name)
    if m is None:
        return None
    proj = PROJECTIONS[m["proj"]]
    expert = int(m["expert"]) if m["expert"] is not None else None
    return f"{m['prefix']}.{'w13' if proj < 2 else 'w2'}_{m['kind']}", (expert, proj)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, K] of a Hugging Face MXFP4 checkpoint's `*_blocks` (uint8 [..., rows, K / 32, 16]: two
    codes a byte, the even element in the low nibble) and `*_scales` (uint8 [..., rows, K / 32]: a power of two,
    2^(e - 127), per 32 values), as transformers' Mxfp4 integration dequantizes them. Exact."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2).long()  # [..., rows, K / 32, 32]
    values = lut[codes] * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2)


def gpt_oss_tensors(weights):
    """A gpt-oss checkpoint's tensors (Hugging Face names) renamed to those FusedMoE, SparseMoeBlock and
    SelfAttention load: its router `mlp.router` is `mlp.gate`; its experts' fused, transposed `gate_up_proj`
    [E, hidden, 2 * inter] (gate and up columns interleaved) and `down_proj` [E, inter, hidden], with their biases,
    become every expert's gate, up and down [E, rows, cols] (MXFP4 `*_blocks` / `*_scales` pairs, as OpenAI
    ships them, dequantized: float32 [E, rows, cols] already); the GGUF file's `sinks.weight` is `sinks`.
    Other tensors pass unchanged."""
    blocks = {}
    for name, tensor in weights:
        name = re.sub(r"(^|\.)mlp\.router\.", r"\1mlp.gate.", name).replace("self_attn.sinks.weight", "self_attn.sinks")
        head, _, leaf = name.rpartition(".experts.")
        if not head:
            yield name, tensor
            continue
        prefix = f"{head}.experts."
        if leaf.endswith("_blocks"):
            blocks[prefix + leaf.removesuffix("_blocks")] = tensor
            continue
        if leaf.endswith("_scales"):
            leaf = leaf.removesuffix("_scales")
            w, kind = dequantize_mxfp4(blocks.pop(prefix + leaf), tensor), "weight"
        elif leaf in ("gate_up_proj", "down_proj"):
            w, kind = tensor.transpose(-1, -2), "weight"
        elif leaf in ("gate_up_proj_bias", "down_proj_bias"):
            w, kind, leaf = tensor, "bias", leaf.removesuffix("_bias")
        else:
            yield name, tensor
            continue
        if leaf == "gate_up_proj":  # the weight's rows [E, 2 * inter, hidden] or the bias's [E, 2 * inter]: gate even
            yield prefix + f"gate_proj.{kind}", w[:, 0::2]
            yield prefix + f"up_proj.{kind}", w[:, 1::2]
        else:
            yield prefix + f"down_proj.{kind}", w


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: (weights float32 [T, top_k], expert ids int64 [T, top_k]) of router_logits [T, E], the
    top-k probabilities renormalised to sum to 1 where the model does (`norm_topk_prob`; Mixtral always)."""
    weights, ids = router_logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """Every expert of one layer: gate and up [E, inter, hidden] (stacked as w13 [E, 2 * inter, hidden]) and down
    [E, hidden, inter], this rank's slice of inter. forward(x [T, hidden], weights float32 [T, k], ids [T, k])
    -> [T, hidden] in x's dtype (summed over ranks).

    With a GGUF `quant_config` (one rank) the experts are its `quant_method`'s (GGUFMoEMethod: the file's blocks)
    and `w13_weight` / `w2_weight` are empty placeholders keeping the parameter names. With `bias` (gpt-oss) each
    projection has one too: w13_bias [E, 2 * inter] (this rank's), w2_bias [E, hidden] (added by rank 0 only).
    `swiglu_limit` (gpt-oss) makes the activation its clamped SwiGLU: (clamp(up, -l, l) + 1) g sigmoid(alpha g),
    g = min(gate, l), vLLM's "swigluoai"; None is SiLU(gate) up, or with `activation` "gelu_tanh" GeGLU,
    GELU_tanh(gate) up (Gemma 4's experts).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup | None = None,
        quant_config: GGUFConfig | None = None,
        bias: bool = False,
        swiglu_limit: float | None = None,
        swiglu_alpha: float = SWIGLU_ALPHA,
        activation: str = "silu",
    ):
        super().__init__()
        self.swiglu_limit, self.swiglu_alpha, self.activation = swiglu_limit, swiglu_alpha, activation
        rank, size = _rank_size(tp)
        if intermediate_size % size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} does not split over {size} ranks")
        self.tp, self.rank = tp, rank
        self.num_experts, self.hidden_size, self.full_inter = num_experts, hidden_size, intermediate_size
        self.inter = intermediate_size // size  # this rank's
        self.quant_method = (
            quant_config.moe_method(num_experts, hidden_size, intermediate_size) if quant_config is not None else None
        )
        if self.quant_method is not None:
            self.w13_weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        else:
            bound = 1 / hidden_size**0.5
            self.w13_weight = nn.Parameter(
                torch.empty(num_experts, 2 * self.inter, hidden_size).uniform_(-bound, bound)
            )
            bound = 1 / intermediate_size**0.5
            self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter).uniform_(-bound, bound))
        self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * self.inter), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded, shard: tuple[int | None, int]) -> None:
        """Copies one checkpoint tensor: shard = (expert, projection 0 gate / 1 up / 2 down) for one expert's
        [rows, cols] matrix (a Hugging Face checkpoint's), or (None, projection) for every expert's
        [E, rows, cols] (a GGUF file's). This rank keeps its slice of the intermediate dimension. Raises
        ValueError on a shape that is not the layer's."""
        expert, proj = shard
        if param is self.w13_bias or param is self.w2_bias:
            return self._load_bias(param, loaded, shard)
        if self.quant_method is not None:
            if expert is not None:
                raise ValueError("quantized experts load as one tensor per projection (a GGUF file's)")
            return self.quant_method.load(proj, loaded)
        want = (self.full_inter, self.hidden_size) if proj < 2 else (self.hidden_size, self.full_inter)
        experts = range(self.num_experts) if expert is None else [expert]
        loaded = loaded if expert is None else loaded[None]
        if tuple(loaded.shape) != (len(experts), *want):
            raise ValueError(f"expert projection {proj}: {want} per expert expected, got {tuple(loaded.shape[1:])}")
        part = slice(self.rank * self.inter, (self.rank + 1) * self.inter)
        for i, e in enumerate(experts):
            if proj < 2:
                param.data[e, proj * self.inter : (proj + 1) * self.inter].copy_(loaded[i, part])
            else:
                param.data[e].copy_(loaded[i, :, part])

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | None, int]) -> None:
        """One expert's bias [rows] or every expert's [E, rows] of projection shard[1]; this rank's slice of
        the gate and up entries."""
        expert, proj = shard
        loaded = loaded.reshape(self.num_experts if expert is None else 1, -1)
        rows = param.data[slice(None) if expert is None else slice(expert, expert + 1)]
        if proj == 2:
            rows.copy_(loaded)
        else:
            part = slice(self.rank * self.inter, (self.rank + 1) * self.inter)
            rows[:, proj * self.inter : (proj + 1) * self.inter].copy_(loaded[:, part])

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2 * inter] (gate | up) -> [n, inter]: SiLU(gate) up, GELU_tanh(gate) up, or gpt-oss's clamped
        SwiGLU."""
        if self.activation == "gelu_tanh":
            return ops.gelu_tanh_and_mul(gate_up)
        if self.swiglu_limit is None:
            return ops.silu_and_mul(gate_up)
        limit = self.swiglu_limit
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.swiglu_alpha)

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's gated MLP of its tokens x [n, hidden] -> [n, hidden]."""
        q = self.quant_method
        if q is not None:
            gate_up = torch.cat((q.matmul(x, 0, e), q.matmul(x, 1, e)), dim=-1)
        else:
            gate_up = ops.linear(x, self.w13_weight[e])
        if self.w13_bias is not None:
            gate_up = gate_up + self.w13_bias[e].to(gate_up.dtype)
        h = self._activation(gate_up)
        out = q.matmul(h, 2, e) if q is not None else ops.linear(h, self.w2_weight[e])
        if self.w2_bias is not None and self.rank == 0:  # once over the ranks' partial sums
            out = out + self.w2_bias[e].to(out.dtype)
        return out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        q = self.quant_method
        if q is not None and self.tp is None and all(isinstance(b, GGUFTensor) for b in q.blocks):
            # quantized experts: the whole layer in one C call where the kernels take them
            bias, act = (self.w13_bias, self.w2_bias), (self.swiglu_limit, self.swiglu_alpha)
            out = ops.gguf_moe(x, weights, ids, q.blocks, self.inter, *bias, *act, self.activation == "gelu_tanh")
            if out is not None:
                return out
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # the (token, choice) pairs grouped by expert
        token_of = order // top_k
        weight_of = weights.flatten()[order].to(x.dtype)[:, None]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = token_of[start : start + n]
                out.index_add_(0, rows, self._expert(x[rows], e) * weight_of[start : start + n])
                start += n
        return out if self.tp is None else self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE feed-forward as Qwen-MoE and Mixtral checkpoints lay it out: the router `gate`
    (float32 [E, hidden], with a bias for gpt-oss: routing decisions are not rounded to the model dtype),
    `experts`, and Qwen2-MoE's gated `shared_expert` where the config has one. x [T, hidden] -> [T, hidden] in x's
    dtype. gpt-oss's softmax over its top-k logits equals the top-k probabilities renormalised, as here."""

    def __init__(self, config, tp: TPGroup | None, quant_config: GGUFConfig | None = None):
        super().__init__()
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        # Mixtral always renormalises its top-2 probabilities; Qwen-MoE as its config says
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        # gpt-oss: biases in the router and the experts, and a clamped SwiGLU
        bias = getattr(config, "model_type", None) == "gpt_oss"
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=bias, dtype=torch.float32)
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        limit = getattr(config, "swiglu_limit", None)
        alpha = getattr(config, "swiglu_alpha", None) or SWIGLU_ALPHA
        self.experts = FusedMoE(num_experts, config.hidden_size, inter, tp, quant_config, bias, limit, alpha)
        shared = getattr(config, "shared_expert_intermediate_size", None)
        self.shared_expert = SwiGLUMLP(config.hidden_size, shared, tp, quant_config) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False, dtype=torch.float32) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.gate.bias is None else self.gate.bias.float()
        # float32 activations route in one C call, the one-call decoder layer's arithmetic (ops.moe_route)
        routed = ops.moe_route(x, self.gate.weight, bias, self.top_k, self.renormalize)
        if routed is None:
            router_logits = F.linear(x.float(), self.gate.weight.float(), bias)
            routed = select_experts(router_logits, self.top_k, self.renormalize)
        weights, ids = routed
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            scale = torch.sigmoid(F.linear(x.float(), self.shared_expert_gate.weight.float())).to(x.dtype)
            out = out + scale * self.shared_expert(x)
        return out


def is_sparse_layer(config, layer: int) -> bool:
    """Whether decoder layer `layer` has an MoE feed-forward: Qwen-MoE's `decoder_sparse_step` and
    `mlp_only_layers`, every layer for Mixtral; False for dense models."""
    if not (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)):
        return False
    if layer in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0
