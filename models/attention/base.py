"""The attention-backend interface: what the model runner hands every attention layer each step."""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from models.attention.kv_cache_dtype import STORAGE, kv_cache_code, row_elements


@dataclass
class AttentionMetadata:
    """Where each token of one engine step reads and writes the paged KV cache.

    The batch holds B sequences whose tokens are laid end to end (T tokens in all); the first
    `num_decodes` sequences have exactly one query token (decodes), the rest are prefill chunks,
    possibly after a cached or earlier-computed prefix.

    query_start_loc: int32 [B + 1], offsets of each sequence's tokens in the flat batch.
    seq_lens: int32 [B], tokens in each sequence's KV after this step (context + new tokens).
    block_tables: int32 [B, max_blocks], the KV blocks of each sequence in order, padded with 0.
    slot_mapping: int64 [T], block_id * block_size + offset where each new token's K/V is written.
    query_start_loc_cpu / seq_lens_cpu: the same as Python lists, so loops need no device sync.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Paged attention for one model: `plan` once per step, then `forward` once per layer.

    The KV cache of one layer is a pair (k_cache, v_cache), each of `kv_cache_shape(num_blocks)` in
    the model dtype: [num_blocks, block_size, num_kv_heads, head_dim] (FlashInfer's "NHD" paged layout)
    unless a backend says otherwise; with a quantized `kv_cache_dtype` each head's row is its quantized bytes
    (`cache_dtype`, models.attention.kv_cache_dtype), written and read by the backend. With `sliding_window`
    W a query at position p attends to keys p - W + 1 .. p only (the layers of one KV cache group share a
    backend; models.attention.make_backends). With `logits_soft_cap` c the scaled scores s become
    c * tanh(s / c) before the softmax (Gemma 2).

    CUDA graphs (engine/worker/cuda_graph.py) call `init_cuda_graph_decode` once and then plan and
    run each captured decode inside `cuda_graph_decode(batch_size)`; both do nothing here.
    """

    # True when the decode keeps graph-safe state (fixed buffers that plan() refills) so that a
    # captured decode serves any context length. The model runner captures CUDA graphs only for such
    # backends: the others (torch_native) can be captured only by gathering every row at full
    # max_model_len, which costs memory and time in proportion to it.
    supports_cuda_graphs: bool = False
    # True when `forward` takes attention sinks (gpt-oss); a model that has them refuses a backend without
    supports_sinks: bool = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        kv_cache_dtype: str = "auto",
        dtype: torch.dtype | None = None,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype  # q, k, v and the output (None: the KV cache's dtype)
        self.block_size, self.scale, self.sliding_window = block_size, scale, sliding_window
        self.logits_soft_cap = logits_soft_cap
        # a quantized cache (models.attention.kv_cache_dtype): its code, and the elements of one head's row
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_quant = kv_cache_code(kv_cache_dtype, head_dim)
        self.row = row_elements(head_dim, self.kv_quant)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (or V) cache for `num_blocks` blocks (a quantized row's bytes last)."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.row)

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model in `dtype`: its own, or a quantized cache's storage dtype."""
        return STORAGE[self.kv_quant] if self.kv_quant else dtype

    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare per-step state shared by all layers (index arrays, kernel plans)."""

    def init_cuda_graph_decode(self, batch_sizes: Sequence[int], max_blocks_per_seq: int) -> None:
        """Prepares graph-safe decode state for each of `batch_sizes` (the captured sizes), over
        block tables of `max_blocks_per_seq` columns. Nothing by default."""

    def cuda_graph_decode(self, batch_size: int) -> AbstractContextManager:
        """A context within which plan() and forward() serve a captured decode of exactly
        `batch_size` rows. By default it changes nothing."""
        return nullcontext()

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache at `meta.slot_mapping`, then attend.

        q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; all in the model dtype.
        Each query attends causally to its sequence's cached prefix and to the new tokens up to itself (the
        last `sliding_window` of them with a window). `sinks`: float32 [num_heads], the layer's attention sinks
        (gpt-oss: one logit per query head joining each softmax's denominator, with no value; OpenAI 2025, after
        Xiao et al. 2023), only where `supports_sinks`. Returns [T, num_heads, head_dim].
        """
