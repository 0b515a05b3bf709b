"""Each supported architecture against transformers, on tiny random models saved as HF directories
(scripts/make_tiny_model.py):
Llama 3 (llama3 RoPE scaling, untied LM head), Qwen2 (q/k/v biases; and with sliding layers after full ones),
Mistral (a sliding window shorter than the prompt), Qwen3 (per-head q/k RMSNorm, head_dim apart from
hidden_size / heads), Phi-3 (fused q/k/v and gate/up tensors, a sliding window), Phi-4-mini (LongRoPE, rotary on
3/4 of each head, a tied head), SmolLM3 (a layer without
rotary), Granite (multipliers), Gemma 2 (soft caps, pre/post norms, GeGLU, alternating windows) and Gemma 3
(q/k norms, a rope base per layer kind, linear scaling), Gemma 4 (global layers with heads of their own size and
values from their keys, proportional rope, per-layer embeddings, layers that read earlier layers' K/V; its 26B-A4B
shape's experts beside the dense MLP), the mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral
and gpt-oss (attention sinks, biases, a clamped SwiGLU, YaRN; MXFP4 experts), the hybrids LFM2 (conv states beside
the KV cache) and Qwen3.5 (Gated DeltaNet states, gated attention with partial rotary); each feature shown to
matter. The
GGUF files llama.cpp's converter makes of them; and the registry's and the loader's errors."""

import dataclasses
import json
import shutil

import pytest
import torch

