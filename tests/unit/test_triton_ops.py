"""The CUDA path's Triton kernels (models/kernels/triton_ops.py) against the torch ops they replace, run on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1), so a CI without a GPU keeps them right. On a GPU,
scripts/gpu_check.py compares a whole step's logits with and without them."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from models.kernels import ops

# Triton reads the variable as it is imported (its own library functions are built for one mode): it is set before
# the first import in this process where no GPU wants the compiled kernels. Where Triton came in earlier (another
# test module's imports), test_kernels_in_a_fresh_process runs this file again in a process of its own.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or ("triton" not in sys.modules and not torch.cuda.is_available())
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
interpreted = pytest.mark.skipif(not INTERPRET, reason="run by test_kernels_in_a_fresh_process")


@pytest.mark.skipif(INTERPRET or torch.cuda.is_available(), reason="the kernels run in this process")
def test_kernels_in_a_fresh_process():
    """This file's tests, in a process whose Triton was imported for the interpreter."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=os.environ | {"TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    summary = run.stdout.strip().splitlines()[-1]  # "19 passed, 1 skipped in ...s": only this wrapper skipped
    assert re.match(r"(\d+) passed, 1 skipped in", summary) and int(summary.split()[0]) >= 19, summary


BF16 = dict(rtol=1.6e-2, atol=1e-5)  # torch's bfloat16 tolerance: the kernels round once, torch's ops more often


@pytest.fixture(scope="module")
def tri():
    """triton_ops with its kernels built for the interpreter."""
    from models.kernels import triton_ops

    return triton_ops


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [True, False])
@pytest.mark.parametrize("hidden", [96, 576])  # not a power of two: masked lanes
def test_add_rms_norm(tri, dtype, delta, hidden):
    torch.manual_seed(0)
    residual = torch.randn(5, hidden) * 3
    d = torch.randn(5, hidden).to(dtype) if delta else None
    w = (torch.rand(hidden) + 0.5).to(dtype)
    ours, ref = residual.clone(), residual.clone()
    out = tri.add_rms_norm(ours, d, w, 1e-5)
    with ops.torch_ops():
        expected = ops.add_rms_norm(ref, d, w, 1e-5)
    assert out.dtype == dtype and out.shape == (5, hidden)
    torch.testing.assert_close(ours, ref)  # the residual stream, float32, updated in place
    torch.testing.assert_close(out, expected, **(BF16 if dtype == torch.bfloat16 else {}))
    # an empty step launches nothing
    assert tri.add_rms_norm(torch.empty(0, hidden), None, w, 1e-5).shape == (0, hidden)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 1, 96), (20, 4, 32)])
def test_rotary_on_fused_qkv_view(tri, dtype, heads, kv_heads, head_dim):
    """q and k rotated in place inside the fused qkv output (a token stride wider than the heads); v untouched.
    20 heads exceed the kernel's 16-head tile; a head_dim of 96 leaves masked lanes."""
    torch.manual_seed(1)
    tokens = 7
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    ours, ref = qkv.clone(), qkv.float()  # the reference in float32: the kernel rounds once, torch's bfloat16 ops
    tri.rotary_(ours[:, : heads + kv_heads], cos, sin)  # round every product (cancellations lose all bits)
    with ops.torch_ops():
        ops.rotary_(ref[:, : heads + kv_heads], cos, sin)
    torch.testing.assert_close(ours, ref.to(dtype), **(BF16 if dtype == torch.bfloat16 else {}))
    assert torch.equal(ours[:, heads + kv_heads :], qkv[:, heads + kv_heads :])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_copy(tri, dtype):
    """Each token's K and V land whole at its slot (block id * block size + offset), other slots untouched."""
    torch.manual_seed(2)
    heads, kv_heads, head_dim, blocks, block_size = 4, 2, 64, 3, 16
    qkv = torch.randn(4, heads + 2 * kv_heads, head_dim).to(dtype)
    k, v = qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]  # strided views, as the model's
    slots = torch.tensor([5, 17, 47, 0])  # the last slot of the last block, the first of the first
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim).to(dtype)
    ours, ref = cache.clone(), cache.clone()
    tri.write_kv(k, v, ours[0], ours[1], slots)
    with ops.torch_ops():
        ops.write_kv(k, v, ref[0], ref[1], slots)
    assert torch.equal(ours, ref)
    assert not torch.equal(ref, cache)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(tri, dtype):
    torch.manual_seed(3)
    gate_up = (torch.randn(3, 2 * 1500) * 4).to(dtype)  # 1,500: two 1,024-wide tiles, the second masked
    out = tri.silu_and_mul(gate_up)
    gate, up = gate_up.float().split(1500, dim=-1)
    assert out.shape == (3, 1500) and out.dtype == dtype
    torch.testing.assert_close(out, (F.silu(gate) * up).to(dtype), **(BF16 if dtype == torch.bfloat16 else {}))


@interpreted
def test_llama_step_with_the_kernels_equals_torch_ops(tri, monkeypatch):
    """A tiny Llama's mixed step (a decode over a cached prefix, then a fresh prompt) with every op routed to the
    Triton kernels as on CUDA (the model's real call sites: qkv views, the cache layout) against torch's ops:
    the same logits and the same K/V cache."""
    from transformers import LlamaConfig

    from models.attention.base import AttentionMetadata
    from models.attention.torch_native import TorchNativeBackend
    from models.config import ModelShape
    from models.llama import LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(4)
    backend = TorchNativeBackend(4, 2, 16, 16, 16**-0.5)
    model = LlamaForCausalLM(cfg, ModelShape.from_hf(cfg), backend, 256).eval()
    cache = torch.zeros(2, 2, 4, 16, 2, 16)  # layers, k/v, blocks, block size, kv heads, head dim

    def step(ids, pos, slots, qsl, lens, tables, decodes):
        i32 = dict(dtype=torch.int32)
        meta = AttentionMetadata(
            torch.tensor(qsl, **i32), torch.tensor(lens, **i32), torch.tensor(tables, **i32),
            torch.tensor(slots), decodes, qsl, lens,
        )  # fmt: skip
        backend.plan(meta)
        kv = [(layer[0], layer[1]) for layer in cache]
        return model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), kv, [meta] * len(kv)))

    prompt = torch.randint(100, (20,)).tolist()
    with torch.inference_mode(), ops.torch_ops():
        step(prompt, list(range(20)), list(range(20)), [0, 20], [20], [[0, 1]], 0)  # sequence 0's prompt
    before = cache.clone()
    args = ([7] + prompt[:9], [20] + list(range(9)), [20, 32 + 0] + list(range(33, 41)), [0, 1, 10], [21, 9],
            [[0, 1], [2, 0]], 1)  # fmt: skip
    with torch.inference_mode(), ops.torch_ops():
        expected, expected_cache = step(*args), cache.clone()
    cache.copy_(before)
    monkeypatch.setattr(ops, "_cuda", lambda x: tri if x.is_floating_point() else None)
    with torch.inference_mode():
        got = step(*args)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache, expected_cache, rtol=1e-5, atol=1e-5)
