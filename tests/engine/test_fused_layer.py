"""The decoder layer in one C call (models/layers/fused_layer.py) against the same layer op by op."""

import contextlib
import json
import sys

import pytest
import torch
from gguf import GGMLQuantizationType

from engine import SamplingParams
from models.kernels import cpu_kernels
from models.layers.fused_layer import (
    KERNEL_EXACT,
    KERNEL_INT8,
    KERNEL_R16,
    KERNEL_R16_INT8,
    FusedDecoderLayer,
    FusedDecoderStack,
)
from models.quantization.gguf import (
    R16_COPY_HEAD_MIN_ROWS,
    R16_COPY_MIN_ROWS,
    amx_tiles,
    gguf_kernel,
    int8_activations,
    q8_0_blocks_at_one_row,
    r16_int8,
)
from tests.engines import make_llm

CACHED = (gguf_kernel, amx_tiles, int8_activations, r16_int8)


@contextlib.contextmanager
def _gguf_settings(monkeypatch, **env: str):
    """The block's engines under these MINIVLLM_GGUF_* variables (their cached readers cleared); after it,
    everything the test patched is restored and the suite's settings are read again."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for cached in CACHED:
        cached.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        for cached in CACHED:
            cached.cache_clear()


def _generate(llm, prompts, mode: str, params):
    """Generates with every layer fused where it can be: the whole stage in one C call with the model's ends (the
    embedding, the final norm and the LM head: FusedDecoderStack.step, the default, "step"), the layers alone in one
    call ("stack"), one call per layer ("layers"), or every layer op by op ("plain"). A model without a one-call
    stack (Qwen3.5) runs its layers' calls in every fused mode."""
    model = llm.engine.engine_core.executor.runner.model
    has_stack = hasattr(model, "fused_stack")
    if has_stack and model.fused_stack is None and mode == "stack":
        model.fused_stack = model._build_stack() or False
    stack = getattr(model, "fused_stack", None)
    saved = stack, [layer.fused for layer in model.layers], getattr(stack, "ends", None)
    if mode in ("layers", "plain") and has_stack:
        model.fused_stack = False
    if mode == "stack" and stack:
        stack.ends = None
    elif mode == "plain":
        for layer in model.layers:
            layer.fused = False
    # every mode from an empty prefix cache: a prompt whose blocks an earlier mode cached computes only its tail, in
    # steps of other row counts than the whole prompt's (other kernels: dequantized weights and torch's GEMM from
    # PORTABLE_MAX_ROWS rows), which on an AMX Xeon moved the next decode's logprobs in the 7th digit
    llm.reset_prefix_cache()
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:  # what the mode turned off (and a stack built over turned-off layers) as it was
        if mode != "step" and has_stack:
            model.fused_stack = saved[0]
        if mode == "stack" and stack:
            stack.ends = saved[2]
        if mode == "plain":
            for layer, f in zip(model.layers, saved[1]):
                layer.fused = f


def _counting(monkeypatch, *classes) -> list[tuple[type, str, bool]]:
    """A list that gets (class, method, whether it computed the step) for every call of the classes' instances:
    __call__, and a stack's `step`."""
    calls = []
    for cls in classes:
        for name in ("__call__", "step") if cls is FusedDecoderStack else ("__call__",):

            def counted(self, *args, real=getattr(cls, name), name=name):
                out = real(self, *args)
                calls.append((type(self), name, out is not None))
                return out

            monkeypatch.setattr(cls, name, counted)
    return calls


def _assert_fused_equals_plain(
    llm, prompts, monkeypatch, stack: bool = True, layer_classes: tuple = (FusedDecoderLayer,)
) -> None:
    """Greedy tokens and their logprobs of decode steps of 1 and 8 rows, and of 1 row without logprobs (the
    sampler's one argmax a row: the stage's call computes it), the whole stage in one call with the model's ends and
    without them (unless not `stack`) and one call per layer against op by op, bit for bit, while each fused path
    really ran (in the per-layer mode, every one of `layer_classes`)."""
    calls = _counting(monkeypatch, FusedDecoderStack, *layer_classes)
    stacks = [("step", {(FusedDecoderStack, "step")}), ("stack", {(FusedDecoderStack, "__call__")})]
    for batch, logprobs in [(prompts[:1], None), (prompts[:1], 2), (prompts, 2)]:  # 1-row and 8-row decodes
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=logprobs, ignore_eos=True)
        plain = _generate(llm, batch, "plain", params)
        for mode, ran in stacks * stack + [("layers", {(cls, "__call__") for cls in layer_classes})]:
            calls.clear()
            fused = _generate(llm, batch, mode, params)
            assert {(cls, name, True) for cls, name in ran} <= set(calls), f"a fused path ({mode}) never ran"
            for a, b in zip(fused, plain):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                if logprobs:
                    assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs]