from engine import SamplingParams
from models.gguf import load_gguf_config
from models.layers.rotary_embedding import rope_inv_freq
from models.registry import get_model_class
from scripts import llama_cpp
from scripts.make_tiny_model import CONFIGS, add_mtp_head, save_mxfp4_copy, save_tiny_model, sentencepiece_tokenizer
from tests.conftest import assert_greedy_matches, make_llm

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # > 64 positions, longer than the windows
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
FULL = {"sliding_window": None, "layer_types": ["full_attention"] * 2}
FULL4 = {"sliding_window": None, "layer_types": ["full_attention"] * 4}
# config edits that each take one feature of a tiny model away
FEATURES = {
    "mistral": [FULL],
    "phi3": [FULL],
    "qwen2_sliding": [FULL],
    "smollm3": [{"no_rope_layers": [1, 1, 1, 1]}],
    "gemma2": [
        FULL4,
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"query_pre_attn_scalar": 16},
    ],
    "gemma3": [
        {"layer_types": ["full_attention"] * 6},
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            }
        },
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            }
        },
    ],
    "gemma4": [
        {"sliding_window": 1000},
        {"final_logit_softcapping": None},
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0, "rope_theta": 1e6},
            }
        },
    ],
    "gemma4_moe": [{"top_k_experts": 1}],
    "qwen3_moe": [{"norm_topk_prob": False}, {"num_experts_per_tok": 1}],
    "qwen2_moe": [{"norm_topk_prob": True}],
    "mixtral": [{"num_experts_per_tok": 1}],
    "gpt_oss": [
        FULL,
        {"swiglu_limit": 100.0},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
        {"num_experts_per_tok": 1},
    ],
    "qwen3_5": [{"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}],
    "phi4_mini": [  # the long factors past the original context; LongRoPE at all
        {"rope_parameters": CONFIGS["phi4_mini"]().rope_parameters | {"long_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}},
    ],
    "granite": [
        {"embedding_multiplier": 1.0},
        {"attention_multiplier": 0.25},
        {"residual_multiplier": 1.0},
        {"logits_scaling": 1.0},
    ],
}

# llama.cpp's converter maps no dense layer in a Qwen3-MoE: its files have experts in every layer
# llama.cpp reads no query_pre_attn_scalar and writes no LM head for Gemma 2 (real ones have the scalar at head_dim
# and the head tied, as here)
# llama.cpp fixes gpt-oss's SwiGLU clamp at 7 (no metadata key)
GGUF_EDITS = {
    "qwen3_moe": {"mlp_only_layers": []},
    "gpt_oss": {"swiglu_limit": 7.0},
    "gemma2": {"query_pre_attn_scalar": 16, "tie_word_embeddings": True},
}
# checkpoints whose converter takes the vocabulary from a SentencePiece tokenizer.model, with its tokenizer class
SENTENCEPIECE = {
    "phi3": "LlamaTokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma4": "GemmaTokenizer",
    "gemma4_moe": "GemmaTokenizer",
}


def hf_greedy(model, prompt: list[int], n: int = 16) -> tuple[list[int], list[float]]:
    """transformers' n greedy tokens after `prompt`, with the top-two logit gap at each (the near-tie rule)."""
    with torch.inference_mode():
        ref = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return ref.sequences[0, len(prompt) :].tolist(), [
        float(t.topk(2).values[0, 0] - t.topk(2).values[0, 1]) for t in ref.logits
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_random_model_matches_transformers(name, llm, tmp_path):
    if name == "llama3":  # the scaling really changes the frequencies we use
        plain = type("Plain", (), {"rope_theta": 500000.0})()
        assert not torch.allclose(rope_inv_freq(CONFIGS[name](), 16), rope_inv_freq(plain, 16))
    ref_model = save_tiny_model(name, tmp_path, llm.tokenizer)
    ours = make_llm(model=str(tmp_path))
    prompt = llm.tokenizer.encode(PROMPT)
    out = ours.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert_greedy_matches(out.outputs[0].token_ids, hf_greedy(ref_model, prompt))
    # each feature matters: without it (the config edited) our tokens, or their logprobs, change
    scored = dataclasses.replace(GREEDY, logprobs=0)
    first = ours.generate([prompt], scored, use_tqdm=False)[0].outputs[0]
    for i, edit in enumerate(FEATURES.get(name, [])):
        config = json.loads((tmp_path / "config.json").read_text()) | edit
        plain = tmp_path.with_name(f"{tmp_path.name}-{i}")
        shutil.copytree(tmp_path, plain)
        (plain / "config.json").write_text(json.dumps(config))
        other = make_llm(model=str(plain)).generate([prompt], scored, use_tqdm=False)[0].outputs[0]
        assert (
            other.token_ids != first.token_ids or abs(other.logprobs[0].logprob - first.logprobs[0].logprob) > 1e-3
        ), f"{edit} changes nothing"


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "llama3",
        "qwen3",
        "smollm3",
        "granite",
        "phi3",
        "phi4_mini",
        "gemma2",
        "gemma3",
        "gemma4",
        "gemma4_moe",
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
        "gpt_oss",
        "lfm2",
        "qwen3_5",
        "qwen3_5_moe",
    ],
)
def test_gguf_made_by_llama_cpp_matches_transformers(name, llm, tmp_path):
    """The GGUF llama.cpp's own convert_hf_to_gguf.py makes of the tiny model (float32), as users' files are
    made: Llama 3's rope scaling arrives as the `rope_freqs` tensor of frequency divisors, applied; SmolLM3's
    rotary-free layers and Gemma 3's sliding layers follow llama.cpp's fixed patterns (the files carry neither),
    which the tiny configs share; Granite's multipliers, Gemma 2's soft caps and Gemma 3's rope bases come from the
    metadata, Gemma's norms stored as 1 + w; Phi-3's fused q/k/v and gate/up tensors stay fused. Phi-3 and
    Gemma 2 come with a SentencePiece vocabulary, which the converter reads from `tokenizer.model`. The mixtures
    of experts arrive with every expert of a projection stacked in one tensor (Mixtral as a "llama" file with
    experts; gpt-oss's YaRN parameters from the metadata, its sinks, router and expert biases as tensors; LFM2's
    conv layers told by their zero KV heads, its MLP width already adjusted); Qwen3.5's DeltaNet with its value
    heads in llama.cpp's tiled order, A stored as -exp(A_log), its norms as 1 + w but the DeltaNet's, and its
    multi-token-prediction head as a nextn block after the decoder's, passed over)."""
    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    tokenizer, edits = llm.tokenizer, GGUF_EDITS.get(name, {})
    if name in SENTENCEPIECE:  # as Phi-3 and Gemma 2 come: a SentencePiece vocabulary, read back from the file
        tokenizer = sentencepiece_tokenizer(tmp_path / "hf", SENTENCEPIECE[name])
        edits = edits | {"vocab_size": len(tokenizer)}
    ref_model = save_tiny_model(name, tmp_path / "hf", tokenizer, **edits)
    if name == "phi4_mini":  # as Phi-4-mini ships: a GPT-2 BPE vocabulary, which the Phi-3 converter reads then
        config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = "GPT2Tokenizer"
        (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
    if name.startswith("qwen3_5"):  # as Qwen3.5 ships: with a multi-token-prediction head, which the converter keeps
        add_mtp_head(tmp_path / "hf")
    if name == "qwen3_5_moe":  # transformers gives this model_type Qwen's own pre-tokenizer, which SmolLM2's vocabulary
        # does not hash as llama.cpp knows: the converter reads the tokenizer as the dense model's (the same weights)
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"model_type": "qwen3_5_text"}))
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf")
    factors = load_gguf_config(str(gguf)).rope_parameters.get("freq_factors")
    assert (factors is not None and max(factors) > 1) == (name == "llama3")
    prompt = tokenizer.encode(PROMPT)
    ours = make_llm(model=str(gguf))
    # the tokenizer rebuilt from the file's vocabulary (BPE merges, or SentencePiece pieces and scores) agrees
    text = PROMPT + "Ünïcode ✓ 123"
    assert ours.tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    out = ours.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert_greedy_matches(out.outputs[0].token_ids, hf_greedy(ref_model, prompt))


