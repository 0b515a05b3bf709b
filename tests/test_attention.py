"""torch_native paged attention against dense attention computed straight from the definition."""
import random

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.cpu import CPUBackend, load_kernels
from engine.attention.torch_native import TorchNativeBackend

H, KVH, D, BS = 6, 2, 16, 4


def dense(q, keys, values, scale):
    """q [m, H, D] are the last m positions of a sequence with keys/values [n, KVH, D]."""
    m, n = q.shape[0], keys.shape[0]
    k, v = keys.repeat_interleave(H // KVH, 1), values.repeat_interleave(H // KVH, 1)
    s = torch.einsum("mhd,nhd->hmn", q, k) * scale
    s.masked_fill_(torch.arange(n)[None, :] > torch.arange(n - m, n)[:, None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


BACKENDS = [TorchNativeBackend, CPUBackend]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_mixed_batch_matches_dense_attention(backend_cls, dtype):
    """Decodes, a prefill chunk after a cached prefix, and a fresh prompt in one step."""
    rng = random.Random(0)
    torch.manual_seed(0)
    num_blocks = 64
    k_cache, v_cache = torch.zeros(num_blocks, BS, KVH, D, dtype=dtype), torch.zeros(num_blocks, BS, KVH, D, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (tokens already in the cache, new tokens): three decodes, a chunk after 9 cached, a fresh prompt
    shapes = [(5, 1), (12, 1), (1, 1), (9, 6), (0, 11)]
    seqs, tables = [], []
    for ctx, new in shapes:
        n = ctx + new
        table = [free.pop() for _ in range(-(-n // BS))]
        keys, values = torch.randn(n, KVH, D, dtype=dtype), torch.randn(n, KVH, D, dtype=dtype)
        for pos in range(ctx):  # the cached prefix
            k_cache[table[pos // BS], pos % BS] = keys[pos]
            v_cache[table[pos // BS], pos % BS] = values[pos]
        seqs.append((ctx, new, keys, values))
        tables.append(table)
    bt = torch.zeros(len(shapes), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    qsl = [0]
    for _, new in shapes:
        qsl.append(qsl[-1] + new)
    slots = [tables[i][p // BS] * BS + p % BS for i, (ctx, new) in enumerate(shapes) for p in range(ctx, ctx + new)]
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor([c + n for c, n in shapes], dtype=torch.int32),
                             bt, torch.tensor(slots), 3, qsl, [c + n for c, n in shapes])
    q = torch.randn(qsl[-1], H + KVH, D, dtype=dtype)[:, :H]  # strided, as the model's slice of qkv
    k_new = torch.cat([keys[ctx:] for ctx, _, keys, _ in seqs])
    v_new = torch.cat([values[ctx:] for ctx, _, _, values in seqs])
    backend = backend_cls(H, KVH, D, BS, D ** -0.5)
    backend.plan(meta)
    out = backend.forward(q, k_new, v_new, (k_cache, v_cache), meta)
    for i, (ctx, new, keys, values) in enumerate(seqs):
        ref = dense(q[qsl[i]:qsl[i + 1]].float(), keys.float(), values.float(), D ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float(), ref, atol=tol, rtol=tol)
    # and the new tokens' K/V landed in their slots
    flat_k = k_cache.view(-1, KVH, D)
    torch.testing.assert_close(flat_k[torch.tensor(slots)], k_new)


def test_cpu_kernel_builds_here():
    # CI has a C compiler: the CPU default must not silently fall back to the slow path
    assert load_kernels() is not None


@pytest.mark.parametrize("seed", range(6))
def test_cpu_kernel_matches_torch_native_on_random_batches(seed):
    """Random steps: decodes, long chunks after cached prefixes, fresh prompts; GQA groups of 1-4."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kvh, group, d, bs = rng.choice([1, 2, 4]), rng.choice([1, 3, 4]), rng.choice([64, 128, 40]), rng.choice([4, 16])
    h = kvh * group
    shapes = [(rng.randint(1, 90), 1) for _ in range(rng.randint(0, 5))]
    shapes += [(rng.choice([0, rng.randint(1, 70)]), rng.randint(2, 45)) for _ in range(rng.randint(1, 3))]
    num_blocks = sum(-(-(c + n) // bs) for c, n in shapes) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, qsl, slots = [], [0], []
    for ctx, new in shapes:
        tables.append([order.pop() for _ in range(-(-(ctx + new) // bs))])
        qsl.append(qsl[-1] + new)
        slots += [tables[-1][p // bs] * bs + p % bs for p in range(ctx, ctx + new)]
    bt = torch.zeros(len(shapes), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), bt,
                             torch.tensor(slots), sum(n == 1 for _, n in shapes), qsl, lens)
    q, k, v = torch.randn(qsl[-1], h, d), torch.randn(qsl[-1], kvh, d), torch.randn(qsl[-1], kvh, d)
    caches = [(torch.randn(num_blocks, bs, kvh, d), torch.randn(num_blocks, bs, kvh, d)) for _ in range(2)]
    caches[1] = tuple(c.clone() for c in caches[0])
    outs = []
    for backend_cls, cache in zip(BACKENDS, caches):
        backend = backend_cls(h, kvh, d, bs, d ** -0.5)
        backend.plan(meta)
        outs.append(backend.forward(q, k, v, cache, meta))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
