"""Paged attention with FlashInfer's kernels (Ye et al., "FlashInfer", MLSys 2025): the CUDA path.

FlashInfer describes a batch's paged KV cache in CSR form: sequence i owns the pages
`paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]]`, all full except the last, which holds
`paged_kv_last_page_len[i]` tokens (1..page_size); its queries are rows `qo_indptr[i]:qo_indptr[i+1]`
of q. `paged_kv_indices` derives these arrays from the engine's block tables. A "wrapper" object is
planned once per step on the host (work split, scratch offsets) and then run by every layer.

`import flashinfer` happens only when a backend is built, so this module imports without it.
"""

import functools
import logging
from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np
import torch

from models.attention.base import AttentionBackend, AttentionMetadata
from models.kernels import ops

logger = logging.getLogger(__name__)

# Split-KV scratch for all wrappers; 128 MiB is FlashInfer's recommended size. The wrappers run one
# after another on one stream, so they can share it. Graph-mode decodes of large batches need more:
# see graph_workspace_bytes.
WORKSPACE_BYTES = 128 << 20


@functools.cache
def flashinfer_available() -> bool:
    """True when `import flashinfer` works (the package and the libraries it imports are installed)."""
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # any failure to import means the backend cannot run here
        logger.info("flashinfer is not usable: %r", e)
        return False
    return True