@pytest.mark.slow
def test_longrope_factors_follow_the_served_context(llm, tmp_path):
    """Phi-4-mini's LongRoPE picks its factor set by the served context, as llama.cpp does by its context size:
    served past the original context (64 here) the long factors, for every position, so a 121-token prompt gives
    transformers' tokens and first logprob (transformers takes the long set once a sequence passes 64, cos and
    sin scaled by LongRoPE's attention factor); served within it (--max-model-len 64) the short ones, so a
    30-token prompt gives transformers' tokens."""
    ref_model = save_tiny_model("phi4_mini", tmp_path, llm.tokenizer)
    words = llm.tokenizer.encode(PROMPT)
    scored = dataclasses.replace(GREEDY, logprobs=0)
    for max_model_len, n in ((None, len(words)), (64, 30)):
        out = make_llm(model=str(tmp_path), max_model_len=max_model_len).generate([words[:n]], scored, use_tqdm=False)
        out = out[0].outputs[0]
        assert_greedy_matches(out.token_ids, hf_greedy(ref_model, words[:n]))
        with torch.inference_mode():
            ref = ref_model(torch.tensor([words[:n]])).logits[0, -1].log_softmax(-1)
        assert abs(out.logprobs[0].logprob - float(ref[out.token_ids[0]])) < 1e-4
    assert len(words) > 64


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        get_model_class(type("Config", (), {"architectures": ["GPT2LMHeadModel"]})())


