"""FlashInfer's paged-KV index arrays, derived from block tables, checked on the CPU against what
torch_native reads; and FlashInferBackend's plumbing, run on the CPU over a stand-in `flashinfer`
module whose wrappers follow FlashInfer's documented semantics (its real kernels need CUDA)."""

import math
import random
import sys
import types

import pytest
import torch

from engine.worker.cuda_graph import CUDAGraphRunner
from models.attention.base import AttentionMetadata
from models.attention.flashinfer import FlashInferBackend, flashinfer_available, paged_kv_indices
from models.attention.torch_native import TorchNativeBackend

BS, H, KVH, D = 4, 4, 2, 8  # block size, query heads, KV heads, head dim


def random_batch(
    rng: random.Random, num_decodes: int, num_prefills: int, block_size: int = BS, num_blocks: int = 200, device="cpu"
) -> AttentionMetadata:
    """Decodes first, then prefill chunks, some after a cached prefix (chunked prefill or a prefix-cache
    hit). Rows share their first full cached blocks with a common prefix, like prefix-cache hits."""
    q_lens = [1] * num_decodes + [rng.randint(1, 13) for _ in range(num_prefills)]
    ctx = [rng.randint(0, 30) if q == 1 else rng.choice([0, rng.randint(1, 30)]) for q in q_lens]
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    free = rng.sample(range(1, num_blocks), num_blocks - 1)  # block 0 is the tables' padding value
    shared = [free.pop() for _ in range(2)]
    width = max(math.ceil(n / block_size) for n in seq_lens) + rng.randint(0, 2)
    tables, slots = [], []
    for c, n in zip(ctx, seq_lens):
        k = min(c // block_size, len(shared)) if rng.random() < 0.5 else 0  # only full, cached blocks
        row = shared[:k] + [free.pop() for _ in range(math.ceil(n / block_size) - k)]
        tables.append(row + [0] * (width - len(row)))
        slots += [row[p // block_size] * block_size + p % block_size for p in range(c, n)]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=torch.tensor(tables, **i32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decodes=num_decodes,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


def gather_paged(cache, kv_indptr, kv_indices, last_page_len, i):
    """The KV rows [len, kvh, d] of sequence i as FlashInfer reads them from the CSR arrays."""
    pages = kv_indices[kv_indptr[i] : kv_indptr[i + 1]].long()
    n = (len(pages) - 1) * cache.shape[1] + int(last_page_len[i])
    return cache[pages.to(cache.device)].flatten(0, 1)[:n]


def test_hand_checked_case():
    tables = torch.tensor([[5, 2, 7, 0], [3, 9, 0, 0], [1, 4, 6, 8]], dtype=torch.int32)
    seq_lens, qsl = [9, 4, 13], [0, 1, 2, 7]  # two decodes, then a 5-token chunk after 8 cached
    qo, indptr, indices, last = paged_kv_indices(tables, seq_lens, qsl, 4, 0, 2)
    assert qo.tolist() == [0, 1, 2] and indptr.tolist() == [0, 3, 4]
    assert indices.tolist() == [5, 2, 7, 3] and last.tolist() == [1, 4]
    qo, indptr, indices, last = paged_kv_indices(tables, seq_lens, qsl, 4, 2, 3)
    assert qo.tolist() == [0, 5] and indptr.tolist() == [0, 4]
    assert indices.tolist() == [1, 4, 6, 8] and last.tolist() == [1]
    assert all(t.dtype == torch.int32 for t in (qo, indptr, indices, last))


@pytest.mark.parametrize("seed", range(20))
def test_indices_read_what_torch_native_reads(seed):
    rng = random.Random(seed)
    nd = rng.randint(0, 6)
    meta = random_batch(rng, nd, rng.randint(0 if nd else 1, 4))
    cache = torch.randn(200, BS, KVH, D)
    native = TorchNativeBackend(H, KVH, D, BS, D**-0.5)
    nd, b = meta.num_decodes, meta.num_seqs
    for start, end in ((0, nd), (nd, b)):
        if start == end:
            continue
        qo, indptr, indices, last = paged_kv_indices(
            meta.block_tables, meta.seq_lens_cpu, meta.query_start_loc_cpu, BS, start, end
        )
        for j, i in enumerate(range(start, end)):
            n = meta.seq_lens_cpu[i]
            expected = native._gather(cache, meta.block_tables[i][: math.ceil(n / BS)], n)
            assert torch.equal(gather_paged(cache, indptr, indices, last, j), expected)
            # the same query rows as the flat batch's
            assert qo[j + 1] - qo[j] == meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
        assert qo[0] == 0 and 1 <= last.min() and last.max() <= BS


# ---- a stand-in for the `flashinfer` module: FlashInfer's semantics in plain torch ----------------


def _attend(q, kv_cache, qo_indptr, kv_indptr, indices, last, causal, sm_scale, window_left=-1, soft_cap=None):
    """Causal masks align to the KV's end: query r of m sees keys 0..n-m+r (FlashInfer's convention); with
    window_left >= 0 only the window_left keys before its own position and that one."""
    outs = []
    for i in range(len(last)):
        k = gather_paged(kv_cache[0], kv_indptr, indices, last, i).float()
        v = gather_paged(kv_cache[1], kv_indptr, indices, last, i).float()
        qi = q[qo_indptr[i] : qo_indptr[i + 1]].float()
        m, n, group = qi.shape[0], k.shape[0], qi.shape[1] // k.shape[1]
        s = torch.einsum("mhd,nhd->hmn", qi, k.repeat_interleave(group, 1)) * sm_scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        kpos, qpos = torch.arange(n)[None, :], torch.arange(n - m, n)[:, None]
        if causal:
            s.masked_fill_(kpos > qpos, float("-inf"))
        if window_left >= 0:
            s.masked_fill_(kpos < qpos - window_left, float("-inf"))
        outs.append(torch.einsum("hmn,nhd->mhd", s.softmax(-1), v.repeat_interleave(group, 1)))
    return torch.cat(outs).to(q.dtype)


class FakeDecodeWrapper:
    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
    ):
        assert kv_layout == "NHD"
        self.cuda_graph = use_cuda_graph
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        q_data_type,
        kv_data_type,
        sm_scale,
        window_left=-1,
        logits_soft_cap=None,
    ):
        assert {indptr.dtype, indices.dtype, last_page_len.dtype} == {torch.int32}
        if self.cuda_graph:  # as FlashInfer does: a fixed batch size, arrays copied into the buffers
            indptr_buf, indices_buf, last_buf = self.bufs
            assert len(last_page_len) == len(last_buf) and len(indices) <= len(indices_buf)
            indptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            indices_buf[: len(indices)].copy_(indices)
        else:
            self.bufs = (indptr, indices, last_page_len)
        self.dtype, self.sm_scale, self.window_left, self.cap = q_data_type, sm_scale, window_left, logits_soft_cap

    def run(self, q, paged_kv_cache, out):
        assert q.dtype == self.dtype and out.shape == q.shape
        indptr, indices, last = self.bufs  # read at run time, like a replayed graph
        qo = torch.arange(len(last) + 1)
        out.copy_(
            _attend(q, paged_kv_cache, qo, indptr, indices, last, False, self.sm_scale, self.window_left, self.cap)
        )


class FakePrefillWrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD"):
        assert kv_layout == "NHD"

    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        *,
        causal,
        q_data_type,
        kv_data_type,
        sm_scale,
        window_left=-1,
        logits_soft_cap=None,
    ):
        self.arrays = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        self.causal, self.dtype, self.sm_scale, self.window_left = causal, q_data_type, sm_scale, window_left
        self.cap = logits_soft_cap

    def run(self, q, paged_kv_cache, out):
        assert q.dtype == self.dtype and out.shape == q.shape
        out.copy_(_attend(q, paged_kv_cache, *self.arrays, self.causal, self.sm_scale, self.window_left, self.cap))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)


