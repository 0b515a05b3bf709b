"""CUDA graphs for decode steps: the batch-size ladder, padding, capture and replay.

A decode step of a small model is bound by kernel launches, not by the GPU: a graph replays the
whole forward (all layers' kernels) with one launch. A graph fixes its shapes and the addresses it
reads, so, as in vLLM, one graph is captured per batch size of a ladder, all into one memory pool,
over static input buffers; a decode batch is padded up to the next captured size. Mixed and
prefill steps run eagerly.

The attention backend takes part through two hooks of AttentionBackend, no-ops by default:
`init_cuda_graph_decode(sizes, max_blocks_per_seq)`, called once, and the `cuda_graph_decode(bs)`
context, inside which the graph of size bs is captured and each of its replays planned. FlashInferBackend
(`supports_cuda_graphs`) keeps graph-safe decode state per size through them. A backend without
such state (torch_native) is captured with every sequence at the full length of the static block
table, so the recorded gather covers any context and the device-side seq_lens mask it; that costs
memory and time in proportion to max_model_len, so the model runner captures graphs only for
backends with `supports_cuda_graphs` (the tests capture torch_native too).
"""

import bisect
import contextlib
import logging
import time

import torch

from models.attention.base import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, 8, then every multiple of 8 up to 256, capped at max_num_seqs,
    which is always included so that every decode batch has a graph. Ascending."""
    ladder = [1, 2, 4] + list(range(8, 257, 8))
    return sorted({s for s in ladder if s < max_num_seqs} | {max_num_seqs})


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (sizes ascending), or None when n exceeds them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class CUDAGraphRunner:
    """Captures `model`'s decode forward for each ladder size and replays it for decode steps.

    model(input_ids int64 [T], positions int64 [T], kv_caches, attn_metadata per layer) -> hidden [T, hidden]
    (one KV cache group: every layer reads the same block tables).
    kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
    max_blocks_per_seq: columns of the static block table, ceil(max_model_len / block_size).
    dummy_block: a KV block that no sequence owns; padded rows write their K/V there and attend only
    to it, so they never touch a real sequence's cache. Their outputs are dropped.
    The static buffers live on the KV cache's device; only capture() and run() need CUDA.
    """

    def __init__(
        self,
        model,
        backend: AttentionBackend | list[AttentionBackend],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        dummy_block: int,
    ):
        # the model's backends (one per sliding window, each planned for every graph)
        self.backends = backend if isinstance(backend, list) else [backend]
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq, self.block_size = max_blocks_per_seq, block_size
        self.dummy_block = dummy_block
        n, dev = self.sizes[-1], kv_caches[0][0].device
        # Every row starts as a padding row; load_inputs overwrites the real ones each step.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), dummy_block * block_size, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.block_tables[:, 0] = dummy_block
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        for b in self.backends:
            b.init_cuda_graph_decode(self.sizes, max_blocks_per_seq)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def _decode_state(self, batch_size: int) -> contextlib.ExitStack:
        """Every backend's graph-safe decode state of `batch_size` rows, entered together."""
        stack = contextlib.ExitStack()
        for b in self.backends:
            stack.enter_context(b.cuda_graph_decode(batch_size))
        return stack

    def _plan(self, meta: AttentionMetadata) -> None:
        for b in self.backends:
            b.plan(meta)

    def _meta(self, batch_size: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            num_decodes=batch_size,
            query_start_loc_cpu=list(range(batch_size + 1)),
            seq_lens_cpu=seq_lens_cpu,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per ladder size, largest first so that the smaller ones reuse the
        pool's memory. Each size runs once eagerly first: lazy initialisation (FlashInfer's JIT
        compilation, cuBLAS workspaces) cannot happen inside a capture. Logs the time taken."""
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        full = self.max_blocks_per_seq * self.block_size
        for bs in reversed(self.sizes):
            meta = self._meta(bs, [full] * bs)  # the static rows are all padding rows now
            ids, pos = self.input_ids[:bs], self.positions[:bs]
            with self._decode_state(bs):
                self._plan(meta)
                self.model(ids, pos, self.kv_caches, [meta] * len(self.kv_caches))
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[bs] = self.model(ids, pos, self.kv_caches, [meta] * len(self.kv_caches))
            self._graphs[bs] = graph
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, %.0f MiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
            used / 2**20,
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        """True for a decode-only batch that fits a captured graph."""
        return (
            meta.num_decodes == meta.num_seqs
            and padded_size(meta.num_seqs, self.sizes) is not None
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def load_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[int, AttentionMetadata]:
        """Copies a decode batch of n rows into the static buffers and pads it to the next size bs.

        Returns (bs, the metadata of the padded batch over the static buffers).
        """
        n = meta.num_seqs
        bs = padded_size(n, self.sizes)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # Columns past this batch's width keep older block ids: those are valid blocks beyond each
        # row's length, which the kernels never read (FlashInfer) or mask (torch_native).
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if bs > n:
            # Rows n..bs-1 may hold an earlier step's real rows: make them padding rows again. The
            # slots matter most (else they would overwrite a real token's K/V); token ids and
            # positions are left as they are, any valid values do.
            self.slot_mapping[n:bs] = self.dummy_block * self.block_size
            self.seq_lens[n:bs] = 1
            self.block_tables[n:bs, 0] = self.dummy_block
        return bs, self._meta(bs, list(meta.seq_lens_cpu) + [1] * (bs - n))

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decode step through a graph: hidden states [n, hidden] (a view into the graph's output,
        valid until the next replay). The caller checks can_run(meta) first."""
        bs, padded = self.load_inputs(input_ids, positions, meta)
        with self._decode_state(bs):
            self._plan(padded)
        self._graphs[bs].replay()
        return self._outputs[bs][: meta.num_seqs]
