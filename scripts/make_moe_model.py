"""Random weights of mixture-of-experts models of a real shape for benchmarks, as their makers ship them (Hugging
Face directories) and as the GGUF llama.cpp's converter (and llama-quantize) make of them: the work per token is the
real model's per layer, the text is nonsense (use ignore_eos). SmolLM2's tokenizer; the converter pads the
vocabulary. Other weights normal(0, 0.02), norms 1; a fixed seed. The directory is written a layer per safetensors
shard, so no more than one layer is ever held in memory.

--shape gpt-oss-20b (openai/gpt-oss-20b's config): hidden 2880, 64 query / 8 KV heads of 64 with attention sinks and
biases, 32 experts of 2880 (4 per token) with biases, sliding windows of 128 on every other layer, YaRN (factor 32
over 4096), a 201,088-row embedding and LM head. Experts are MXFP4 `*_blocks` / `*_scales` tensors, as OpenAI ships
them (random codes, block scales 2^-10 .. 2^-6; biases normal(0, 0.02), sinks normal(0, 1)); the GGUF keeps MXFP4 and
makes the other matrices Q8_0 (`model.gguf`).

--shape qwen3-30b-a3b (Qwen/Qwen3-30B-A3B's config): hidden 2048, 32 query / 4 KV heads of 128 with q/k norms, 128
experts of 768 (8 per token, renormalised), a 151,936-row embedding and LM head; bfloat16, the GGUF made by
llama-quantize from the converter's float16 file (`model-Q4_K_M.gguf` by default, as the files people download).

--layers of the model's 24 or 48 (8 by default, so that the files and our engine's copy fit beside each other in
24 GiB): ms per token scales with the layers for every engine, so ratios hold.

    python scripts/make_moe_model.py                    # ~/.cache/minivllm/models/gpt-oss-20b-8l-random/{hf,model.gguf}
    python scripts/make_moe_model.py --shape qwen3-30b-a3b \\
        --llama-quantize "$(scripts/build_llama_server.sh)/llama-quantize"   # .../qwen3-30b-a3b-8l-random/
    python scripts/bench_peers.py --latency --model ~/.cache/minivllm/models/gpt-oss-20b-8l-random/model.gguf \\
        --llama-bench "$(scripts/build_llama_server.sh)/llama-bench"
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from models.cache_dir import CACHE_DIR  # noqa: E402
from models.loader import default_model_path, load_tokenizer  # noqa: E402
from scripts import llama_cpp  # noqa: E402

GPT_OSS_20B = dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, top_k=4, inter=2880, vocab=201088)
QWEN3_30B_A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, inter=768, vocab=151936)


def gpt_oss_config(layers: int) -> dict:
    """openai/gpt-oss-20b's config.json with `layers` layers."""
    s = GPT_OSS_20B
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "num_hidden_layers": layers,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "num_local_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "experts_per_token": s["top_k"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": 131072,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []},
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def gpt_oss_tensors(layers: int, seed: int = 0):
    """The checkpoint's tensors (bfloat16, experts as MXFP4 blocks and scales) by Hugging Face name: the embedding,
    LM head and final norm, then one dict per layer."""
    g = torch.Generator().manual_seed(seed)
    s = GPT_OSS_20B
    h, d, e, inter = s["hidden"], s["head_dim"], s["experts"], s["inter"]

    def normal(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def mxfp4(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        return blocks, torch.randint(117, 122, (e, rows, cols // 32), generator=g, dtype=torch.uint8)

    yield {
        "model.embed_tokens.weight": normal(s["vocab"], h),
        "lm_head.weight": normal(s["vocab"], h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for i in range(layers):
        p, out = f"model.layers.{i}.", {}
        for name, rows in (("q_proj", s["heads"] * d), ("k_proj", s["kv_heads"] * d), ("v_proj", s["kv_heads"] * d)):
            out[p + f"self_attn.{name}.weight"], out[p + f"self_attn.{name}.bias"] = normal(rows, h), normal(rows)
        out[p + "self_attn.o_proj.weight"], out[p + "self_attn.o_proj.bias"] = normal(h, s["heads"] * d), normal(h)
        out[p + "self_attn.sinks"] = normal(s["heads"], std=1.0)
        out[p + "mlp.router.weight"], out[p + "mlp.router.bias"] = normal(e, h), normal(e)
        blocks, scales = mxfp4(2 * inter, h)
        out[p + "mlp.experts.gate_up_proj_blocks"], out[p + "mlp.experts.gate_up_proj_scales"] = blocks, scales
        out[p + "mlp.experts.gate_up_proj_bias"] = normal(e, 2 * inter)
        blocks, scales = mxfp4(h, inter)
        out[p + "mlp.experts.down_proj_blocks"], out[p + "mlp.experts.down_proj_scales"] = blocks, scales
        out[p + "mlp.experts.down_proj_bias"] = normal(e, h)
        out[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        yield out


def qwen3_moe_config(layers: int) -> dict:
    """Qwen/Qwen3-30B-A3B's config.json with `layers` layers."""
    s = QWEN3_30B_A3B
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": s["hidden"],
        "intermediate_size": 6144,
        "moe_intermediate_size": s["inter"],
        "num_hidden_layers": layers,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "num_experts": s["experts"],
        "num_experts_per_tok": s["top_k"],
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": s["vocab"],
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def qwen3_moe_tensors(layers: int, seed: int = 0):
    """The checkpoint's tensors (bfloat16, one tensor per expert and projection as Qwen ships them) by Hugging Face
    name: the embedding, LM head and final norm, then one dict per layer."""
    g = torch.Generator().manual_seed(seed)
    s = QWEN3_30B_A3B
    h, d, inter = s["hidden"], s["head_dim"], s["inter"]

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    yield {"model.embed_tokens.weight": normal(s["vocab"], h), "lm_head.weight": normal(s["vocab"], h),
           "model.norm.weight": ones(h)}  # fmt: skip
    for i in range(layers):
        p, out = f"model.layers.{i}.", {}
        for name, rows in (("q_proj", s["heads"] * d), ("k_proj", s["kv_heads"] * d), ("v_proj", s["kv_heads"] * d)):
            out[p + f"self_attn.{name}.weight"] = normal(rows, h)
        out[p + "self_attn.o_proj.weight"] = normal(h, s["heads"] * d)
        out[p + "self_attn.q_norm.weight"], out[p + "self_attn.k_norm.weight"] = ones(d), ones(d)
        out[p + "mlp.gate.weight"] = normal(s["experts"], h)
        for j in range(s["experts"]):
            q = p + f"mlp.experts.{j}."
            out[q + "gate_proj.weight"], out[q + "up_proj.weight"] = normal(inter, h), normal(inter, h)
            out[q + "down_proj.weight"] = normal(h, inter)
        out[p + "input_layernorm.weight"], out[p + "post_attention_layernorm.weight"] = ones(h), ones(h)
        yield out


SHAPES = {"gpt-oss-20b": (gpt_oss_config, gpt_oss_tensors), "qwen3-30b-a3b": (qwen3_moe_config, qwen3_moe_tensors)}


def write_checkpoint(hf: Path, config: dict, shards, tokenizer: bool = True) -> None:
    """A Hugging Face directory: SmolLM2's tokenizer (unless `tokenizer` is False: the caller writes its own),
    `config`, and each dict of `shards` as one safetensors file under model.safetensors.index.json (written last: its
    presence means the directory is whole)."""
    from safetensors.torch import save_file

    hf.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        load_tokenizer(default_model_path()).save_pretrained(hf)
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    weight_map = {}
    for n, shard in enumerate(shards):
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(hf / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=SHAPES, default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=8, help="of the model's (gpt-oss-20b 24, Qwen3-30B-A3B 48)")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type for a bfloat16 shape's GGUF")
    ap.add_argument("--llama-quantize", help="llama.cpp's llama-quantize binary (needed for qwen3-30b-a3b)")
    ap.add_argument("--out", type=Path, help="default: ~/.cache/minivllm/models/<shape>-<layers>l-random")
    args = ap.parse_args()
    out = args.out or CACHE_DIR / "models" / f"{args.shape}-{args.layers}l-random"
    config, tensors = SHAPES[args.shape]
    hf = out / "hf"
    if not (hf / "model.safetensors.index.json").exists() and not (hf / "model.safetensors").exists():
        write_checkpoint(hf, config(args.layers), tensors(args.layers))
        print(f"wrote {hf}")
    if args.shape == "gpt-oss-20b":  # MXFP4 experts as shipped, the rest Q8_0
        gguf = out / "model.gguf"
        if not gguf.exists():
            llama_cpp.convert(hf, gguf, outtype="q8_0")
    else:
        if not args.llama_quantize:
            ap.error(f"--shape {args.shape} needs --llama-quantize")
        gguf = out / f"model-{args.type}.gguf"
        if not gguf.exists():
            llama_cpp.quantize(hf, gguf, args.llama_quantize, args.type)
    print(f"wrote {gguf}")


if __name__ == "__main__":
    main()
