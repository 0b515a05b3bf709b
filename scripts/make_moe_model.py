"""Random weights of a gpt-oss-20b-shaped model for benchmarks, as OpenAI ships gpt-oss (a Hugging Face directory
whose experts are MXFP4 `*_blocks` / `*_scales` tensors) and as the GGUF llama.cpp's converter makes of it (MXFP4
experts kept, the other matrices Q8_0): the work per token is the real model's per layer, the text is nonsense
(use ignore_eos).

Shape (openai/gpt-oss-20b's config): hidden 2880, 64 query / 8 KV heads of 64 with attention sinks and biases,
32 experts of 2880 (4 per token) with biases, sliding windows of 128 on every other layer, YaRN (factor 32 over
4096), a 201,088-row embedding and LM head (SmolLM2's tokenizer; the converter pads the vocabulary). --layers of
its 24 (8 by default, so that the file and our engine's copy of it fit beside each other in 24 GiB): ms per token
scales with the layers for every engine, so ratios hold. MXFP4 codes are random bytes with block scales 2^-10 ..
2^-6; other weights normal(0, 0.02), biases normal(0, 0.02), sinks normal(0, 1), norms 1; a fixed seed. The
directory is written tensor by tensor and never held as floats (3.4 GB of experts for 8 layers).

    python scripts/make_moe_model.py                    # ~/.cache/minivllm/models/gpt-oss-20b-8l-random/{hf,model.gguf}
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


def config(layers: int) -> dict:
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


def tensors(layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (bfloat16, experts as MXFP4 blocks and scales), by Hugging Face name."""
    g = torch.Generator().manual_seed(seed)
    s = GPT_OSS_20B
    h, d, e, inter = s["hidden"], s["head_dim"], s["experts"], s["inter"]

    def normal(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def mxfp4(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        return blocks, torch.randint(117, 122, (e, rows, cols // 32), generator=g, dtype=torch.uint8)

    out = {"model.embed_tokens.weight": normal(s["vocab"], h), "lm_head.weight": normal(s["vocab"], h)}
    out["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for i in range(layers):
        p = f"model.layers.{i}."
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
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="of gpt-oss-20b's 24")
    ap.add_argument("--out", type=Path, help="default: ~/.cache/minivllm/models/gpt-oss-20b-<layers>l-random")
    args = ap.parse_args()
    out = args.out or CACHE_DIR / "models" / f"gpt-oss-20b-{args.layers}l-random"
    hf, gguf = out / "hf", out / "model.gguf"
    if not (hf / "model.safetensors").exists():
        from safetensors.torch import save_file

        hf.mkdir(parents=True, exist_ok=True)
        load_tokenizer(default_model_path()).save_pretrained(hf)
        (hf / "config.json").write_text(json.dumps(config(args.layers), indent=2))
        save_file(tensors(args.layers), str(hf / "model.safetensors"), metadata={"format": "pt"})
        print(f"wrote {hf}")
    if not gguf.exists():
        llama_cpp.convert(hf, gguf, outtype="q8_0")
        print(f"wrote {gguf}")


if __name__ == "__main__":
    main()
