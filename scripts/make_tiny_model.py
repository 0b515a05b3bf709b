"""Writes a tiny random Llama-family model as a Hugging Face directory (config, safetensors, and the
default model's tokenizer), for trying code paths the default model cannot take on this machine:
SmolLM2-135M's 9 query heads split over 3 ranks but not 2, while these models have 4 query heads and
2 KV heads (or as many as --num-key-value-heads says). The tests build their tiny models here too.

Usage:
  python scripts/make_tiny_model.py /tmp/tiny-llama3                      # Llama 3 (llama3 RoPE scaling)
  python scripts/make_tiny_model.py /tmp/tiny-qwen2 --arch qwen2 --num-key-value-heads 1
  python server.py --model /tmp/tiny-llama3 --tensor-parallel-size 2      # random weights: gibberish
"""

import argparse
import os
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GptOssConfig,
    GraniteConfig,
    Lfm2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

COMMON = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    # weights 5x transformers' default spread, so that attention (and with it positions, windows and
    # multipliers) changes the greedy tokens of a random model rather than the embeddings alone
    initializer_range=0.1,
)
# what the tiny Gemma 4 models share: global layers' heads twice as wide, values their keys, final logits capped
GEMMA4 = dict(head_dim=16, global_head_dim=32, attention_k_eq_v=True, sliding_window=24, final_logit_softcapping=3.0)
CONFIGS = {
    "llama3": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: Qwen2Config(**COMMON),
    # a window shorter than the tests' prompts, so that it changes the output
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=24),
    # sliding layers past max_window_layers, full ones before: two attention kinds in one model
    "qwen2_sliding": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=24, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32),  # head_dim is not hidden_size / heads there
    # fused qkv_proj and gate_up_proj in the checkpoint, a sliding window
    "phi3": lambda: Phi3Config(**COMMON, sliding_window=24, pad_token_id=0),
    # Phi-4-mini's shape of Phi-3: rotary on 3/4 of each head, LongRoPE (short factors up to the original context of
    # 64, long ones past it, cos and sin scaled by sqrt(1 + ln 16 / ln 64)), the LM head tied, no window
    "phi4_mini": lambda: Phi3Config(
        **COMMON | dict(tie_word_embeddings=True),
        pad_token_id=0,
        sliding_window=None,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0],
        },
    ),
    # no rotary on every fourth layer (the default; llama.cpp assumes it)
    "smollm3": lambda: SmolLM3Config(**COMMON | dict(num_hidden_layers=4)),
    # alternating sliding / global layers, soft caps that bind, query_pre_attn_scalar apart from head_dim
    "gemma2": lambda: Gemma2Config(
        **COMMON | dict(num_hidden_layers=4),
        head_dim=16,
        sliding_window=24,
        query_pre_attn_scalar=64,
        attn_logit_softcapping=0.3,
        final_logit_softcapping=3.0,
    ),
    # 5 local : 1 global layers (the default; llama.cpp assumes it), a local rope base of its own, linear rope
    # scaling on the global layers
    "gemma3": lambda: Gemma3TextConfig(
        **COMMON | dict(num_hidden_layers=6),
        head_dim=16,
        sliding_window=24,
        query_pre_attn_scalar=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    # Gemma 4 (an E2B-like text model): 4 local : 1 global layers, the global ones with heads twice as wide (their
    # K/V blocks too) and 2 KV heads of their own whose values are their keys, a quarter of their pairs rotating
    # (proportional rope); per-layer embeddings; the last 2 layers reading the K/V of the last earlier local and
    # global ones, with MLPs twice as wide; final logits soft-capped
    "gemma4": lambda: Gemma4TextConfig(
        **COMMON | GEMMA4 | dict(num_hidden_layers=7),
        num_global_key_value_heads=2,
        layer_types=["sliding_attention"] * 4 + ["full_attention", "sliding_attention", "full_attention"],
        vocab_size_per_layer_input=49152,
        hidden_size_per_layer_input=32,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    ),
    # Gemma 4 26B-A4B-like: 4 GeGLU experts of 32 (2 per token) beside each layer's dense MLP, one KV head in the
    # global layers, no per-layer embeddings or shared K/V
    "gemma4_moe": lambda: Gemma4TextConfig(
        **COMMON | GEMMA4 | dict(num_hidden_layers=6),
        num_global_key_value_heads=1,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    # 8 experts, 2 per token, renormalised; the second layer dense (mlp_only_layers), as Qwen3-MoE configs allow
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # Qwen2-MoE: q/k/v biases, 8 experts (top-2, not renormalised: its default) and a gated shared expert
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    ),
    # 4 experts of 32, 2 per token, in every layer
    "mixtral": lambda: MixtralConfig(**COMMON | dict(intermediate_size=32), num_local_experts=4, num_experts_per_tok=2),
    # gpt-oss: 4 experts of 32 (top 2) with biases and a SwiGLU clamp that binds, attention sinks, alternating
    # sliding / full layers, YaRN positions past an original context of 64
    "gpt_oss": lambda: GptOssConfig(
        **COMMON | dict(intermediate_size=32),
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=24,
        swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 16.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    # LFM2: short convolutions (a state per request) around two attention layers, the MLP width auto-adjusted
    "lfm2": lambda: Lfm2Config(
        **COMMON | dict(num_hidden_layers=6),
        layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"],
        block_multiple_of=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3_5": lambda: Qwen3_5TextConfig(  # DeltaNet layers around a gated attention layer, 2 value heads per key head
        **COMMON | dict(num_hidden_layers=4, head_dim=32),
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(  # as qwen3_5, 4 experts (2 per token) and a shared one per layer
        **COMMON | dict(num_hidden_layers=4, head_dim=32),
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "granite": lambda: GraniteConfig(  # multipliers far from 1, so that each one changes the output
        **COMMON, embedding_multiplier=12.0, attention_multiplier=1.0, residual_multiplier=0.5, logits_scaling=6.0
    ),
}


def save_tiny_model(arch: str, path, tokenizer, mxfp4: bool = False, **overrides):
    """Saves a random tiny `arch` model (CONFIGS, with `overrides` of config fields; seed 0) with
    `tokenizer` (a transformers tokenizer) at `path`; returns the transformers model (float32, eval mode).
    `mxfp4` (gpt_oss): expert weights rounded to MXFP4's values, so that save_mxfp4_copy loses nothing."""
    torch.manual_seed(0)
    config = CONFIGS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if arch.startswith("qwen2"):  # random init leaves biases at zero; make them matter (q/k/v biases: Qwen2, its MoE)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
            torch.nn.init.normal_(layer.self_attn.k_proj.bias, std=0.5)
    if arch == "qwen3":  # the q/k norms start at ones; make them matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_norm.weight, mean=1.0, std=0.5)
            torch.nn.init.normal_(layer.self_attn.k_norm.weight, mean=1.0, std=0.5)
    if arch.startswith("qwen3_5"):  # its norms start at zero (scale 1 + w) or one (the DeltaNet's); make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                with torch.no_grad():
                    torch.nn.init.normal_(p, mean=1.0 if "linear_attn" in name else 0.0, std=0.3)
    if arch.startswith("gemma4"):  # norms (scale w), router scales and layer scalars start at one; make them matter
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "router.scale", "per_expert_scale")):
                with torch.no_grad():
                    torch.nn.init.normal_(p, mean=1.0, std=0.3)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    if arch == "gpt_oss":  # sinks large enough to take much of each softmax; biases and norms that matter
        for name, p in model.named_parameters():
            with torch.no_grad():
                if name.endswith("sinks"):
                    torch.nn.init.normal_(p, mean=2.0, std=1.0)
                elif name.endswith("bias"):
                    torch.nn.init.normal_(p, std=0.5)
                elif name.endswith("norm.weight"):
                    torch.nn.init.normal_(p, mean=1.0, std=0.3)
        if mxfp4:  # expert weights the 4-bit format holds exactly: the same model as the MXFP4 copy
            from models.layers.fused_moe import dequantize_mxfp4

            for layer in model.model.layers:
                for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    blocks, scales = mxfp4_quantize(w.data.transpose(-1, -2))
                    w.data.copy_(dequantize_mxfp4(blocks, scales).transpose(-1, -2))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def add_mtp_head(path) -> None:
    """Adds to the qwen3_5 model at `path` a multi-token-prediction head under the names Qwen3.5's checkpoints give
    it (`mtp.*`: one full-attention layer, a copy of layer 2, and its fc and norms), which llama.cpp's converter
    writes as nextn blocks after the decoder's. transformers does not run it; neither does this server."""
    from safetensors.torch import load_file, save_file

    (weights,) = Path(path).glob("*.safetensors")
    tensors = load_file(weights)
    hidden = tensors["model.norm.weight"].shape[0]
    head = {k.replace("model.layers.2.", "mtp.layers.0."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    head |= {"mtp.fc.weight": torch.randn(hidden, 2 * hidden) * 0.1}
    head |= {f"mtp.{n}.weight": torch.zeros(hidden) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    save_file(tensors | head, weights, metadata={"format": "pt"})


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., rows, K / 32, 16], scales uint8 [..., rows, K / 32]) of float weights [..., rows, K] in
    OpenAI's MXFP4 checkpoint layout (two E2M1 codes a byte, the even element low; a power-of-two scale per 32
    values), rounded as gguf-py's MXFP4.quantize_blocks rounds: the scale 2^(floor(log2 max|w|) - 2), each value to
    the nearest representable one."""
    from models.layers.fused_moe import FP4_VALUES

    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).clamp(0, 254)
    values = torch.tensor(FP4_VALUES)
    codes = ((groups / torch.exp2(e - 127)[..., None])[..., None] - values).abs().argmin(-1).to(torch.uint8)
    return (codes[..., 0::2] | codes[..., 1::2] << 4), e.to(torch.uint8)


def save_mxfp4_copy(src, dst) -> None:
    """Writes the gpt_oss model at `src` (saved with mxfp4=True) again at `dst` as OpenAI ships gpt-oss: the
    experts' gate_up_proj and down_proj as MXFP4 `*_blocks` and `*_scales` tensors, quantization_config mxfp4.
    llama.cpp's converter keeps those blocks as its MXFP4 type."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_quantize(tensors.pop(name).transpose(-1, -2))
        tensors[name + "_blocks"] = blocks.reshape(*scales.shape, 16).contiguous()
        tensors[name + "_scales"] = scales.contiguous()
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(os.path.join(dst, "config.json")).read())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def sentencepiece_tokenizer(path, tokenizer_class: str = "LlamaTokenizer", vocab_size: int = 1024):
    """A SentencePiece BPE tokenizer with byte fallback (the kind Llama 2, Phi-3 and Gemma ship), trained on the
    prompts of scripts/data/workload.jsonl, written at `path` as those checkpoints come: `tokenizer.model` and
    transformers' files for `tokenizer_class` ("LlamaTokenizer", "GemmaTokenizer"). Ids: 0 pad, 1 eos, 2 bos,
    3 unk; Gemma's turn markers are single pieces. Returns the transformers tokenizer (protobuf reads the
    model). llama.cpp's converter takes Phi-3's and Gemma 2's vocabularies from `tokenizer.model` only."""
    import json
    import tempfile

    import sentencepiece as spm
    from transformers import AutoTokenizer

    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "workload.jsonl")
    os.makedirs(path, exist_ok=True)
    with open(data) as f, tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w") as out:
            for line in f:
                out.write(json.loads(line)["prompt"] + "\n")
        spm.SentencePieceTrainer.train(
            input=corpus,
            model_prefix=os.path.join(tmp, "spm"),
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=1.0,
            pad_id=0,
            eos_id=1,
            bos_id=2,
            unk_id=3,
            user_defined_symbols=["<start_of_turn>", "<end_of_turn>"],
            num_threads=1,
            minloglevel=2,
        )
        with (
            open(os.path.join(tmp, "spm.model"), "rb") as src,
            open(os.path.join(path, "tokenizer.model"), "wb") as dst,
        ):
            dst.write(src.read())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": tokenizer_class}, f)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", help="directory to write")
    ap.add_argument("--arch", default="llama3", choices=sorted(CONFIGS))
    ap.add_argument("--num-key-value-heads", type=int, default=COMMON["num_key_value_heads"])
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
    from models.loader import load_tokenizer, resolve_model

    save_tiny_model(
        args.arch, args.path, load_tokenizer(resolve_model(None)), num_key_value_heads=args.num_key_value_heads
    )
    print(f"wrote {args.path}")


if __name__ == "__main__":
    main()