@pytest.mark.parametrize(
    "activations, kernel, kv_cache_dtype",
    [
        ("float", "auto", "auto"),
        ("int8", "auto", "auto"),
        ("int16", "auto", "auto"),
        ("int8", "avx2", "auto"),
        ("float", "auto", "fp8"),
    ],
)
def test_fused_layer_equals_the_op_by_op_layer(llm, prompts, activations, kernel, kv_cache_dtype, monkeypatch):
    """Greedy tokens and their logprobs, bit for bit, over decode steps of 1 and 8 rows and prompts of 6 to 400
    tokens (fused prefill steps up to the layer's max_rows: any with the quantized kernels), while the fused path
    really ran: it calls the same kernels in the same order. With the exact float kernels (the suite's setting),
    with the default (weights repacked for the AVX512-VNNI kernel on int8 activations where the CPU has it, for
    the AVX2 R16 kernels with AVX2 alone, Q8_0's blocks on the AVX2 int8 kernel there), with the VNNI kernel's
    int16 activations, with the AVX2 int8 kernel on the file's blocks
    forced, and over an fp8 KV cache."""
    quantized = activations in ("int8", "int16")
    if quantized and not cpu_kernels.load().gguf_q8_isa():
        pytest.skip("the CPU has no AVX2")
    env = dict(MINIVLLM_GGUF_ACTIVATIONS=activations, MINIVLLM_GGUF_KERNEL=kernel) if quantized else {}
    with _gguf_settings(monkeypatch, **env):
        if quantized or kv_cache_dtype != "auto":
            llm = make_llm(kv_cache_dtype=kv_cache_dtype)
        # Q4_1 repacked: with AVX512-VNNI, or with AVX2 alone on int8 activations (gguf_r16_avx2.c)
        r16 = quantized and kernel == "auto" and bool(cpu_kernels.load().gguf_r16_takes(3, activations == "int8"))
        _assert_fused_equals_plain(llm, prompts, monkeypatch)
        layers = llm.engine.engine_core.executor.runner.model.layers
        assert all(isinstance(layer.fused, FusedDecoderLayer) for layer in layers)
        assert {layer.fused.max_rows for layer in layers} == {sys.maxsize if quantized else 8}
        kinds = {layer.fused.desc.qkv.kernel[0] for layer in layers}
        if r16:
            want = KERNEL_R16_INT8 if activations == "int8" else KERNEL_R16
        else:
            want = KERNEL_INT8 if quantized else KERNEL_EXACT
        assert kinds == {want}, kinds
        held = set(llm.engine.engine_core.executor.runner.weight_bytes) if r16 else set()
        if r16 and not cpu_kernels.load().gguf_r16_isa():  # AVX2 alone: Q8_0 keeps its blocks, no copy
            assert held >= {"Q4_1 (R16)", "Q8_0"} and "Q8_0 (R16 copy)" not in held, held
        elif r16 and q8_0_blocks_at_one_row():  # the 30 MB Q8_0 LM head is over R16_Q8_0_MAX_BYTES: its
            assert held >= {"Q4_1 (R16)", "Q8_0", "Q8_0 (R16 copy)"}  # blocks for one row (and an R16 copy)
        elif r16:  # an Intel CPU: repacked, as every other weight
            assert held >= {"Q4_1 (R16)", "Q8_0 (R16)"} and "Q8_0" not in held, held


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_bfloat16_model_fuses_its_layers_too(prompts, kv_cache_dtype, monkeypatch):
    """A bfloat16 GGUF model computes its norms and MLP in float32 and q, k, v and the attention in bfloat16: its
    fused layer (attn_bf16) gives the op-by-op layer's greedy tokens and logprobs bit for bit, over a bfloat16 and
    an int8 cache, at decode steps of 1 and 8 rows, while it really ran."""
    bf16 = make_llm(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    _assert_fused_equals_plain(bf16, prompts, monkeypatch)
    layers = bf16.engine.engine_core.executor.runner.model.layers
    assert all(isinstance(layer.fused, FusedDecoderLayer) and layer.fused.desc.attn_bf16 for layer in layers)


def test_a_bfloat16_qwen2_fuses_its_qkv_bias(llm, prompts, tmp_path, monkeypatch):
    """Qwen2's q/k/v bias in a bfloat16 model: added to the bfloat16 product and rounded again, as torch adds the
    bfloat16 bias op by op, on a Q8_0 file llama.cpp's converter makes of the tiny Qwen2: the fused layer's greedy
    tokens and logprobs equal the op-by-op layer's bit for bit, while it really ran with the bias."""
    from scripts import llama_cpp
    from scripts.make_tiny_model import save_tiny_model

    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    save_tiny_model("qwen2", tmp_path / "hf", llm.tokenizer)
    # transformers gives model_type qwen2 Qwen's own pre-tokenizer, whose hash of SmolLM2's vocabulary llama.cpp does
    # not know: the converter reads the tokenizer as a Llama's (the architecture stays Qwen2ForCausalLM)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf", outtype="q8_0")
    qwen2 = make_llm(model=str(gguf), dtype="bfloat16")
    _assert_fused_equals_plain(qwen2, prompts, monkeypatch)
    layers = qwen2.engine.engine_core.executor.runner.model.layers
    assert all(isinstance(layer.fused, FusedDecoderLayer) and layer.fused.desc.qkv.bias for layer in layers)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_fuses_its_head_norms(llm, prompts, dtype, tmp_path, monkeypatch):
    """Qwen3's q_norm and k_norm (an RMSNorm over each head of q and of k, before the rotation) inside the one-call
    layer, on a Q8_0 file llama.cpp's converter makes of the tiny Qwen3 (its head norms made to matter): greedy
    tokens and logprobs equal the op-by-op layer's bit for bit, in float32 and in bfloat16, while it really ran with
    the norms."""
    from scripts import llama_cpp
    from scripts.make_tiny_model import save_tiny_model

    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    save_tiny_model("qwen3", tmp_path / "hf", llm.tokenizer)
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf", outtype="q8_0")
    qwen3 = make_llm(model=str(gguf), dtype=dtype)
    _assert_fused_equals_plain(qwen3, prompts, monkeypatch)
    layers = qwen3.engine.engine_core.executor.runner.model.layers
    assert all(isinstance(layer.fused, FusedDecoderLayer) and layer.fused.desc.q_norm for layer in layers)


def _qwen3_q8_0_with_copies(llm, tmp_path, monkeypatch) -> str:
    """The tiny Qwen3 as a Q8_0 file llama.cpp's converter makes, with R16_Q8_0_MAX_BYTES made 0 (patched for the
    test) so that every weight keeps its blocks with an R16 copy beside them; skips without the converter."""
    from models.quantization import gguf as gguf_method
    from scripts import llama_cpp
    from scripts.make_tiny_model import save_tiny_model

    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    save_tiny_model("qwen3", tmp_path / "hf", llm.tokenizer)
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf", outtype="q8_0")
    monkeypatch.setattr(gguf_method, "R16_Q8_0_MAX_BYTES", 0)
    monkeypatch.setattr(gguf_method, "q8_0_blocks_at_one_row", lambda: True)  # on Intel's CPUs too
    return str(gguf)


@pytest.mark.skipif(not cpu_kernels.load().gguf_r16_isa(), reason="the CPU has no AVX512-VNNI (R16 copies)")
def test_q8_0_blocks_and_their_r16_copy_in_the_fused_layer(llm, prompts, tmp_path, monkeypatch):
    """A Q8_0 weight over R16_Q8_0_MAX_BYTES keeps its blocks with an R16 copy beside them (made 0 here, so that
    every weight of the tiny Qwen3's Q8_0 file llama.cpp's converter makes does): the one-call layer takes the
    blocks for steps of fewer than R16_COPY_MIN_ROWS rows and the copy for more, and the stage's call takes the LM
    head's copy from R16_COPY_HEAD_MIN_ROWS rows, as GGUFTensor.matmul does, so greedy tokens and logprobs of 1- and
    8-row decode steps equal the op-by-op layers' bit for bit."""
    with _gguf_settings(monkeypatch, MINIVLLM_GGUF_ACTIVATIONS="int8"):
        qwen3 = make_llm(model=_qwen3_q8_0_with_copies(llm, tmp_path, monkeypatch), dtype="bfloat16")
        _assert_fused_equals_plain(qwen3, prompts, monkeypatch)
        model = qwen3.engine.engine_core.executor.runner.model
        descs = [layer.fused.desc for layer in model.layers]
        assert all(d.qkv.copy[0] and d.o.copy[0] and d.down.copy[0] and d.qkv.kernel[0] == KERNEL_INT8 for d in descs)
        assert {d.qkv.copy_kernel for d in descs} == {KERNEL_R16_INT8}
        assert {d.gate_up.copy_rows for d in descs} == {R16_COPY_MIN_ROWS}
        head = model.fused_stack.ends.head
        assert head.copy[0] and head.copy_rows == R16_COPY_HEAD_MIN_ROWS < R16_COPY_MIN_ROWS
        assert "Q8_0 (R16 copy)" in qwen3.engine.engine_core.executor.runner.weight_bytes


@pytest.mark.skipif(not cpu_kernels.load().gguf_q8_isa(), reason="the CPU has no AVX2 (the int8 kernels' team forms)")
def test_a_stack_runs_its_layers_with_a_one_region_form_together(llm, prompts, tmp_path, monkeypatch):
    """A stack whose first layer has no one-region form (its Q8_0 weights on their blocks and the exact float32
    kernel, gguf_linear: its R16 copies dropped and its int8 activations off) and whose second layer has one (R16
    copies for steps of R16_COPY_MIN_ROWS rows where the CPU has AVX512-VNNI, the blocks on the AVX2 int8 kernel
    below them and on every other CPU): decoder_layers_float runs the first kernel by kernel and the second in a
    region of its own, reading the first one's output and its own cache, so greedy tokens and logprobs of 1- and
    8-row decode steps equal the op-by-op layers' bit for bit, on the tiny Qwen3's Q8_0 file llama.cpp's converter
    makes."""
    from models.quantization.gguf import GGUFTensor, quantized_weights

    class ExactTensor(GGUFTensor):  # the first layer's weights: float32 activations in both paths
        int8 = False

    with _gguf_settings(monkeypatch, MINIVLLM_GGUF_ACTIVATIONS="int8"):
        qwen3 = make_llm(model=_qwen3_q8_0_with_copies(llm, tmp_path, monkeypatch), dtype="bfloat16")
        layers = qwen3.engine.engine_core.executor.runner.model.layers
        assert len(layers) == 2
        for module in layers[0].modules():
            for w in quantized_weights(module):
                w.r16_copy, w.__class__ = None, ExactTensor
        _assert_fused_equals_plain(qwen3, prompts, monkeypatch)
        descs = [layer.fused.desc for layer in layers]
        first = [descs[0].qkv, descs[0].o, descs[0].gate_up, descs[0].down]
        assert not any(d.copy[0] for d in first) and {d.kernel[0] for d in first} == {KERNEL_EXACT}
        second = [descs[1].qkv, descs[1].o, descs[1].gate_up, descs[1].down]
        assert {d.kernel[0] for d in second} == {KERNEL_INT8}
        assert all(bool(d.copy[0]) == bool(cpu_kernels.load().gguf_r16_isa()) for d in second)


@pytest.mark.parametrize("dtype, kernel", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "avx2")])
def test_qwen3_moe_fuses_its_experts(llm, prompts, dtype, kernel, tmp_path, monkeypatch):
    """Mixture-of-experts layers (the tiny Qwen3-MoE: 8 experts, 2 a token, renormalised; every layer sparse, as
    llama.cpp's converter needs) in the one-call layer: the router (moe_route_float, which the op-by-op block calls
    too) and the experts (gguf_moe: repacked for the AVX512-VNNI kernel where the CPU has it, or the file's blocks on
    the AVX2 int8 kernel) inside the call, on int8 activations (the default), on a Q8_0 file the converter makes:
    greedy tokens and logprobs equal the op-by-op layers' bit for bit while the fused paths really ran."""
    from scripts import llama_cpp
    from scripts.make_tiny_model import save_tiny_model

    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    if not cpu_kernels.load().gguf_q8_isa():
        pytest.skip("the CPU has no AVX2")
    save_tiny_model("qwen3_moe", tmp_path / "hf", llm.tokenizer, mlp_only_layers=[])
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf", outtype="q8_0")
    with _gguf_settings(monkeypatch, MINIVLLM_GGUF_ACTIVATIONS="int8", MINIVLLM_GGUF_KERNEL=kernel):
        moe = make_llm(model=str(gguf), dtype=dtype)
        _assert_fused_equals_plain(moe, prompts, monkeypatch)
        layers = moe.engine.engine_core.executor.runner.model.layers
        assert all(isinstance(layer.fused, FusedDecoderLayer) for layer in layers)
        assert [layer.fused.desc.num_experts for layer in layers] == [8, 8]
        r16 = kernel == "auto" and bool(cpu_kernels.load().gguf_r16_isa())
        assert {layer.fused.desc.moe_kernel for layer in layers} == {2 if r16 else 0}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_oss_fuses_its_layers(llm, prompts, dtype, tmp_path, monkeypatch):
    """gpt-oss's layers in one call each (its sliding and full layers are two KV cache groups, so no one-call
    stack): attention sinks, the q/k/v and o_proj biases, the router's bias and its MXFP4 experts with their biases
    and clamped SwiGLU inside the call, on the GGUF llama.cpp's converter makes of the tiny gpt-oss (MXFP4 experts,
    Q8_0 else), on int8 activations (the default): greedy tokens and logprobs equal the op-by-op layers' bit for bit
    while the fused layers really ran."""
    from scripts import llama_cpp
    from scripts.make_tiny_model import save_mxfp4_copy, save_tiny_model

    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    if not cpu_kernels.load().gguf_q8_isa():
        pytest.skip("the CPU has no AVX2")
    save_tiny_model("gpt_oss", tmp_path / "hf", llm.tokenizer, mxfp4=True, swiglu_limit=7.0)
    save_mxfp4_copy(tmp_path / "hf", tmp_path / "mxfp4")
    gguf = llama_cpp.convert(tmp_path / "mxfp4", tmp_path / "model.gguf", outtype="q8_0")
    with _gguf_settings(monkeypatch, MINIVLLM_GGUF_ACTIVATIONS="int8"):
        model_llm = make_llm(model=str(gguf), dtype=dtype)
        _assert_fused_equals_plain(model_llm, prompts, monkeypatch, stack=False)
        layers = model_llm.engine.engine_core.executor.runner.model.layers
        assert all(isinstance(layer.fused, FusedDecoderLayer) for layer in layers)
        descs = [layer.fused.desc for layer in layers]
        assert all(d.sinks and d.o.bias and d.expert_b13 and d.expert_b2 and d.swiglu_limit == 7.0 for d in descs)
        assert {d.expert_type[0] for d in descs} == {int(GGMLQuantizationType.MXFP4)}
        window = model_llm.engine.engine_core.executor.runner.model.config.sliding_window
        assert sorted({d.window for d in descs}) == [0, window]