@pytest.mark.slow
@pytest.mark.parametrize("name, groups", [("mistral", 1), ("gemma3", 6), ("gemma4", 5)])
def test_sliding_window_blocks_are_freed_as_a_request_advances(name, groups, llm, tmp_path):
    """A window of 24, on every layer (Mistral) or on 5 of Gemma 3's 6 layers (a block table per KV cache
    group; Gemma 4: its 4 local layers that keep K/V, its global one with heads of another size, and the two
    layers that read theirs, in no group of their own): prefilled in chunks of 64, then decoding four windows,
    the request holds at most ceil(24 / 16) + 1 blocks of each sliding group per decode step while the full
    group keeps them all, the dashboard's snapshot shows those, and the tokens are transformers'. The same
    prompt again hits the prefix cache (a sliding group only its last blocks) and gives the same tokens."""
    from engine.snapshot import Snapshotter

    ref_model = save_tiny_model(name, tmp_path, llm.tokenizer)
    ours = make_llm(model=str(tmp_path), max_num_batched_tokens=64)
    engine, kv = ours.engine, ours.engine.engine_core.kv
    assert kv.num_groups == groups
    prompt = llm.tokenizer.encode(PROMPT)
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=4 * 24, ignore_eos=True))
    snapshots, decodes, tokens = Snapshotter(engine), 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        req = engine.engine_core.scheduler.requests.get(rid)
        if req is not None and req.num_computed_tokens > len(prompt):  # a decode step was scheduled
            decodes += 1
            for window, table in zip(kv.windows, kv.req_blocks[rid]):
                held = sum(b is not kv.null_block for b in table)
                assert held <= 3 if window else held == len(table) == -(-req.num_computed_tokens // 16)
            [row] = snapshots.take()["requests"]
            assert len(row["blocks"]) == kv.num_held_blocks(rid)
    assert decodes >= 4 * 24 - 2 and kv.pool.num_free_blocks == kv.num_blocks - 1
    assert_greedy_matches(tokens, hf_greedy(ref_model, prompt, 4 * 24))
    hits = kv.prefix_cache_hits
    again = ours.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert kv.prefix_cache_hits - hits == (len(prompt) - 1) // 16 * 16 and again == tokens[:16]


# llama.cpp's tensor names (after blk.N.) -> transformers' (after model.layers.N.), for the quantized ones
HF_OF_GGUF = {
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "ffn_down_exps": "mlp.experts.down_proj",
    "inp_gate": "per_layer_input_gate.weight",  # Gemma 4's per-layer embeddings
    "proj": "per_layer_projection.weight",
    "token_embd": "model.embed_tokens.weight",
    "output": "lm_head.weight",
    "per_layer_token_embd": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj": "model.per_layer_model_projection.weight",
}


def load_dequantized(ref_model, gguf, names: dict | None = None) -> set[str]:
    """Copies every quantized tensor of the GGUF file, dequantized by gguf-py, into the transformers model (the
    reference for a quantized file; `names`: HF_OF_GGUF's entries another architecture names otherwise); returns
    the kinds of tensor that were quantized."""
    hf = HF_OF_GGUF | (names or {})
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    params, quantized = dict(ref_model.named_parameters()), set()
    with torch.no_grad():
        for t in GGUFReader(str(gguf)).tensors:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                continue
            w = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(list(reversed(t.shape.tolist()))).copy())
            if not t.name.startswith("blk."):
                quantized.add(t.name.split(".")[0])
                params[hf[t.name.split(".")[0]]].copy_(w)
                continue
            layer, kind = t.name.split(".")[1:3]
            quantized.add(kind)
            prefix = f"model.layers.{layer}."
            if kind in ("ffn_gate_exps", "ffn_up_exps"):  # transformers stacks them as gate_up_proj [E, 2I, H]
                inter = w.shape[1]
                part = slice(0, inter) if kind == "ffn_gate_exps" else slice(inter, 2 * inter)
                params[prefix + "mlp.experts.gate_up_proj"][:, part].copy_(w)
            else:
                params[prefix + hf[kind]].copy_(w)
    return quantized


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, kinds",
    [
        ("gemma4", {"attn_q", "ffn_down", "inp_gate", "proj", "per_layer_token_embd"}),
        ("gemma4_moe", {"attn_q", "ffn_down", "ffn_gate_up_exps", "ffn_down_exps"}),
    ],
)
def test_quantized_gemma4_gguf_matches_its_dequantized_weights(name, kinds, llm, tmp_path):
    """A Gemma 4 GGUF quantized to Q8_0 by llama.cpp's converter (its per-layer embedding table too; the 26B-A4B
    shape's experts, gate and up in one tensor of blocks), served on its blocks: the tokens of transformers given
    the file's tensors dequantized by gguf-py."""
    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    tokenizer = sentencepiece_tokenizer(tmp_path / "hf", SENTENCEPIECE[name])
    ref_model = save_tiny_model(name, tmp_path / "hf", tokenizer, vocab_size=len(tokenizer))
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf", outtype="q8_0")
    experts = {"ffn_gate_up_exps": "experts.gate_up_proj", "ffn_down_exps": "experts.down_proj"}
    assert kinds <= load_dequantized(ref_model, gguf, experts)
    ours = make_llm(model=str(gguf))
    assert "Q8_0" in ours.engine.engine_core.executor.runner.weight_bytes
    prompt = tokenizer.encode(PROMPT)
    out = ours.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert_greedy_matches(out.outputs[0].token_ids, hf_greedy(ref_model, prompt))


