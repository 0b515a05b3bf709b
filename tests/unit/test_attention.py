"""torch_native paged attention against dense attention computed straight from the definition."""

import random

import pytest
import torch

from models.attention.base import AttentionMetadata
from models.attention.cpu import CPUBackend, kernel_isa
from models.attention.kv_cache_dtype import STORAGE, dequantize_rows, quantize_rows
from models.attention.torch_native import TorchNativeBackend
from models.kernels import cpu_kernels

H, KVH, D, BS = 6, 2, 16, 4


def new_cache(backend, num_blocks, dtype, randn=False):
    """A (k_cache, v_cache) pair in the backend's layout, and NHD views [blocks, block, kv heads, dim] of it."""
    make = torch.randn if randn else torch.zeros
    cache = tuple(make(backend.kv_cache_shape(num_blocks), dtype=dtype) for _ in range(2))
    nhd = cache if isinstance(backend, TorchNativeBackend) else tuple(c.transpose(1, 2) for c in cache)
    return cache, nhd


def dense(q, keys, values, scale, window=None, cap=None, sinks=None):
    """q [m, H, D] are the last m positions of a sequence with keys/values [n, KVH, D] (any group size H / KVH);
    with `window` W a query at position p sees keys p - W + 1 .. p (transformers' sliding-window mask); `sinks`
    [H] join each head's softmax as one more logit whose probability is dropped (transformers' gpt-oss)."""
    m, n, g = q.shape[0], keys.shape[0], q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    s = torch.einsum("mhd,nhd->hmn", q, k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    kpos, qpos = torch.arange(n)[None, :], torch.arange(n - m, n)[:, None]
    s.masked_fill_(kpos > qpos, float("-inf"))
    if window is not None:
        s.masked_fill_(kpos <= qpos - window, float("-inf"))
    if sinks is not None:
        return torch.einsum(
            "hmn,nhd->mhd", torch.cat((s, sinks[:, None, None].expand(-1, m, 1)), -1).softmax(-1)[..., :-1], v
        )
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


BACKENDS = [TorchNativeBackend, CPUBackend]


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window, cap", [(None, None), (3, None), (7, None), (None, 0.5), (5, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_mixed_batch_matches_dense_attention(backend_cls, dtype, window, cap, sinks):
    """Decodes, a prefill chunk after a cached prefix, and a fresh prompt in one step; with a sliding
    window shorter than most of them, a soft cap on the scores that binds (Gemma 2's), and attention sinks
    (gpt-oss's) large enough to take much of each softmax."""
    rng = random.Random(0)
    torch.manual_seed(0)
    num_blocks = 64
    backend = backend_cls(H, KVH, D, BS, D**-0.5, sliding_window=window, logits_soft_cap=cap)
    (k_cache, v_cache), (k_nhd, v_nhd) = new_cache(backend, num_blocks, dtype)
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
            k_nhd[table[pos // BS], pos % BS] = keys[pos]
            v_nhd[table[pos // BS], pos % BS] = values[pos]
        seqs.append((ctx, new, keys, values))
        tables.append(table)
    bt = torch.zeros(len(shapes), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    qsl = [0]
    for _, new in shapes:
        qsl.append(qsl[-1] + new)
    slots = [tables[i][p // BS] * BS + p % BS for i, (ctx, new) in enumerate(shapes) for p in range(ctx, ctx + new)]
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor([c + n for c, n in shapes], dtype=torch.int32),
        bt,
        torch.tensor(slots),
        3,
        qsl,
        [c + n for c, n in shapes],
    )
    q = torch.randn(qsl[-1], H + KVH, D, dtype=dtype)[:, :H]  # strided, as the model's slice of qkv
    k_new = torch.cat([keys[ctx:] for ctx, _, keys, _ in seqs])
    v_new = torch.cat([values[ctx:] for ctx, _, _, values in seqs])
    backend.plan(meta)
    sink = torch.randn(H) + 1.5 if sinks else None
    out = backend.forward(q, k_new, v_new, (k_cache, v_cache), meta, sink)
    for i, (ctx, new, keys, values) in enumerate(seqs):
        ref = dense(q[qsl[i] : qsl[i + 1]].float(), keys.float(), values.float(), D**-0.5, window, cap, sink)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].float(), ref, atol=tol, rtol=tol)
    # and the new tokens' K/V landed in their slots
    flat_k = k_nhd.reshape(-1, KVH, D)
    torch.testing.assert_close(flat_k[torch.tensor(slots)], k_new)


def test_cpu_kernel_builds_here():
    # CI has a C compiler: the CPU default must not silently fall back to the slow path
    assert cpu_kernels.load() is not None


def random_step(rng, group, kvh, d, bs, shapes, dtype):
    """A step of sequences (tokens cached, new tokens) with random q/k/v and shuffled block tables;
    returns (meta, q (strided, as the model's slice of qkv), k, v, num_blocks)."""
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
        bt[i, : len(t)] = torch.tensor(t)
    lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        bt,
        torch.tensor(slots),
        sum(n == 1 for _, n in shapes),
        qsl,
        lens,
    )
    h = kvh * group
    qkv = torch.randn(qsl[-1], h + 2 * kvh, d, dtype=dtype)
    return meta, qkv[:, :h], qkv[:, h : h + kvh], qkv[:, h + kvh :], num_blocks


def run_against_torch_native(meta, q, k, v, block_size, num_blocks, window=None, cap=None, sinks=None):
    """Both backends on the same step and the same (random) cache contents (and attention `sinks`):
    (torch_native, cpu) outputs."""
    h, kvh, d = q.shape[1], k.shape[1], q.shape[2]
    kinds = dict(sliding_window=window, logits_soft_cap=cap)
    backends = [cls(h, kvh, d, block_size, d**-0.5, **kinds) for cls in (TorchNativeBackend, CPUBackend)]
    (ref_cache, ref_nhd), (cpu_cache, cpu_nhd) = (new_cache(b, num_blocks, q.dtype) for b in backends)
    for src, dst in zip(ref_nhd, cpu_nhd):
        src.copy_(torch.randn(src.shape, dtype=src.dtype))
        dst.copy_(src)
    outs = []
    for backend, cache in zip(backends, (ref_cache, cpu_cache)):
        backend.plan(meta)
        outs.append(backend.forward(q, k, v, cache, meta, sinks))
    return outs


CASES = [
    (group, d, dtype)
    for dtype in (torch.bfloat16, torch.float32)
    for group, d in ((1, 64), (3, 64), (8, 64), (3, 128), (8, 128), (3, 40), (4, 256), (8, 512))
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_cpu_kernel_matches_torch_native_on_random_batches(case):
    """Random steps: decodes, long chunks after cached prefixes, fresh prompts; GQA groups 1 / 3 / 4 / 8,
    head_dim 64 / 128 (the AVX-512 and AVX2 sizes), 256 (AVX2 for float32: Gemma 3), an odd 40 and 512 (portable;
    Gemma 4's global layers, 8 query heads a KV head),
    block sizes 16 / 32, both dtypes."""
    group, d, dtype = CASES[case]
    rng = random.Random(case)
    torch.manual_seed(case)
    kvh, bs = rng.choice([1, 2, 3]), (16, 32)[case % 2]
    shapes = [(rng.randint(1, 90), 1) for _ in range(rng.randint(0, 5))]
    shapes += [(rng.choice([0, rng.randint(1, 70)]), rng.randint(2, 45)) for _ in range(rng.randint(1, 3))]
    meta, q, k, v, num_blocks = random_step(rng, group, kvh, d, bs, shapes, dtype)
    ref, out = run_against_torch_native(meta, q, k, v, bs, num_blocks)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("num_seqs", [1, 6])
def test_cpu_kernel_long_contexts(isa, num_seqs, sinks, monkeypatch):
    """Contexts over hundreds of blocks, as decodes and as chunks: with one sequence the kernel splits
    each task's keys across threads (flash-decoding) and merges them (attention sinks joining the merged
    denominator); `portable` forces the path a CPU without AVX512-BF16 takes."""
    if isa == "portable":
        monkeypatch.setenv("MINIVLLM_CPU_ISA", "portable")
        assert kernel_isa() == "portable"
    rng = random.Random(num_seqs)
    torch.manual_seed(num_seqs)
    shapes = [(rng.randint(3000, 5000), 1) for _ in range(num_seqs)] + [(rng.randint(2000, 3000), 37)]
    meta, q, k, v, num_blocks = random_step(rng, 3, 3, 64, 16, shapes, torch.bfloat16)
    sink = torch.randn(9) * 3 + 4 if sinks else None  # some past every score, some below
    ref, out = run_against_torch_native(meta, q, k, v, 16, num_blocks, sinks=sink)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kvh, group, d", [(2, 4, 64), (3, 3, 64), (8, 1, 128), (4, 8, 128)])
def test_cpu_kernel_decode_steps_run_each_sequence_as_one_unit(kvh, group, d, dtype, isa, monkeypatch):
    """Steps of decodes alone (one query a sequence) run each sequence's kv heads together, chunk by chunk
    (paged_attention.c's attention_heads_mode), the keys of too few sequences split across threads: one sequence short
    and long, a sliding window, attention sinks, three sequences of unequal lengths; the output equals
    torch_native's."""
    if isa == "portable":
        monkeypatch.setenv("MINIVLLM_CPU_ISA", "portable")
    rng = random.Random(kvh * 100 + group)
    torch.manual_seed(kvh)
    for shapes, window, sinks in (
        ([(40, 1)], None, False),
        ([(351, 1)], None, False),
        ([(2100, 1)], None, True),
        ([(900, 1)], 300, False),
        ([(700, 1), (37, 1), (1500, 1)], None, True),
    ):
        meta, q, k, v, num_blocks = random_step(rng, group, kvh, d, 16, shapes, dtype)
        sink = torch.randn(kvh * group) * 3 + 4 if sinks else None
        ref, out = run_against_torch_native(meta, q, k, v, 16, num_blocks, window, sinks=sink)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_kernel_wide_scores(dtype):
    """Queries 12x larger: scores spread over tens of nats, so a row's running max is passed by more than the AVX-512
    chunks' lazy margin (LAZY_MAX, paged_attention.c) in some chunks and not in others; the output still equals
    torch_native's, for decodes (keys split across threads) and prompt chunks."""
    rng = random.Random(7)
    torch.manual_seed(7)
    shapes = [(rng.randint(600, 1500), 1) for _ in range(2)] + [(0, 120), (300, 40)]
    meta, q, k, v, num_blocks = random_step(rng, 3, 3, 64, 16, shapes, dtype)
    ref, out = run_against_torch_native(meta, q * 12, k, v, 16, num_blocks)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("isa", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window, cap", [(1, None), (5, None), (40, None), (300, None), (None, 0.7), (40, 0.7)])
def test_cpu_kernel_sliding_window(window, cap, dtype, isa, monkeypatch):
    """A sliding window over long contexts, alone (keys split across threads, partitions starting at the
    window) and batched with chunks whose queries see different windows, against torch_native's mask; and a
    soft cap on the scores."""
    if isa == "portable":
        monkeypatch.setenv("MINIVLLM_CPU_ISA", "portable")
    rng = random.Random(window)
    torch.manual_seed(window or 0)
    for shapes in ([(700, 1)], [(500, 1), (37, 1), (300, 20), (0, 45)]):
        meta, q, k, v, num_blocks = random_step(rng, 3, 2, 64, 16, shapes, dtype)
        ref, out = run_against_torch_native(meta, q, k, v, 16, num_blocks, window, cap)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_kv_cache(kv_cache_dtype, dtype):
    """--kv-cache-dtype: the CPU kernel quantizes the new K/V as it writes them (the bytes quantize_rows
    gives, up to a rounding tie) and reads the cache in place; its output equals torch_native's over the same
    quantized cache, and that equals dense attention over the dequantized keys and values; the error against
    the unquantized K/V is what the format allows (int8: half a step of max|x| / 127; fp8: 2^-4, 2^-3)."""
    rng = random.Random(kv_cache_dtype)
    torch.manual_seed(0)
    shapes = [(700, 1), (37, 1), (300, 20), (0, 45)]
    meta, q, k, v, num_blocks = random_step(rng, 3, 2, 64, 16, shapes, dtype)
    backends = [
        cls(
            3 * 2,
            2,
            64,
            16,
            64**-0.5,
            sliding_window=100 if dtype == torch.bfloat16 else None,
            kv_cache_dtype=kv_cache_dtype,
        )
        for cls in (TorchNativeBackend, CPUBackend)
    ]
    code = backends[0].kv_quant
    caches = [new_cache(b, num_blocks, STORAGE[code]) for b in backends]
    cached = quantize_rows(torch.randn(caches[0][1][0].shape[:-1] + (64,)), code)
    for _, nhd in caches:
        for c in nhd:
            c.copy_(cached)
    outs = []
    for backend, (cache, _) in zip(backends, caches):
        backend.plan(meta)
        outs.append(backend.forward(q, k, v, cache, meta))
    ref, out = outs
    # the same rows either way: float32 leaves summation order, where the kernel keeps float32 (the AVX512-BF16
    # path rounds queries and probabilities to bfloat16, under the formats' own steps)
    exact = dtype == torch.float32 and kernel_isa(STORAGE[code]) != "avx512bf16"
    tol = 1e-4 if exact else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    slots = meta.slot_mapping
    written = [nhd[0].reshape(-1, 2, backends[0].row)[slots] for _, nhd in caches]
    same = (written[0].view(torch.uint8) == written[1].view(torch.uint8)).float().mean()
    assert same > 0.99, f"the kernel's bytes differ from quantize_rows' at {1 - same:.2%} of the values"
    deq = dequantize_rows(written[1], 64, code)
    step = k.float().abs().unflatten(-1, (2, 32)).amax(-1).repeat_interleave(32, -1) / 254 if code == 1 else None
    err = (deq - k.float()).abs()
    bound = step + 1e-6 if code == 1 else k.float().abs() * (2.0**-4 if code == 2 else 2.0**-3) + 2.0**-9
    assert (err <= bound).all()
    # torch_native against the definition, over the dequantized rows
    for i, (ctx, new) in enumerate(shapes):
        table = meta.block_tables[i, : -(-(ctx + new) // 16)]
        keys, values = (dequantize_rows(c[table].flatten(0, 1)[: ctx + new], 64, code) for c in caches[0][1])
        qi = q[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]].float()
        window = backends[0].sliding_window
        dense_out = dense(qi, keys, values, 64**-0.5, window)
        torch.testing.assert_close(
            ref[meta.query_start_loc_cpu[i] : meta.query_start_loc_cpu[i + 1]].float(), dense_out, atol=2e-2, rtol=2e-2
        )