@pytest.mark.parametrize("activations, dtype", [("int8", "auto"), ("float", "auto"), ("int8", "float32")])
def test_qwen3_5_fuses_its_layers(llm, prompts, activations, dtype, tmp_path, monkeypatch):
    """Qwen3.5's layers in one call each per decode step: its Gated DeltaNet layers (FusedDeltaLayer: the input norm,
    the projections, the DeltaNet's one-token step on each sequence's state slot, out_proj, the post norm and the
    MLP) and its gated attention layers (FusedDecoderLayer with partial rotary and the sigmoid output gate), on a
    Q8_0 file llama.cpp's converter makes of the tiny Qwen3.5 (value heads tiled as llama.cpp orders them), on int8
    activations (the default) and the exact float kernels, in the default dtype (bfloat16 where the CPU has it)
    and float32: greedy tokens and logprobs of decode steps of 1 and 8 rows equal the op-by-op layers' bit for bit,
    while both fused layers really ran."""
    from models.layers.fused_layer import FusedDeltaLayer
    from scripts import llama_cpp
    from scripts.make_tiny_model import add_mtp_head, save_tiny_model

    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    save_tiny_model("qwen3_5", tmp_path / "hf", llm.tokenizer)
    add_mtp_head(tmp_path / "hf")
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf", outtype="q8_0")
    with _gguf_settings(monkeypatch, MINIVLLM_GGUF_ACTIVATIONS=activations):
        model_llm = make_llm(model=str(gguf), dtype=dtype)
        layers = model_llm.engine.engine_core.executor.runner.model.layers
        _assert_fused_equals_plain(
            model_llm, prompts, monkeypatch, stack=False, layer_classes=(FusedDeltaLayer, FusedDecoderLayer)
        )
        kinds = [FusedDeltaLayer if layer.is_linear else FusedDecoderLayer for layer in layers]
        assert [type(layer.fused) for layer in layers] == kinds and len(set(kinds)) == 2
        attention = [layer.fused.desc for layer in layers if not layer.is_linear]
        head_dim = model_llm.engine.engine_core.executor.runner.model.config.head_dim
        assert all(d.output_gate and 0 < d.rotary_dim < head_dim for d in attention)