@pytest.mark.slow
def test_quantized_moe_gguf_matches_its_dequantized_weights(llm, tmp_path):
    """A Qwen3-MoE GGUF quantized to Q8_0 by llama.cpp's converter, served on its blocks (every expert of a
    projection one quantized tensor): the tokens of transformers given the file's tensors dequantized by gguf-py."""
    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")

    ref_model = save_tiny_model("qwen3_moe", tmp_path / "hf", llm.tokenizer, **GGUF_EDITS["qwen3_moe"])
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf", outtype="q8_0")
    quantized = load_dequantized(ref_model, gguf)
    assert {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q"} <= quantized
    prompt = llm.tokenizer.encode(PROMPT)
    ours = make_llm(model=str(gguf))
    assert "Q8_0" in ours.engine.engine_core.executor.runner.weight_bytes
    out = ours.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert_greedy_matches(out.outputs[0].token_ids, hf_greedy(ref_model, prompt))


@pytest.mark.slow
def test_gpt_oss_mxfp4_experts(llm, tmp_path):
    """gpt-oss as OpenAI ships it, its experts in MXFP4 blocks (`*_blocks` / `*_scales`, dequantized at load), and
    the GGUF llama.cpp's converter makes of that (MXFP4 tensors, served on their blocks): the tokens of transformers
    on the same weights (the tiny model's experts rounded to MXFP4's values, so both hold them exactly); and gpt-oss's
    attention sinks matter: zeroed, the first token's logprob moves."""
    ref_model = save_tiny_model("gpt_oss", tmp_path / "hf", llm.tokenizer, mxfp4=True, swiglu_limit=7.0)
    save_mxfp4_copy(tmp_path / "hf", tmp_path / "mxfp4")
    prompt = llm.tokenizer.encode(PROMPT)
    ref = hf_greedy(ref_model, prompt)
    scored = dataclasses.replace(GREEDY, logprobs=0)
    first = make_llm(model=str(tmp_path / "mxfp4")).generate([prompt], scored, use_tqdm=False)[0].outputs[0]
    assert_greedy_matches(first.token_ids, ref)
    if llama_cpp.converter() is not None:
        gguf = llama_cpp.convert(tmp_path / "mxfp4", tmp_path / "model.gguf")
        ours = make_llm(model=str(gguf))
        assert "MXFP4" in ours.engine.engine_core.executor.runner.weight_bytes
        assert_greedy_matches(ours.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids, ref)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "mxfp4" / "model.safetensors")
    save_file(
        {n: t.zero_() if n.endswith("sinks") else t for n, t in weights.items()},
        tmp_path / "mxfp4" / "model.safetensors",
    )
    other = make_llm(model=str(tmp_path / "mxfp4")).generate([prompt], scored, use_tqdm=False)[0].outputs[0]
    assert abs(other.logprobs[0].logprob - first.logprobs[0].logprob) > 1e-3


def test_quantized_directory_of_another_method_is_refused(tmp_path):
    """A Hugging Face directory quantized by a method the loader does not read (AWQ here) is a start-up error
    naming it, not a missing-tensor error later; gpt-oss's MXFP4 is let through (dequantized at load)."""
    from transformers import LlamaConfig

    from models.loader import load_config

    config = LlamaConfig(**CONFIGS["llama3"]().to_dict()).to_dict()
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        load_config(str(tmp_path))
    config = CONFIGS["gpt_oss"]().to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_config(str(tmp_path)).model_type == "gpt_oss"


@pytest.mark.slow
def test_qwen3_5_multimodal_checkpoint_serves_its_language_model(llm, tmp_path):
    """Qwen3.5 ships as Qwen3_5ForConditionalGeneration: the language model under `model.language_model.`, the
    config's text_config, a vision tower and a multi-token-prediction head (`mtp.*`) beside it. The server serves
    the language model (the others passed over) with the tokens transformers' whole model gives for text."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=CONFIGS["qwen3_5"]().to_dict(), vision_config=vision)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(0)
    ref_model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in ref_model.model.language_model.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.normal_(p, mean=1.0 if "linear_attn" in name else 0.0, std=0.3)
    ref_model.save_pretrained(tmp_path)
    llm.tokenizer.save_pretrained(tmp_path)
    (weights,) = tmp_path.glob("*.safetensors")
    tensors = load_file(weights)
    assert any(name.startswith("model.visual.") for name in tensors)
    save_file(tensors | {"mtp.fc.weight": torch.randn(64, 128)}, weights, metadata={"format": "pt"})
    prompt = llm.tokenizer.encode(PROMPT)
    out = make_llm(model=str(tmp_path)).generate([prompt], GREEDY, use_tqdm=False)[0]
    assert_greedy_matches(out.outputs[0].token_ids, hf_greedy(ref_model, prompt))


@pytest.mark.slow
def test_gemma4_multimodal_checkpoint_serves_its_language_model(llm, tmp_path):
    """Gemma 4 ships as Gemma4ForConditionalGeneration: the language model under `model.language_model.`, the
    config's text_config, a vision tower and its projection beside it. The server serves the language model (the
    others passed over) with the tokens transformers' whole model gives for text."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
    config = Gemma4Config(text_config=CONFIGS["gemma4"]().to_dict(), vision_config=vision, audio_config=None)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    ref_model = Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in ref_model.model.language_model.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.normal_(p, mean=1.0, std=0.3)
    ref_model.save_pretrained(tmp_path)
    llm.tokenizer.save_pretrained(tmp_path)
    prompt = llm.tokenizer.encode(PROMPT)
    out = make_llm(model=str(tmp_path)).generate([prompt], GREEDY, use_tqdm=False)[0]
    assert_greedy_matches(out.outputs[0].token_ids, hf_greedy(ref_model, prompt))
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["attention_bias"] = True  # a field that would change the output, not built: refused
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Gemma 4 with attention_bias true is not supported"):
        make_llm(model=str(tmp_path))


