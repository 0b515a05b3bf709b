"""Pipeline parallelism's model side: which decoder layers a stage holds, and the placeholder for those it
does not (vLLM's `get_pp_indices` in vllm/distributed/utils.py and `PPMissingLayer`).

A stage holds a contiguous run of layers; the first stage also the embedding, the last the final norm and
the LM head (and the embedding too when the head is tied to it). Between stages only the float32 residual
stream [T, hidden] travels: a stage adds its last sublayer's output into it before sending it on, so the
next stage starts as if at the first layer (no pending sublayer output).
"""

from dataclasses import dataclass

from torch import nn


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int, partition: tuple[int, ...] | None = None):
    """The layers [start, end) of stage `pp_rank` of `pp_size`.

    Without `partition` the layers split evenly, the stages before the last taking one more each while
    some are left over (the last stage also runs the norm, the LM head and the sampler: vLLM's rule).
    `partition` gives each stage's layer count instead (vLLM's VLLM_PP_LAYER_PARTITION). Raises ValueError
    when there are fewer layers than stages, or a partition that does not have pp_size positive counts
    summing to num_layers.
    """
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} is more than the model's {num_layers} layers")
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) < 1:
            raise ValueError(
                f"pp_layer_partition {','.join(map(str, partition))} must be {pp_size} positive layer counts "
                f"summing to the model's {num_layers} layers"
            )
        counts = list(partition)
    else:
        counts = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            counts[-2 - i] += 1
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


@dataclass(frozen=True)
class PPStage:
    """One pipeline stage as the model sees it: its layers [start_layer, end_layer), and whether it is the
    first (embeds the tokens) and the last (final norm and logits). `PPStage.whole(n)`: no pipeline."""

    start_layer: int
    end_layer: int
    is_first: bool = True
    is_last: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> "PPStage":
        return cls(0, num_layers)

    @classmethod
    def of(cls, num_layers: int, pp_rank: int, pp_size: int, partition: tuple[int, ...] | None = None) -> "PPStage":
        """Stage `pp_rank` of `pp_size` (get_pp_indices; raises its ValueError)."""
        start, end = get_pp_indices(num_layers, pp_rank, pp_size, partition)
        return cls(start, end, pp_rank == 0, pp_rank == pp_size - 1)

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def holds(self, layer: int) -> bool:
        return self.start_layer <= layer < self.end_layer


class PPMissingLayer(nn.Module):
    """Stands where a module of another stage would be (a decoder layer, the embedding, the norm, the LM
    head), so that layer indices and checkpoint names stay the model's; it has no weights and is never
    called. The checkpoint loader skips the tensors under it."""
