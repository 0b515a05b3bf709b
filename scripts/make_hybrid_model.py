"""Random weights of a Qwen3.5-2B-shaped hybrid model for benchmarks: a Hugging Face directory (bfloat16) and the
GGUF llama.cpp's converter and llama-quantize make of it (Q4_K_M by default, as the files people download): the
work per token is the real model's, the text is nonsense (use ignore_eos).

Shape (Qwen/Qwen3.5-2B's text config as published): hidden 2048, 24 layers of which every fourth is gated
attention (8 query / 2 KV heads of 256, rotary on a quarter of each head) and the others Gated DeltaNet (16 key and
16 value heads of 128, a 4-tap convolution), SwiGLU MLPs of 6144, a 248,320-row embedding tied to the LM head
(SmolLM2's tokenizer; the converter pads the vocabulary), no MTP head. Weights normal(0, 0.02), A_log log(U(1, 16)),
dt_bias 1, norms at their identity; a fixed seed.

    python scripts/make_hybrid_model.py --llama-quantize "$(scripts/build_llama_server.sh)/llama-quantize"
    python scripts/bench_peers.py --latency --model ~/.cache/minivllm/models/qwen3.5-2b-random/model-Q4_K_M.gguf \\
        --llama-bench "$(scripts/build_llama_server.sh)/llama-bench"
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from models.cache_dir import CACHE_DIR  # noqa: E402
from scripts import llama_cpp  # noqa: E402
from scripts.make_moe_model import write_checkpoint  # noqa: E402

QWEN35_2B = dict(
    hidden=2048, layers=24, heads=8, kv_heads=2, head_dim=256, inter=6144, lin_heads=16, lin_dim=128, vocab=248320
)


def config() -> dict:
    """Qwen/Qwen3.5-2B's text config (Qwen3_5ForCausalLM, no MTP head)."""
    s = QWEN35_2B
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "hidden_size": s["hidden"],
        "intermediate_size": s["inter"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "linear_num_key_heads": s["lin_heads"],
        "linear_num_value_heads": s["lin_heads"],
        "linear_key_head_dim": s["lin_dim"],
        "linear_value_head_dim": s["lin_dim"],
        "linear_conv_kernel_dim": 4,
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(s["layers"])],
        "full_attention_interval": 4,
        "vocab_size": s["vocab"],
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (bfloat16; A_log and dt_bias float32), by Hugging Face name."""
    g = torch.Generator().manual_seed(seed)
    s = QWEN35_2B
    h, d, heads, kv, n, dk = s["hidden"], s["head_dim"], s["heads"], s["kv_heads"], s["lin_heads"], s["lin_dim"]

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def zeros(n):
        return torch.zeros(n, dtype=torch.bfloat16)

    out = {"model.embed_tokens.weight": normal(s["vocab"], h), "model.norm.weight": zeros(h)}
    for i, kind in enumerate(config()["layer_types"]):
        p = f"model.layers.{i}."
        if kind == "full_attention":
            out[p + "self_attn.q_proj.weight"] = normal(2 * heads * d, h)
            out[p + "self_attn.k_proj.weight"] = normal(kv * d, h)
            out[p + "self_attn.v_proj.weight"] = normal(kv * d, h)
            out[p + "self_attn.o_proj.weight"] = normal(h, heads * d)
            out[p + "self_attn.q_norm.weight"], out[p + "self_attn.k_norm.weight"] = zeros(d), zeros(d)
        else:
            q = p + "linear_attn."
            out[q + "in_proj_qkv.weight"] = normal(3 * n * dk, h)
            out[q + "in_proj_z.weight"] = normal(n * dk, h)
            out[q + "in_proj_b.weight"], out[q + "in_proj_a.weight"] = normal(n, h), normal(n, h)
            out[q + "conv1d.weight"] = normal(3 * n * dk, 1, 4) * 10
            out[q + "A_log"] = torch.empty(n).uniform_(1, 16, generator=g).log()
            out[q + "dt_bias"] = torch.ones(n)
            out[q + "norm.weight"] = torch.ones(dk, dtype=torch.bfloat16)
            out[q + "out_proj.weight"] = normal(h, n * dk)
        out[p + "mlp.gate_proj.weight"] = normal(s["inter"], h)
        out[p + "mlp.up_proj.weight"] = normal(s["inter"], h)
        out[p + "mlp.down_proj.weight"] = normal(h, s["inter"])
        out[p + "input_layernorm.weight"], out[p + "post_attention_layernorm.weight"] = zeros(h), zeros(h)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=CACHE_DIR / "models" / "qwen3.5-2b-random")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type for the GGUF")
    ap.add_argument("--llama-quantize", required=True, help="llama.cpp's llama-quantize binary")
    args = ap.parse_args()
    hf, gguf = args.out / "hf", args.out / f"model-{args.type}.gguf"
    if not (hf / "model.safetensors.index.json").exists() and not (hf / "model.safetensors").exists():
        write_checkpoint(hf, config(), [tensors()])
        print(f"wrote {hf}")
    if not gguf.exists():
        llama_cpp.quantize(hf, gguf, args.llama_quantize, args.type, "--no-mtp")  # the checkpoint has no MTP head
        print(f"wrote {gguf}")


if __name__ == "__main__":
    main()
