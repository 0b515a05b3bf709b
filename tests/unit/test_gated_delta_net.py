"""Qwen3.5's Gated DeltaNet pieces against transformers' reference functions (models/qwen3_5/modeling_qwen3_5.py):
the chunked prefill form and the one-token recurrence, our torch versions and the C kernel (csrc/recurrent.c)."""

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from models.kernels import cpu_kernels, ops
from models.layers.gated_delta_net import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule


def inputs(batch, n, heads, dk, dv, seed=0):
    """Random (q, k, v, g, beta) in transformers' layout [B, n, H, ...] (g <= 0, beta in (0, 1))."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(batch, n, heads, dk, generator=g), torch.randn(batch, n, heads, dk, generator=g)
    v = torch.randn(batch, n, heads, dv, generator=g)
    decay = -torch.rand(batch, n, heads, generator=g) * 2
    return q, k, v, decay, torch.rand(batch, n, heads, generator=g)


def ours(q, k):
    """q, k as our layer hands them to the rules: L2-normed, q scaled by d_k^-1/2."""
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)


@pytest.mark.parametrize("n", [1, 63, 64, 150])
def test_chunked_prefill_matches_transformers(n):
    """Sequences of less than one, exactly one and several 64-token chunks (padded), from a non-zero state."""
    q, k, v, g, beta = inputs(1, n, 3, 16, 8)
    state = torch.randn(1, 3, 16, 8)
    ref, ref_state = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    qn, kn = ours(q, k)
    out, new_state = chunk_gated_delta_rule(*(x[0].transpose(0, 1) for x in (qn, kn, v, g, beta)), state[0])
    torch.testing.assert_close(out.transpose(0, 1), ref[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(new_state, ref_state[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("path", ["torch", "C"])
def test_one_token_update_matches_transformers_in_place_on_slots(path):
    """Three sequences' tokens, their states at slots 4, 0 and 2 of a state tensor whose slots hold more than the
    matrices (the DeltaNet's slot also keeps its convolution's inputs first): each state updated as transformers'
    recurrence updates it, the other slots untouched."""
    if path == "C" and cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    q, k, v, g, beta = inputs(3, 1, 4, 32, 16, seed=1)
    states = torch.randn(3, 4, 32, 16)
    ref, ref_states = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=states, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    slots = torch.tensor([4, 0, 2])
    pool = torch.randn(5, 100 + 4 * 32 * 16)
    view = pool[:, 100:].view(5, 4, 32, 16)
    view[slots] = states
    before = pool.clone()
    qn, kn = ours(q, k)
    step = [x[:, 0] for x in (qn, kn, v, g, beta)]
    if path == "C":
        out = ops.gated_delta_rule_decode_(view, slots, *step)
        assert out is not None
    else:
        out, view[slots] = recurrent_gated_delta_rule(*step, view[slots])
    torch.testing.assert_close(out, ref[:, 0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(view[slots], ref_states, atol=2e-5, rtol=1e-4)
    untouched = torch.ones(5, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched]) and torch.equal(pool[:, :100], before[:, :100])
