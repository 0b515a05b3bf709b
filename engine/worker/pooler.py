"""Embeddings: the final hidden states of an embedding request's prompt pooled into one vector
(vLLM's pooler: last-token or mean pooling, then L2 normalisation)."""

from dataclasses import dataclass

import torch

from engine.config.pooler import PoolerConfig


@dataclass
class PoolingRows:
    """Rows `row .. row + count - 1` of a step's hidden states are prompt positions of the embedding
    request `request_id`; `last` when they end its prompt."""

    request_id: str
    row: int
    count: int
    last: bool


def pool(hidden: torch.Tensor, rows: list[PoolingRows], pooling_type: str) -> dict[str, torch.Tensor]:
    """This step's share of each request's embedding, float32 [hidden] on the CPU: the sum of its rows
    (MEAN: added up over the chunks of its prompt), or its last prompt position's state (LAST: only
    from the chunk that ends the prompt)."""
    out = {}
    for r in rows:
        if pooling_type == "MEAN":
            out[r.request_id] = hidden[r.row : r.row + r.count].float().sum(dim=0).cpu()
        elif r.last:
            out[r.request_id] = hidden[r.row + r.count - 1].float().cpu()
    return out


def finish(pooled: torch.Tensor, num_prompt_tokens: int, config: PoolerConfig) -> torch.Tensor:
    """The embedding (float32 [hidden]) from a request's pooled state: the mean for MEAN, then L2-normalised
    if asked."""
    vector = pooled / num_prompt_tokens if config.pooling_type == "MEAN" else pooled
    if config.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector
