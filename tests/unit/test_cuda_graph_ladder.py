"""CUDA-graph batch-size ladder and padding (CPU), and capture/replay against eager runs (GPU only)."""

import random

import pytest
import torch
from torch import nn

from engine.worker.cuda_graph import CUDAGraphRunner, capture_sizes, padded_size
from models.attention.base import AttentionMetadata
from models.attention.flashinfer import FlashInferBackend, flashinfer_available
from models.attention.torch_native import TorchNativeBackend

H, KVH, BS, NUM_BLOCKS, MAX_BLOCKS = 4, 2, 16, 64, 4
DUMMY = NUM_BLOCKS - 1
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert capture_sizes(1) == [1]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(300)[-3:] == [248, 256, 300]  # the ladder stops at 256, max_num_seqs is added


def test_padded_size():
    sizes = capture_sizes(20)  # [1, 2, 4, 8, 16, 20]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [1, 2, 4, 4, 8, 8, 16, 16, 20, 20]
    assert padded_size(21, sizes) is None


class ToyModel(nn.Module):
    """The engine's model interface at toy size: embedding, then per layer a QKV projection, the
    backend's paged attention and an output projection on a residual stream."""

    def __init__(self, backend, head_dim: int, layers: int = 2, vocab: int = 50, hidden: int = 32):
        super().__init__()
        self.backend, self.d = backend, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.ModuleList(nn.Linear(hidden, (H + 2 * KVH) * head_dim) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(H * head_dim, hidden) for _ in range(layers))

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed(input_ids)
        x = x + (0.01 * positions[:, None]).to(x.dtype)
        for qkv, o, kv_cache, m in zip(self.qkv, self.o, kv_caches, meta):
            q, k, v = qkv(x).split([H * self.d, KVH * self.d, KVH * self.d], dim=-1)
            a = self.backend.forward(
                q.reshape(-1, H, self.d), k.reshape(-1, KVH, self.d), v.reshape(-1, KVH, self.d), kv_cache, m
            )
            x = x + o(a.reshape(-1, H * self.d))
        return x


def decode_batch(rng: random.Random, n: int, device):
    """n decode rows over random contexts in distinct blocks (never the dummy block)."""
    free = rng.sample(range(DUMMY), DUMMY)
    lens = [rng.randint(1, MAX_BLOCKS * BS) for _ in range(n)]
    width = max(-(-s // BS) for s in lens)
    tables = [[free.pop() for _ in range(-(-s // BS))] for s in lens]
    tables = [t + [0] * (width - len(t)) for t in tables]
    slots = [t[(s - 1) // BS] * BS + (s - 1) % BS for t, s in zip(tables, lens)]
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, **i32),
        seq_lens=torch.tensor(lens, **i32),
        block_tables=torch.tensor(tables, **i32),
        slot_mapping=torch.tensor(slots, device=device),
        num_decodes=n,
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=lens,
    )
    ids = torch.tensor([rng.randrange(50) for _ in range(n)], device=device)
    return ids, torch.tensor(lens, device=device) - 1, meta


def make(backend, head_dim, dtype, device):
    torch.manual_seed(0)
    model = ToyModel(backend, head_dim).to(device, dtype)
    kv = [
        tuple(torch.randn(NUM_BLOCKS, BS, KVH, head_dim, device=device, dtype=dtype) for _ in range(2))
        for _ in range(2)
    ]
    kv_ref = [tuple(c.clone() for c in layer) for layer in kv]
    runner = CUDAGraphRunner(
        model, backend, kv, max_num_seqs=12, max_blocks_per_seq=MAX_BLOCKS, block_size=BS, dummy_block=DUMMY
    )
    return model, kv, kv_ref, runner


def eager(model, backend, ids, pos, kv, meta):
    backend.plan(meta)
    return model(ids, pos, kv, [meta] * len(kv))


def assert_same_cache(kv, kv_ref, **tol):
    """Equal everywhere but in the dummy block, which only padded rows write."""
    for layer, ref in zip(kv, kv_ref):
        for c, r in zip(layer, ref):
            torch.testing.assert_close(c[:DUMMY], r[:DUMMY], **tol)


@torch.inference_mode()
def test_padded_static_inputs_compute_the_real_rows_on_cpu():
    """What a replay computes: the model run eagerly over the runner's padded static buffers."""
    backend = TorchNativeBackend(H, KVH, 8, BS, 8**-0.5)
    model, kv, kv_ref, runner = make(backend, 8, torch.float32, "cpu")
    rng = random.Random(0)
    for n in (7, 5, 12, 1, 3):  # 5 after 7 leaves stale real rows in the padding, which must be reset
        ids, pos, meta = decode_batch(rng, n, "cpu")
        assert runner.can_run(meta)
        ref = eager(model, backend, ids, pos, kv_ref, meta)
        bs, padded = runner.load_inputs(ids, pos, meta)
        assert bs == padded_size(n, runner.sizes) and padded.seq_lens_cpu[n:] == [1] * (bs - n)
        out = eager(model, backend, runner.input_ids[:bs], runner.positions[:bs], kv, padded)
        torch.testing.assert_close(out[:n], ref)
        assert_same_cache(kv, kv_ref)


def test_mixed_batches_are_not_graphed():
    backend = TorchNativeBackend(H, KVH, 8, BS, 8**-0.5)
    _, _, _, runner = make(backend, 8, torch.float32, "cpu")
    _, _, meta = decode_batch(random.Random(0), 3, "cpu")
    meta.num_decodes = 2  # the last row is now a (one-token) prefill chunk
    assert not runner.can_run(meta)


def replay_matches_eager(backend, head_dim, dtype, **tol):
    model, kv, kv_ref, runner = make(backend, head_dim, dtype, "cuda")
    runner.capture()
    rng = random.Random(1)
    with torch.inference_mode():
        for n in (12, 7, 5, 1, 3, 8):
            ids, pos, meta = decode_batch(rng, n, "cuda")
            ref = eager(model, backend, ids, pos, kv_ref, meta)
            torch.testing.assert_close(runner.run(ids, pos, meta), ref, **tol)
            assert_same_cache(kv, kv_ref, **tol)


@needs_cuda
def test_graph_replay_matches_eager_torch_native():
    replay_matches_eager(TorchNativeBackend(H, KVH, 8, BS, 8**-0.5), 8, torch.float32, atol=1e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.skipif(not flashinfer_available(), reason="needs the flashinfer package")
def test_graph_replay_matches_eager_flashinfer():
    backend = FlashInferBackend(H, KVH, 64, BS, 64**-0.5, dtype=torch.bfloat16, device="cuda")
    replay_matches_eager(backend, 64, torch.bfloat16, atol=2e-2, rtol=2e-2)