def test_long_steps_are_declined(llm):
    """A step of more rows than the layer's kernels take without dequantizing (max_rows) is declined: None,
    nothing computed, and the layer runs op by op."""
    layer = llm.engine.engine_core.executor.runner.model.layers[0]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), use_tqdm=False)  # builds the fused form
    assert isinstance(layer.fused, FusedDecoderLayer)
    for rows in (layer.fused.max_rows + 1, layer.fused.max_rows + 40):
        residual = torch.zeros(rows, layer.input_layernorm.weight.shape[0])
        rope = (torch.zeros(rows, 32), torch.zeros(rows, 32))
        assert layer.fused(residual, None, rope, (torch.zeros(1),) * 2, None) is None


def test_auto_dtype_is_bfloat16_where_the_cpu_has_it(monkeypatch):
    """dtype auto: bfloat16 on a CPU with AVX512-BF16 or AMX (vLLM-CPU's rule), float32 without; a GGUF model on its
    blocks also on an AVX-512 CPU with VNNI and no BF16 (nothing emulated there); the default GGUF model takes it and
    still runs its layers as one C call each (q, k, v and the attention in bfloat16)."""
    from engine.worker import model_runner

    cpu = torch.device("cpu")
    vnni = {"avx2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}
    for flags, gguf, want in [
        ({"avx2", "avx512_bf16"}, False, torch.bfloat16),
        ({"avx2", "avx512_bf16", "amx_bf16"}, False, torch.bfloat16),
        ({"avx2"}, False, torch.float32),
        ({"avx2"}, True, torch.float32),
        (vnni, False, torch.float32),
        (vnni, True, torch.bfloat16),
        (vnni - {"avx512_vnni"}, True, torch.float32),
    ]:
        monkeypatch.setattr(model_runner, "cpu_flags", lambda flags=flags: flags)
        assert model_runner.auto_dtype(cpu, gguf_blocks=gguf)[0] == want, (flags, gguf)
    for flags, want in [({"avx2", "avx512_bf16"}, torch.bfloat16), ({"avx2"}, torch.float32), (vnni, torch.bfloat16)]:
        monkeypatch.setattr(model_runner, "cpu_flags", lambda flags=flags: flags)
        llm = make_llm(dtype="auto")
        runner = llm.engine.engine_core.executor.runner
        assert runner.dtype == want
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # builds the fused forms
        assert all(isinstance(layer.fused, FusedDecoderLayer) for layer in runner.model.layers)
        assert {layer.fused.desc.attn_bf16 for layer in runner.model.layers} == {int(want == torch.bfloat16)}
