"""The mixture-of-experts layer (models/layers/fused_moe.py) against transformers' own MoE blocks on the same
weights, many tokens at once (experts chosen by several tokens, others by none), and its GGUF path on Q8_0 and MXFP4
blocks made by gguf-py against the same blocks dequantized."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from transformers import GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from models.layers.checkpoint import load_checkpoint
from models.layers.fused_moe import SparseMoeBlock, dequantize_mxfp4, expert_shard, gpt_oss_tensors, is_sparse_layer
from models.quantization.gguf import GGUFConfig, GGUFTensor
from tests.gguf_blocks import random_blocks

HIDDEN, INTER, EXPERTS = 64, 32, 8


def reference(kind: str, renormalize: bool = True):
    """(config, transformers' MoE block with random weights, its checkpoint tensors in the hub's per-expert names)."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=3,
            norm_topk_prob=renormalize,
        )  # fmt: skip
        block, names = Qwen3MoeSparseMoeBlock(config), ("gate_proj", "up_proj", "down_proj")
    elif kind == "qwen2_moe":  # with the gated shared expert
        config = Qwen2MoeConfig(
            hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=2,
            shared_expert_intermediate_size=48, norm_topk_prob=renormalize,
        )  # fmt: skip
        block, names = Qwen2MoeSparseMoeBlock(config), ("gate_proj", "up_proj", "down_proj")
    else:
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS)
        block, names = MixtralSparseMoeBlock(config), ("w1", "w3", "w2")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    gate_up, down = block.experts.gate_up_proj.data, block.experts.down_proj.data  # [E, 2I, H], [E, H, I]
    tensors = {"mlp.gate.weight": block.gate.weight.data}
    if kind == "qwen2_moe":
        tensors["mlp.shared_expert_gate.weight"] = block.shared_expert_gate.weight.data
        for proj in ("gate_proj", "up_proj", "down_proj"):
            tensors[f"mlp.shared_expert.{proj}.weight"] = getattr(block.shared_expert, proj).weight.data
    for e in range(EXPERTS):
        tensors[f"mlp.experts.{e}.{names[0]}.weight"] = gate_up[e, :INTER]
        tensors[f"mlp.experts.{e}.{names[1]}.weight"] = gate_up[e, INTER:]
        tensors[f"mlp.experts.{e}.{names[2]}.weight"] = down[e]
    return config, block.eval(), tensors


class Holder(torch.nn.Module):
    """A module with the block at `mlp`, as a decoder layer holds it (load_checkpoint's names)."""

    def __init__(self, block):
        super().__init__()
        self.mlp = block


