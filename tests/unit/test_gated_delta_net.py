"""Qwen3.5's Gated DeltaNet pieces against transformers' reference functions (models/qwen3_5/modeling_qwen3_5.py):
the chunked prefill form and the one-token recurrence in torch; the C kernel's decode step (csrc/recurrent.c) against
the layer's torch path."""

from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from models.kernels import cpu_kernels, ops
from models.layers.gated_delta_net import GatedDeltaNet, chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule
from models.layers.short_conv import StateMetadata


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


def test_one_token_update_matches_transformers_in_place_on_slots():
    """Three sequences' tokens, their states at slots 4, 0 and 2 of a state tensor whose slots hold more than the
    matrices (the DeltaNet's slot keeps its convolution's inputs first): each state updated as transformers'
    recurrence updates it, the other slots untouched."""
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
    out, view[slots] = recurrent_gated_delta_rule(*(x[:, 0] for x in (qn, kn, v, g, beta)), view[slots])
    torch.testing.assert_close(out, ref[:, 0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(view[slots], ref_states, atol=2e-5, rtol=1e-4)
    untouched = torch.ones(5, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched]) and torch.equal(pool[:, :100], before[:, :100])


@pytest.mark.parametrize("tiled", [False, True])
def test_c_decode_step_matches_the_torch_layer(tiled):
    """The C kernel's decode step (convolution, norms, the delta rule, the gated norm: csrc/recurrent.c) against the
    layer's torch path, for a decode batch with a first token (zeroed state) among sequences with history, two
    value heads per key head in either order, then a mixed step (decodes by the kernel, a 5-token chunk after
    them by torch): outputs and every slot's state agree."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    torch.manual_seed(0)
    config = SimpleNamespace(
        hidden_size=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
    )
    layer = GatedDeltaNet(config, None, tiled_heads=tiled)
    with torch.no_grad():
        for p in (layer.A_log, layer.dt_bias, layer.norm.weight):
            p.uniform_(0.5, 2.0)
    state = torch.randn(5, layer.state_size)
    steps = [
        (3, StateMetadata([0, 1, 2, 3], 3, torch.tensor([4, 0, 2]), [True, False, True])),
        (8, StateMetadata([0, 1, 2, 3, 8], 3, torch.tensor([4, 0, 2, 1]), [True, True, True, False])),
    ]
    for tokens, meta in steps:
        x = torch.randn(tokens, 64)
        fused_state, torch_state = state.clone(), state.clone()
        fused = layer(x, fused_state, meta)
        with ops.torch_ops():
            reference = layer(x, torch_state, meta)
        torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fused_state, torch_state, atol=1e-5, rtol=1e-4)
        state = fused_state