@pytest.mark.slow
def test_quantized_qwen3_5_gguf_matches_its_dequantized_weights(llm, tmp_path):
    """A Qwen3.5 GGUF quantized to Q8_0 by llama.cpp's converter, served on its blocks (q_proj's query and gate rows
    picked from the quantized tensor, the DeltaNet's fused q | k | v split by byte ranges): the tokens of the same
    file dequantized at load."""
    if llama_cpp.converter() is None:
        pytest.skip("llama.cpp's converter is fetched by `make install` (python scripts/llama_cpp.py fetch)")
    save_tiny_model("qwen3_5", tmp_path / "hf", llm.tokenizer)
    gguf = llama_cpp.convert(tmp_path / "hf", tmp_path / "model.gguf", "q8_0", "--no-mtp")
    prompt = llm.tokenizer.encode(PROMPT)
    blocks = make_llm(model=str(gguf))
    assert "Q8_0" in blocks.engine.engine_core.executor.runner.weight_bytes
    ours = blocks.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    dequantized = make_llm(model=str(gguf), quantization="none").generate([prompt], GREEDY, use_tqdm=False)
    assert ours == dequantized[0].outputs[0].token_ids


def test_qwen3_5_attention_without_its_gate_is_refused(llm, tmp_path):
    """A Qwen3.5 config whose attention has no output gate (attn_output_gate false) is a start-up error naming the
    field: this file builds the gated attention only."""
    save_tiny_model("qwen3_5", tmp_path, llm.tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"attn_output_gate": False}))
    with pytest.raises(ValueError, match="attn_output_gate false is not supported"):
        make_llm(model=str(tmp_path))


def test_recurrent_states_come_out_of_the_kv_cache_budget(llm, tmp_path):
    """The DeltaNet states of max_num_seqs requests (float32, every linear-attention layer) are allocated from
    --kv-cache-memory before the KV blocks. They take at most half of it: more requests than half holds cap
    max_num_seqs (the scheduler's limit and the state slots), and a budget that cannot hold one request's is a
    start-up error naming the flag."""
    save_tiny_model("qwen3_5", tmp_path, llm.tokenizer)
    per_request = 4 * 3 * (3 * (2 * 2 * 16 + 4 * 16) + 4 * 16 * 16)  # 3 layers: (L - 1) x channels, heads x dk x dv
    ours = make_llm(model=str(tmp_path), kv_cache_memory=4 << 20, max_num_seqs=8)
    runner = ours.engine.engine_core.executor.runner
    assert runner.state_bytes == 8 * per_request == runner.state_cache.numel() * 4
    assert runner.num_blocks == ((4 << 20) - runner.state_bytes) // runner.block_bytes
    capped = make_llm(model=str(tmp_path), kv_cache_memory=4 << 20, max_num_seqs=1024).engine.engine_core
    assert capped.executor.runner.max_num_seqs == (2 << 20) // per_request == capped.scheduler.max_num_seqs
    assert capped.kv.state_pool.num_free_blocks == (2 << 20) // per_request
    with pytest.raises(ValueError, match="states .* exceed half the KV cache budget.*--kv-cache-memory"):
        make_llm(model=str(tmp_path), kv_cache_memory=per_request, max_num_seqs=8)