@pytest.mark.parametrize(
    "kind, renormalize", [("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False), ("mixtral", True)]
)
def test_moe_block_equals_transformers(kind, renormalize):
    config, ref, tensors = reference(kind, renormalize)
    ours = Holder(SparseMoeBlock(config, None))
    load_checkpoint(ours, config, tensors.items(), torch.float32)
    x = torch.randn(37, HIDDEN)
    with torch.no_grad():
        expected = ref(x[None])
        expected = (expected[0] if isinstance(expected, tuple) else expected)[0]  # Mixtral also returns its logits
        got = ours.mlp(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    used = torch.bincount(ours.mlp.gate.weight.matmul(x.T).T.topk(ours.mlp.top_k).indices.flatten(), minlength=EXPERTS)
    assert (used > 1).any()  # experts shared by several tokens: the grouping is exercised


def test_gguf_experts_compute_on_their_blocks():
    """The experts as a GGUF file stacks them (one [E, rows, cols] tensor per projection, Q8_0 blocks) give what
    the same weights dequantized give, within the kernels' activation rounding."""
    config, _, tensors = reference("qwen3_moe")
    names = ("gate_proj", "up_proj", "down_proj")
    stacked = {p: torch.stack([tensors[f"mlp.experts.{e}.{p}.weight"] for e in range(EXPERTS)]) for p in names}
    quant, plain = {}, {"mlp.gate.weight": tensors["mlp.gate.weight"]}
    for p, w in stacked.items():
        rows, cols = w.shape[0] * w.shape[1], w.shape[2]
        blocks = quantize(w.reshape(rows, cols).numpy(), GGMLQuantizationType.Q8_0)
        quant[f"mlp.experts.{p}.weight"] = GGUFTensor(GGMLQuantizationType.Q8_0, torch.from_numpy(blocks), cols)
        deq = dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(w.shape)
        plain[f"mlp.experts.{p}.weight"] = torch.from_numpy(np.ascontiguousarray(deq))  # every expert's at once
    q = Holder(SparseMoeBlock(config, None, GGUFConfig()))
    load_checkpoint(q, config, ({"mlp.gate.weight": tensors["mlp.gate.weight"]} | quant).items(), torch.float32)
    f = Holder(SparseMoeBlock(config, None))
    load_checkpoint(f, config, plain.items(), torch.float32)
    x = torch.randn(11, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(q.mlp(x), f.mlp(x), rtol=2e-2, atol=2e-3)


def test_expert_names_and_sparse_layers():
    assert expert_shard("layers.0.mlp.experts.3.up_proj.weight") == ("layers.0.mlp.experts.w13_weight", (3, 1))
    assert expert_shard("layers.2.mlp.experts.w2.weight") == ("layers.2.mlp.experts.w2_weight", (None, 2))
    assert expert_shard("layers.0.mlp.experts.0.w2.weight") == ("layers.0.mlp.experts.w2_weight", (0, 2))
    assert expert_shard("layers.0.mlp.gate_proj.weight") is None
    qwen = Qwen3MoeConfig(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_sparse_layer(qwen, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not is_sparse_layer(Qwen3MoeConfig(num_experts=0), 0)


def gpt_oss_reference(limit: float):
    """(config, transformers' gpt-oss MoE block with random weights and biases, its checkpoint tensors)."""
    torch.manual_seed(0)
    config = GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=3,
        swiglu_limit=limit,
    )  # fmt: skip
    block = GptOssMLP(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return config, block.eval(), {f"mlp.{n}": p.data for n, p in block.named_parameters()}


@pytest.mark.parametrize("limit", [7.0, 0.3])
def test_gpt_oss_block_equals_transformers(limit):
    """Router and expert biases, interleaved gate/up columns in the checkpoint, the clamped SwiGLU (binding at 0.3),
    softmax over the top-k logits."""
    config, ref, tensors = gpt_oss_reference(limit)
    ours = Holder(SparseMoeBlock(config, None))
    load_checkpoint(ours, config, gpt_oss_tensors(tensors.items()), torch.float32)
    x = torch.randn(37, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(ours.mlp(x), ref(x[None])[0][0], rtol=1e-5, atol=1e-5)


def test_gpt_oss_mxfp4_experts_on_their_blocks():
    """MXFP4 experts, as llama.cpp's converter writes gpt-oss's (gguf-py's blocks here), computed on their blocks,
    against the same blocks dequantized by gguf-py; and OpenAI's checkpoint layout of those values (`*_blocks`,
    `*_scales`) dequantized exactly."""
    from scripts.make_tiny_model import mxfp4_quantize

    config, _, tensors = gpt_oss_reference(7.0)
    plain = dict(gpt_oss_tensors(tensors.items()))
    quant = dict(plain)
    for p in ("gate_proj", "up_proj", "down_proj"):
        w = plain[f"mlp.experts.{p}.weight"]  # [E, rows, cols]
        rows, cols = w.shape[0] * w.shape[1], w.shape[2]
        blocks = quantize(w.reshape(rows, cols).numpy(), GGMLQuantizationType.MXFP4)
        quant[f"mlp.experts.{p}.weight"] = GGUFTensor(GGMLQuantizationType.MXFP4, torch.from_numpy(blocks), cols)
        deq = torch.from_numpy(dequantize(blocks, GGMLQuantizationType.MXFP4).reshape(w.shape).copy())
        plain[f"mlp.experts.{p}.weight"] = deq
        hf_blocks, hf_scales = mxfp4_quantize(deq)  # the same values in OpenAI's layout
        assert torch.equal(dequantize_mxfp4(hf_blocks.reshape(*hf_scales.shape, 16), hf_scales), deq)
    q = Holder(SparseMoeBlock(config, None, GGUFConfig()))
    load_checkpoint(q, config, quant.items(), torch.float32)
    f = Holder(SparseMoeBlock(config, None))
    load_checkpoint(f, config, plain.items(), torch.float32)
    x = torch.randn(11, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(q.mlp(x), f.mlp(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "qtypes, limit, activation",
    [
        ((GGMLQuantizationType.Q8_0,) * 3, None, "silu"),
        ((GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K), None, "silu"),
        ((GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0), None, "silu"),
        ((GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K), None, "gelu_tanh"),
        ((GGMLQuantizationType.MXFP4,) * 3, 0.3, "silu"),
    ],
    ids=["q8_0", "q4_k_m", "mixed", "q4_k_m_geglu", "mxfp4_gpt_oss"],
)
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("layout", ["blocks", "r16"])
def test_one_call_experts_equal_the_per_expert_loop(qtypes, limit, activation, tokens, layout, monkeypatch):
    """With int8 activations (the default), a step's routed experts run in one C call (ops.gguf_moe): the result
    equals FusedMoE's loop over the experts, which calls the same kernel per projection, bit for bit with SiLU and
    GeGLU (Gemma 4's experts; to float rounding with gpt-oss's clamped SwiGLU and biases, which the loop computes
    in torch): the tokens grouped by expert in the same order, each expert's gate and up (a K-quant gate and up
    share one activation quantization on blocks), the activation, down, the weighted sum. `layout` blocks: the
    file's blocks on the AVX2 int8 kernel (MINIVLLM_GGUF_KERNEL=avx2); r16: repacked at load for the AVX512-VNNI
    kernel (or gguf_r16_avx2.c's with AVX2 alone), each expert a range of 16-row groups (MXFP4's codes through a
    byte shuffle). 256-wide rows so that the K-quants' super-blocks fit; 300 tokens stand for a prompt's chunk
    (more than 8 rows per expert: the kernels' tiled loops)."""
    from models.kernels import cpu_kernels
    from models.kernels import ops as kernel_ops
    from models.quantization.gguf import gguf_kernel, int8_activations, r16_int8

    lib = cpu_kernels.load()
    if lib is None or not lib.gguf_q8_isa():
        pytest.skip("the CPU has no AVX2")
    if layout == "r16" and not all(lib.gguf_r16_takes(int(q), 1) for q in qtypes):
        pytest.skip("the CPU has no R16 int8 kernel for these types (AVX2 alone: none for Q8_0)")
    monkeypatch.setenv("MINIVLLM_GGUF_KERNEL", "avx2" if layout == "blocks" else "auto")
    monkeypatch.setenv("MINIVLLM_GGUF_ACTIVATIONS", "int8")
    for cached in (gguf_kernel, int8_activations, r16_int8):
        cached.cache_clear()
    try:
        hidden, inter, experts = 256, 512, 6
        kind = "gpt_oss" if limit else "qwen3_moe"
        config = (
            GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                         num_experts_per_tok=3, swiglu_limit=limit)
            if limit
            else Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                                num_experts_per_tok=3)
        )  # fmt: skip
        block = SparseMoeBlock(config, None, GGUFConfig())
        block.experts.activation = activation
        torch.manual_seed(tokens)
        shapes = [(inter, hidden), (inter, hidden), (hidden, inter)]
        for proj, (qtype, (rows, cols)) in enumerate(zip(qtypes, shapes)):
            blocks = random_blocks(qtype, experts * rows, cols, seed=proj).reshape(experts * rows, -1)
            block.experts.quant_method.load(proj, GGUFTensor(qtype, blocks, cols))
        block.experts.quant_method.process_weights_after_loading(torch.float32)
        assert [b.r16 for b in block.experts.quant_method.blocks] == [layout == "r16"] * 3
        with torch.no_grad():
            block.gate.weight.normal_(std=0.5)
            if kind == "gpt_oss":
                block.gate.bias.normal_()
                block.experts.w13_bias.normal_()
                block.experts.w2_bias.normal_()
        x = torch.randn(tokens, hidden)
        calls = []
        real = kernel_ops.gguf_moe
        monkeypatch.setattr(kernel_ops, "gguf_moe", lambda *a: calls.append(1) or real(*a))
        with torch.no_grad():
            one_call = block(x)
            assert calls, "the one-call path did not run"
            monkeypatch.setattr(kernel_ops, "gguf_moe", lambda *a: None)
            loop = block(x)
        if limit is None:  # the same kernels in the same order, the SiLU by layer_ops.c's: bit for bit
            assert torch.equal(one_call, loop)
        else:  # gpt-oss's activation: torch's in the loop, so h agrees to float rounding; where an h sits on a
            # rounding boundary of the down projection's int8 activations, one code flips and moves that token's row
            # by a code step times the weights (2 of 64 rows here, 2e-4 of the output's scale): a few rows may
            close = torch.isclose(one_call, loop, rtol=1e-5, atol=1e-5).all(dim=1)
            assert (~close).sum() <= max(1, tokens // 16), f"{int((~close).sum())} of {tokens} rows differ"
            assert (one_call - loop).abs().max() <= 1e-3 * loop.abs().max()
        assert one_call.abs().mean() > 1e-3
    finally:
        for cached in (gguf_kernel, int8_activations, r16_int8):
            cached.cache_clear()