def graph_workspace_bytes(num_heads: int, num_kv_heads: int, head_dim: int, batch_size: int) -> int:
    """Bytes of workspace that a use_cuda_graph decode wrapper's plan() takes for `batch_size` rows.

    Read from FlashInfer's include/flashinfer/attention/scheduler.cuh (PrefillPlan and
    PrefillSplitQOKVIndptr; flashinfer-python 0.6 is what pyproject allows): with use_tensor_cores the
    decode wrapper plans a prefill of one query per row, and in graph mode it always splits the KV,
    taking float32 partial outputs and log-sum-exps for a padded count of work tiles:
        num_heads * padded * tile_q * (head_dim + 1) * 4 bytes,
        padded = ceil(batch_size * group / tile_q) + batch_size - 1,
    where group = num_heads / num_kv_heads query heads are packed per row and tile_q (its CTA tile)
    is 16 for groups up to 16, else 64, or 128 past 64 when head_dim < 256 (Ampere or newer).
    For Llama-3-8B (32 heads, group 4, head_dim 128) that is about heads x 1.25 batch x 16 x head_dim
    x 4 bytes, over 128 MiB past batch ~408. FlashInfer also pads to at least 2 * SMs / num_kv_heads
    tiles; that floor is left out: with groups up to 16 and head_dim up to 256 it stays under
    WORKSPACE_BYTES on GPUs of up to 250 SMs, and no workspace is smaller than that.
    """
    group = num_heads // num_kv_heads
    tile_q = 16 if group <= 16 else 64 if group <= 64 or head_dim >= 256 else 128
    padded = -(-batch_size * group // tile_q) + batch_size - 1
    return num_heads * padded * tile_q * (head_dim + 1) * 4


def paged_kv_indices(
    block_tables: torch.Tensor,
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
    block_size: int,
    start: int,
    end: int,
):
    """FlashInfer's paged-KV arrays for the batch rows start..end-1 (a contiguous run of sequences).

    block_tables: int32 or int64 [B, max_blocks] (any device); seq_lens: B ints, KV tokens of each
    sequence after this step; query_start_loc: B + 1 ints, offsets of each sequence's new tokens.
    Returns, for the n = end - start rows, all int32:
      qo_indptr [n + 1] (CPU), rebased so that row `start`'s first query token is 0;
      paged_kv_indptr [n + 1] (CPU); paged_kv_last_page_len [n] (CPU);
      paged_kv_indices [paged_kv_indptr[-1]] on block_tables' device: the first
        ceil(seq_len / block_size) entries of each row's block table, rows laid end to end.
    The host arrays come from the Python lists, so nothing waits for the device.
    """
    # numpy, not torch, on the host: a step's plan is on the critical path of a decode step (the GPU waits for
    # it), and numpy's small-array ops take a fraction of torch's dispatch (60 us against 160 us at batch 1)
    lens = np.asarray(seq_lens[start:end], dtype=np.int64)
    num_pages = (lens + block_size - 1) // block_size
    kv_indptr = np.zeros(end - start + 1, dtype=np.int64)
    np.cumsum(num_pages, out=kv_indptr[1:])
    last_page_len = lens - (num_pages - 1) * block_size
    qsl = np.asarray(query_start_loc[start : end + 1], dtype=np.int64)
    # Flat positions of the wanted block-table entries, so one gather on the device picks them
    # (a boolean mask would make the device report the result size back to the host).
    rows = np.repeat(np.arange(start, end), num_pages)
    cols = np.arange(kv_indptr[-1]) - np.repeat(kv_indptr[:-1], num_pages)
    flat = torch.from_numpy(rows * block_tables.shape[1] + cols).to(block_tables.device)
    indices = block_tables.reshape(-1)[flat].to(torch.int32)  # FlashInfer's kernels take int32 indices

    def host(a):
        return torch.from_numpy(a.astype(np.int32))

    return host(qsl - qsl[0]), host(kv_indptr), indices, host(last_page_len)


class FlashInferBackend(AttentionBackend):
    """Decode rows run BatchDecodeWithPagedKVCacheWrapper on tensor cores (use_tensor_cores=True,
    which FlashInfer advises for grouped-query attention; Llama-3-8B's groups are 4). Prefill
    chunks run BatchPrefillWithPagedKVCacheWrapper with causal=True, whose mask is aligned to the
    end of the KV: query j of a chunk of q tokens over a KV of n tokens sees keys 0..n-q+j, i.e.
    the cached prefix and its own chunk up to itself.

    dtype: the model dtype (queries and cache); device: the CUDA device of the cache.
    CUDA graphs: `init_cuda_graph_decode` makes one graph-safe decode wrapper per batch size, and
    inside `cuda_graph_decode(bs)` plan() and forward() use that wrapper instead of the eager one.
    """

    supports_cuda_graphs = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        scale: float,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window, logits_soft_cap)
        import flashinfer

        self._flashinfer = flashinfer
        self.dtype, self.device = dtype, torch.device(device)
        # zeros: FlashInfer asks for a zeroed workspace on first use
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._eager_decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=True
        )
        self._decode = self._eager_decode
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._graph_decode: dict[int, object] = {}

    def init_cuda_graph_decode(self, batch_sizes: Sequence[int], max_blocks_per_seq: int) -> None:
        """Builds a use_cuda_graph decode wrapper for each batch size.

        A captured kernel reads its index arrays from fixed addresses, so each wrapper gets fixed
        buffers that its plan() refills. All sizes share one set of buffers (views of the largest):
        a graph is only replayed right after its own plan, so no two are live at once. They share
        the eager workspace too, unless the largest size's split-KV scratch (graph_workspace_bytes)
        exceeds it: then they share one of that size, and the eager wrappers keep theirs.
        """
        max_bs = max(batch_sizes)
        dev, i32 = self.device, torch.int32
        workspace = self._workspace
        need = graph_workspace_bytes(self.num_heads, self.num_kv_heads, self.head_dim, max_bs)
        if need > WORKSPACE_BYTES:
            logger.info(
                "FlashInfer's graphed decodes up to batch %d need %.0f MiB of split-KV scratch, more "
                "than the eager %d MiB: they get a workspace of their own",
                max_bs,
                need / 2**20,
                WORKSPACE_BYTES >> 20,
            )
            workspace = torch.zeros(need, dtype=torch.uint8, device=dev)
        indptr = torch.zeros(max_bs + 1, dtype=i32, device=dev)
        indices = torch.zeros(max_bs * max_blocks_per_seq, dtype=i32, device=dev)
        last_page_len = torch.zeros(max_bs, dtype=i32, device=dev)
        for bs in batch_sizes:
            self._graph_decode[bs] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr[: bs + 1],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len[:bs],
            )

    @contextmanager
    def cuda_graph_decode(self, batch_size: int):
        """Within the block, decode rows (exactly batch_size of them) use the graph-safe wrapper."""
        self._decode = self._graph_decode[batch_size]
        try:
            yield
        finally:
            self._decode = self._eager_decode

    def plan(self, meta: AttentionMetadata) -> None:
        # FlashInfer's plan copies its host-side split tables through one pinned buffer per wrapper
        # with an async copy: call it only after the previous step's results reached the host.
        nd, b = meta.num_decodes, meta.num_seqs
        args = (meta.block_tables, meta.seq_lens_cpu, meta.query_start_loc_cpu, self.block_size)
        dims = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        # FlashInfer's window_left counts the keys left of the query's own: W - 1 for a window of W
        window_left = self.sliding_window - 1 if self.sliding_window else -1
        dtypes = dict(
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=self.scale,
            window_left=window_left,
            logits_soft_cap=self.logits_soft_cap,
        )
        if nd:
            _, indptr, indices, last = paged_kv_indices(*args, 0, nd)
            self._decode.plan(indptr, indices, last, *dims, **dtypes)
        if b > nd:
            qo_indptr, indptr, indices, last = paged_kv_indices(*args, nd, b)
            self._prefill.plan(qo_indptr, indptr, indices, last, *dims, causal=True, **dtypes)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, sinks=None):
        k_cache, v_cache = kv_cache
        # Write all new K/V before any read, as torch_native does: sequences sharing a block filled in
        # this same step must see it.
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        q = q.contiguous()  # the model hands q as a strided slice of its fused qkv projection
        out = torch.empty_like(q)  # the kernels write it densely
        nd = meta.num_decodes  # decode rows have one token each, so they are q[:nd]
        if nd:
            self._decode.run(q[:nd], kv_cache, out=out[:nd])
        if meta.num_seqs > nd:
            self._prefill.run(q[nd:], kv_cache, out=out[nd:])
        return out
