"""Mixture-of-experts feed-forward (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen2/3-MoE): a router picks
each token's top-k experts, each a SwiGLU MLP, and sums their outputs weighted by the router's probabilities
(plus, in Qwen2-MoE, a shared expert every token takes, behind a sigmoid gate).

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
from models.quantization.gguf import GGUFConfig

# a checkpoint's expert tensors: one expert's (Hugging Face hub layout) or every expert's stacked (GGUF, as
# models/gguf.py names them); the projection names of Qwen-MoE / OLMoE and of Mixtral
EXPERT = re.compile(
    r"(?P<prefix>.*\.experts)\.(?:(?P<expert>\d+)\.)?(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
PROJECTIONS = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def expert_shard(name: str) -> tuple[str, tuple[int | None, int]] | None:
    """(FusedMoE parameter name, its weight_loader's shard) of a checkpoint's expert tensor name (after the
    "model." prefix), or None for any other tensor: `layers.0.mlp.experts.3.up_proj.weight` ->
    (`layers.0.mlp.experts.w13_weight`, (3, 1)); `layers.0.mlp.experts.down_proj.weight` (every expert) ->
    (`layers.0.mlp.experts.w2_weight`, (None, 2))."""
    m = EXPERT.fullmatch(name)
    if m is None:
        return None
    proj = PROJECTIONS[m["proj"]]
    expert = int(m["expert"]) if m["expert"] is not None else None
    return f"{m['prefix']}.{'w13_weight' if proj < 2 else 'w2_weight'}", (expert, proj)


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
    and `w13_weight` / `w2_weight` are empty placeholders keeping the parameter names.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup | None = None,
        quant_config: GGUFConfig | None = None,
    ):
        super().__init__()
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

    def weight_loader(self, param: nn.Parameter, loaded, shard: tuple[int | None, int]) -> None:
        """Copies one checkpoint tensor: shard = (expert, projection 0 gate / 1 up / 2 down) for one expert's
        [rows, cols] matrix (a Hugging Face checkpoint's), or (None, projection) for every expert's
        [E, rows, cols] (a GGUF file's). This rank keeps its slice of the intermediate dimension. Raises
        ValueError on a shape that is not the layer's."""
        expert, proj = shard
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

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e's SwiGLU MLP of its tokens x [n, hidden] -> [n, hidden]."""
        q = self.quant_method
        if q is not None:
            gate_up = torch.cat((q.matmul(x, 0, e), q.matmul(x, 1, e)), dim=-1)
            return q.matmul(ops.silu_and_mul(gate_up), 2, e)
        return ops.linear(ops.silu_and_mul(ops.linear(x, self.w13_weight[e])), self.w2_weight[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
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
    (float32 [E, hidden]: routing decisions are not rounded to the model dtype), `experts`, and Qwen2-MoE's
    gated `shared_expert` where the config has one. x [T, hidden] -> [T, hidden] in x's dtype."""

    def __init__(self, config, tp: TPGroup | None, quant_config: GGUFConfig | None = None):
        super().__init__()
        num_experts = getattr(config, "num_experts", None) or config.num_local_experts
        self.top_k = config.num_experts_per_tok
        # Mixtral always renormalises its top-2 probabilities; Qwen-MoE as its config says
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False, dtype=torch.float32)
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.experts = FusedMoE(num_experts, config.hidden_size, inter, tp, quant_config)
        shared = getattr(config, "shared_expert_intermediate_size", None)
        self.shared_expert = SwiGLUMLP(config.hidden_size, shared, tp, quant_config) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False, dtype=torch.float32) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
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