@pytest.mark.slow
@pytest.mark.parametrize("name, budget, blocks", [("lfm2", 32, 14), ("qwen3_5", 80, 10)])
def test_recurrent_states_across_chunks_batches_and_preemption(name, budget, blocks, llm, tmp_path):
    """LFM2's conv layers and Qwen3.5's Gated DeltaNet layers keep a state slot per running request beside the
    paged KV cache: prompts of 1 to 131 tokens run together in chunks of `budget` tokens (a state carried from
    chunk to chunk; the DeltaNet's 80-token chunks span two of its 64-token blocks; decodes batched), with a KV
    cache too small for all of them at once (requests preempted, their state computed again from the first
    token); every request gives transformers' tokens, and no state slot or block is left held. Prefix caching is
    off for such a model; speculative decoding is refused."""
    ref_model = save_tiny_model(name, tmp_path, llm.tokenizer)
    full = llm.tokenizer.encode(PROMPT + "Pack my box with five dozen liquor jugs. " * 2)
    prompts = [full[:n] for n in (1, 5, 40, 131, 77)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = make_llm(model=str(tmp_path), max_num_batched_tokens=budget, max_num_seqs=4, num_gpu_blocks_override=blocks)
    kv = ours.engine.engine_core.kv
    assert kv.num_groups == 2 and kv.state_group == 1 and not kv.pool.enable_caching
    outs = ours.generate(prompts, params, use_tqdm=False)
    assert ours.engine.engine_core.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches(out.outputs[0].token_ids, hf_greedy(ref_model, prompt, 24))
    assert kv.state_pool.num_free_blocks == 4 and kv.pool.num_free_blocks == kv.num_blocks and not kv.req_blocks
    with pytest.raises(ValueError, match="speculative_config is not supported for a model with recurrent layers"):
        make_llm(model=str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 2})


@pytest.mark.slow
def test_gemma4_shared_kv_across_chunks_batches_preemption_and_drafts(llm, tmp_path):
    """Gemma 4's last two layers attend to the K/V the earlier layers of their kind wrote (no cache of their own)
    and its global layers keep heads twice as wide as the local ones (each KV cache tensor sized for the wider):
    prompts of 1 to 131 tokens run together in 32-token chunks with a KV cache too small for all of them (requests
    preempted and recomputed), again with their prefixes cached, and with n-gram drafts; every request gives
    transformers' tokens, and no block is left held."""
    ref_model = save_tiny_model("gemma4", tmp_path, llm.tokenizer)
    full = llm.tokenizer.encode(PROMPT + "Pack my box with five dozen liquor jugs. " * 2)
    prompts = [full[:n] for n in (1, 5, 40, 131, 77)]
    refs = [hf_greedy(ref_model, p, 24) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = make_llm(model=str(tmp_path), max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=40)
    runner, kv = ours.engine.engine_core.executor.runner, ours.engine.engine_core.kv
    assert runner.kv_cache_slots == [0, 0, 0, 0, 0, 0, 0]  # one layer a group; layers 5 and 6 in 3's and 4's
    assert [len(g.layer_indices) for g in runner.kv_cache_groups] == [1, 1, 1, 1, 1]
    assert runner.kv_caches[4][0].shape[-3:] != runner.kv_caches[0][0].shape[-3:]
    assert runner.kv_caches[6][0].data_ptr() == runner.kv_caches[4][0].data_ptr()
    for round in range(2):  # the second round's prompts hit the prefix cache
        hits = kv.prefix_cache_hits
        outs = ours.generate(prompts, params, use_tqdm=False)
        for out, ref in zip(outs, refs):
            assert_greedy_matches(out.outputs[0].token_ids, ref)
        assert kv.pool.num_free_blocks == kv.num_blocks - 1 and not kv.req_blocks
    assert ours.engine.engine_core.scheduler.num_preemptions > 0 and kv.prefix_cache_hits > hits
    drafted = make_llm(model=str(tmp_path), speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    for out, ref in zip(drafted.generate(prompts, params, use_tqdm=False), refs):
        assert_greedy_matches(out.outputs[0].token_ids, ref)