def run_step(backend, meta, cache, q, k, v):
    backend.plan(meta)
    return backend.forward(q, k, v, cache, meta)


@pytest.mark.parametrize("window, cap", [(None, None), (5, None), (None, 0.5)])
@pytest.mark.parametrize("seed", range(10))
def test_backend_matches_torch_native(fake_flashinfer, seed, window, cap):
    """Also with a sliding window (FlashInfer's window_left is the window less the query's own key) and a
    soft cap."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    meta = random_batch(rng, rng.randint(0, 5), rng.randint(1, 3))
    t = meta.query_start_loc_cpu[-1]
    q, k, v = torch.randn(t, H, D), torch.randn(t, KVH, D), torch.randn(t, KVH, D)
    caches = [(torch.randn(200, BS, KVH, D), torch.randn(200, BS, KVH, D))]
    caches.append(tuple(c.clone() for c in caches[0]))
    kinds = dict(sliding_window=window, logits_soft_cap=cap)
    fi = FlashInferBackend(H, KVH, D, BS, D**-0.5, dtype=torch.float32, device="cpu", **kinds)
    out = run_step(fi, meta, caches[0], q, k, v)
    ref = run_step(TorchNativeBackend(H, KVH, D, BS, D**-0.5, **kinds), meta, caches[1], q, k, v)
    torch.testing.assert_close(out, ref)
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))


def test_graph_decode_wrappers_with_padding(fake_flashinfer):
    """The per-size graph wrappers, fed by CUDAGraphRunner's padded static buffers, compute what
    torch_native computes for the real rows; padded rows touch only the dummy block."""
    rng = random.Random(0)
    fi = FlashInferBackend(H, KVH, D, BS, D**-0.5, dtype=torch.float32, device="cpu")
    kv = (torch.randn(200, BS, KVH, D), torch.randn(200, BS, KVH, D))
    kv_ref = tuple(c.clone() for c in kv)
    graphs = CUDAGraphRunner(None, fi, [kv], max_num_seqs=12, max_blocks_per_seq=12, block_size=BS, dummy_block=0)
    for n in (7, 5, 12, 1, 3):  # each pads to a ladder size; 5 after 7 leaves stale rows to reset
        meta = random_batch(rng, n, 0)
        q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)
        ref = run_step(TorchNativeBackend(H, KVH, D, BS, D**-0.5), meta, kv_ref, q, k, v)
        bs, padded = graphs.load_inputs(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long), meta)
        q, k, v = (torch.cat([x, x.new_zeros(bs - n, *x.shape[1:])]) for x in (q, k, v))
        with fi.cuda_graph_decode(bs):
            out = run_step(fi, padded, kv, q, k, v)
        assert bs >= n and padded.num_seqs == bs
        torch.testing.assert_close(out[:n], ref)
        assert torch.equal(kv[0][1:], kv_ref[0][1:]) and torch.equal(kv[1][1:], kv_ref[1][1:])


@pytest.mark.parametrize("module, expected", [(None, False), (types.ModuleType("flashinfer"), True)])
def test_flashinfer_available_follows_the_import(monkeypatch, module, expected):
    """False when `import flashinfer` fails (None in sys.modules makes it raise ImportError, as a
    missing package does), True when it works."""
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    flashinfer_available.cache_clear()
    try:
        assert flashinfer_available() is expected
    finally:
        flashinfer_available.cache_clear()  # later callers probe the real package


@pytest.mark.skipif(
    not torch.cuda.is_available() or not flashinfer_available(), reason="needs a CUDA device and the flashinfer package"
)
def test_real_flashinfer_matches_torch_native_on_gpu():
    """Llama-3-8B attention shapes in bfloat16: FlashInfer's kernels against torch_native."""
    rng = random.Random(0)
    torch.manual_seed(0)
    h, kvh, d, bs = 32, 8, 128, 16
    like = dict(device="cuda", dtype=torch.bfloat16)
    fi = FlashInferBackend(h, kvh, d, bs, d**-0.5, dtype=torch.bfloat16, device="cuda")
    native = TorchNativeBackend(h, kvh, d, bs, d**-0.5)
    for _ in range(5):
        meta = random_batch(rng, rng.randint(0, 5), rng.randint(1, 3), block_size=bs, device="cuda")
        t = meta.query_start_loc_cpu[-1]
        q, k, v = torch.randn(t, h, d, **like), torch.randn(t, kvh, d, **like), torch.randn(t, kvh, d, **like)
        kv = (torch.randn(200, bs, kvh, d, **like), torch.randn(200, bs, kvh, d, **like))
        kv_ref = tuple(c.clone() for c in kv)
        torch.testing.assert_close(
            run_step(fi, meta, kv, q, k, v), run_step(native, meta, kv_ref, q, k, v), atol=2e-2, rtol=2e-2
        )
