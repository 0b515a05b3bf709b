"""The vocabulary-parallel embedding and LM head (Megatron-LM, Shoeybi et al. 2019; vLLM's
vocab_parallel_embedding.py): the table split by vocabulary rows over the tensor-parallel ranks, one
all-reduce for lookups and a gather of the logits on rank 0. Built with a GGUF quantization config the
table stays in its blocks (models/quantization)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.distributed.group import TPGroup
from models.distributed.pipeline import PPMissingLayer, PPStage
from models.kernels import ops
from models.layers.linear import _placeholder, _rank_size
from models.quantization.gguf import GGUFConfig


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows, also used as the LM head (tied or not).

    Rank r holds ids [r * V_r, (r + 1) * V_r), V_r = ceil(vocab_size / N); the last rank's table is
    padded with zero rows. forward: ids int64 [T] -> [T, hidden]: each rank looks up its own ids,
    zeros for the others, and one all-reduce sums them. weight: [V_r, hidden].
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None, quant_config: GGUFConfig | None = None):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        rank, size = _rank_size(tp)
        rows = -(-vocab_size // size)
        self.start = rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.reset_parameters()
        self.quant_method = quant_config.embedding_method(vocab_size, hidden_size) if quant_config else None
        if self.quant_method is not None:
            self.weight = _placeholder()

    def reset_parameters(self) -> None:
        # as nn.Embedding starts; on the meta device (the runner's build) there is nothing to draw, and
        # normal_ there would import torch's decompositions and dynamo (1-1.5 s of start-up)
        if not self.weight.is_meta:
            nn.init.normal_(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(input_ids)
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [N, vocab_size] of hidden [N, hidden] on rank 0 (None on the others): each rank
        computes its vocabulary slice, gathered on rank 0 (vLLM's choice on GPUs; an all-gather would
        send every rank logits it throws away)."""
        if self.quant_method is not None:
            return self.quant_method.logits(hidden)
        logits = ops.logits(hidden, self.weight)
        if self.tp is not None and (logits := self.tp.gather(logits)) is None:
            return None
        return logits[:, : self.vocab_size]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if self.quant_method is not None:
            return self.quant_method.load(loaded)
        rows = loaded[self.start : self.start + param.shape[0]]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same vocabulary split, initialised as nn.Linear(hidden, vocab) would be."""

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.weight.shape[1])
        nn.init.uniform_(self.weight, -bound, bound)


def embedding_and_head(
    config, tp: TPGroup | None, quant_config: GGUFConfig | None, pp: PPStage, tie: bool
) -> tuple[nn.Module, nn.Module | None]:
    """A decoder's token embedding and LM head as one pipeline stage holds them: the embedding on the first stage
    (and on the last when the head is `tie`d to it), the head (None when tied) on the last; PPMissingLayer on the
    stages without them."""
    embed = (
        VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, quant_config)
        if pp.is_first or (pp.is_last and tie)
        else PPMissingLayer()
    )
    if tie:
        return embed, None
    head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, quant_config) if pp.is_last else PPMissingLayer()
    return embed, head
