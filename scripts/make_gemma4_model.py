"""Writes a random Gemma-4-E2B-shaped model for the benchmarks, as users' files are made: a Hugging Face directory
(bfloat16 safetensors, a layer per shard) converted by llama.cpp's own convert_hf_to_gguf.py and quantized by its
llama-quantize (scripts/build_llama_server.sh builds it).

The shape is Gemma 4 E2B's text model: 35 layers of width 1536, 4 local (window 512, head_dim 256) : 1 global
(head_dim 512, proportional rope) layers, 8 query heads and 1 KV head, the last 20 layers reading the K/V of the
last earlier layer of their kind with MLPs twice as wide (6144, 12288 there), per-layer embeddings of 256 per layer
over the 262,144-token vocabulary, final logits soft-capped at 30. Weights normal(0, 0.02), norms and layer scalars
1, a fixed seed: speed does not depend on values.

The vocabulary: the converter reads Gemma 4's as a byte-fallback BPE `tokenizer.json`; a small one is trained on
scripts/data/workload.jsonl (make_tiny_model.sentencepiece_tokenizer) and padded with unused pieces to the
262,144 entries of the embedding, as Gemma's own vocabulary has hundreds of them.

Usage:
  python scripts/make_gemma4_model.py --llama-quantize $B/llama-quantize    # ~/.cache/minivllm/models/gemma4-e2b-random
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from models.cache_dir import CACHE_DIR  # noqa: E402
from scripts import llama_cpp  # noqa: E402
from scripts.make_tiny_model import sentencepiece_tokenizer  # noqa: E402

LAYERS, HIDDEN, INTER, PLE, VOCAB, SHARED = 35, 1536, 6144, 256, 262144, 20
LAYER_TYPES = ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(LAYERS)]


def config() -> dict:
    """Gemma 4 E2B's text config (Gemma4ForCausalLM)."""
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": False,
        "sliding_window": 512,
        "layer_types": LAYER_TYPES,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": PLE,
        "num_kv_shared_layers": SHARED,
        "use_double_wide_mlp": True,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def tensors(seed: int = 0):
    """The checkpoint's bfloat16 tensors (Hugging Face names), a dict per shard: the embeddings, then a layer each."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):  # drawn 8192 rows at a time: the per-layer table is 2.3 G values
        out = torch.empty(*shape, dtype=torch.bfloat16)
        for start in range(0, shape[0], 8192):
            rows = out[start : start + 8192]
            rows.copy_(torch.randn(rows.shape, generator=gen).mul_(0.02))
        return out

    def ones(*shape):
        return torch.ones(*shape, dtype=torch.bfloat16)

    yield {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN),
        "model.embed_tokens_per_layer.weight": normal(VOCAB, LAYERS * PLE),
        "model.per_layer_model_projection.weight": normal(LAYERS * PLE, HIDDEN),
        "model.per_layer_projection_norm.weight": ones(PLE),
        "model.norm.weight": ones(HIDDEN),
    }
    for i, kind in enumerate(LAYER_TYPES):
        p, head_dim = f"model.layers.{i}.", 512 if kind == "full_attention" else 256
        inter = INTER * (2 if i >= LAYERS - SHARED else 1)
        out = {
            p + "self_attn.q_proj.weight": normal(8 * head_dim, HIDDEN),
            p + "self_attn.q_norm.weight": ones(head_dim),
            p + "self_attn.o_proj.weight": normal(HIDDEN, 8 * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, HIDDEN),
            p + "mlp.up_proj.weight": normal(inter, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, inter),
            p + "per_layer_input_gate.weight": normal(PLE, HIDDEN),
            p + "per_layer_projection.weight": normal(HIDDEN, PLE),
            p + "layer_scalar": ones(1),
        }
        if i < LAYERS - SHARED:  # a layer with K/V of its own
            out |= {
                p + "self_attn.k_proj.weight": normal(head_dim, HIDDEN),
                p + "self_attn.v_proj.weight": normal(head_dim, HIDDEN),
                p + "self_attn.k_norm.weight": ones(head_dim),
            }
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_per_layer_input_norm"):  # fmt: skip
            out[p + norm + ".weight"] = ones(HIDDEN)
        yield out


def write_vocabulary(hf: Path) -> None:
    """A byte-fallback BPE vocabulary of VOCAB entries at `hf` (tokenizer.json and its config): a small trained
    one padded with unused pieces, which no text encodes to."""
    sentencepiece_tokenizer(hf, "GemmaTokenizer")
    (hf / "tokenizer.model").unlink()  # the padded tokenizer.json is the vocabulary
    path = hf / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    # transformers' Gemma tokenizer appended <bos>, <eos> and <mask> after the trained pieces: the trained
    # vocabulary's own <s> and </s> serve, and the ids after it are unused pieces
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < len(vocab)]
    vocab |= {f"<unused{i}>": i for i in range(len(vocab), VOCAB)}
    path.write_text(json.dumps(tok))
    config_path = hf / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text()) | {"bos_token": "<s>", "eos_token": "</s>", "mask_token": "<unk>"}
    config_path.write_text(json.dumps(tok_config))


def main():
    from scripts.make_moe_model import write_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=CACHE_DIR / "models" / "gemma4-e2b-random")
    ap.add_argument("--type", default="Q4_K_M", help="llama-quantize's type for the GGUF")
    ap.add_argument("--llama-quantize", required=True, help="llama.cpp's llama-quantize binary")
    args = ap.parse_args()
    hf, gguf = args.out / "hf", args.out / f"model-{args.type}.gguf"
    if not (hf / "model.safetensors.index.json").exists():
        write_vocabulary(hf)
        write_checkpoint(hf, config(), tensors(), tokenizer=False)
        print(f"wrote {hf}")
    if not gguf.exists():
        llama_cpp.quantize(hf, gguf, args.llama_quantize, args.type)
        print(f"wrote {gguf}")


if __name__ == "__main__":
    main()
