"""Random weights of a Llama-3.2-1B-shaped model, as a bfloat16 Hugging Face directory and as GGUF files
(F16, Q8_0, Q4_0 by gguf-py's quantizers, Q4_K_M by llama.cpp's llama-quantize), for benchmarks at a
realistic size: the work per token is a real 1B model's, the text is nonsense (use ignore_eos).

Shape: 16 layers, hidden 2048, 32 query / 8 KV heads of 64, intermediate 8192, rope_theta 500000, tied
embeddings; SmolLM2's 49,152-token vocabulary and tokenizer (the only Llama-family tokenizer here),
copied from the default model. Weights normal(0, 0.02), norms 1, from a fixed seed. The GGUF files are
what llama.cpp's converter writes for this directory (its metadata, names and q/k row permutation), so
every engine runs the same model.

    python scripts/make_1b_model.py                      # ~/.cache/minivllm/models/llama-1b-random/
    python scripts/make_1b_model.py --layers 2 --out /tmp/tiny --formats hf F16 Q4_K_M
    python scripts/make_1b_model.py --arch gemma3 --formats hf F16 Q4_K_M  # ~/.cache/minivllm/models/gemma3-1b-random/

With --arch gemma3 the shape is Gemma-3-1B's: 26 layers (5 sliding-window layers of 512 tokens : 1 global, local
rope base 10,000, global 1,000,000), hidden 1152, 4 query / 1 KV heads of 256, intermediate 6912 (GeGLU), q/k
norms, a 262,144-row embedding (a SentencePiece tokenizer of 1,027 pieces, scripts/make_tiny_model.py, padded
by llama.cpp's converter as for any vocabulary shorter than the embedding); norms 0 (Gemma's scale is 1 + w).
Its GGUF files are made by llama.cpp's own convert_hf_to_gguf.py (F16) and llama-quantize (Q4_K_M).

Outputs that exist are kept. Q4_K_M needs llama-quantize (scripts/build_llama_server.sh builds it).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from models.cache_dir import CACHE_DIR  # noqa: E402
from models.loader import default_model_path, load_tokenizer  # noqa: E402
from scripts import llama_cpp  # noqa: E402
from scripts.make_tiny_model import sentencepiece_tokenizer  # noqa: E402

SHAPE = dict(
    layers=16,
    hidden=2048,
    heads=32,
    kv_heads=8,
    head_dim=64,
    intermediate=8192,
    vocab=49152,
    rope_theta=500000.0,
    eps=1e-5,
    context=8192,
)
GGUF_TYPES = {"F16": "MOSTLY_F16", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0"}
GEMMA3_1B = dict(
    layers=26, hidden=1152, heads=4, kv_heads=1, head_dim=256, intermediate=6912, vocab=262144, window=512, eps=1e-6
)


def config_fields(shape: dict) -> dict:
    """The transformers config fields of a shape."""
    return dict(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        rms_norm_eps=shape["eps"],
    )


def gemma3_tensors(shape: dict, seed: int):
    """(Hugging Face name, bfloat16 tensor) of every weight of the Gemma 3 text model, one by one."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = shape["hidden"], shape["intermediate"], shape["head_dim"]
    rand = lambda *size: (torch.randn(*size, generator=g) * 0.02).bfloat16()  # noqa: E731
    zeros = lambda n: torch.zeros(n, dtype=torch.bfloat16)  # noqa: E731
    yield "model.embed_tokens.weight", rand(shape["vocab"], h)
    for n in range(shape["layers"]):
        p = f"model.layers.{n}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            yield p + norm + ".weight", zeros(h)
        yield p + "post_feedforward_layernorm.weight", zeros(h)
        yield p + "self_attn.q_proj.weight", rand(shape["heads"] * d, h)
        yield p + "self_attn.k_proj.weight", rand(shape["kv_heads"] * d, h)
        yield p + "self_attn.v_proj.weight", rand(shape["kv_heads"] * d, h)
        yield p + "self_attn.o_proj.weight", rand(h, shape["heads"] * d)
        yield p + "self_attn.q_norm.weight", zeros(d)
        yield p + "self_attn.k_norm.weight", zeros(d)
        yield p + "mlp.gate_proj.weight", rand(i, h)
        yield p + "mlp.up_proj.weight", rand(i, h)
        yield p + "mlp.down_proj.weight", rand(h, i)
    yield "model.norm.weight", zeros(h)


def write_gemma3_hf(out: Path, shape: dict, seed: int) -> None:
    """The Gemma-3-1B-shaped Hugging Face directory (config, a SentencePiece tokenizer, safetensors)."""
    from safetensors.torch import save_file
    from transformers import Gemma3TextConfig

    out.mkdir(parents=True, exist_ok=True)
    Gemma3TextConfig(
        **config_fields(shape),
        sliding_window=shape["window"],
        query_pre_attn_scalar=shape["head_dim"],
        max_position_embeddings=32768,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="bfloat16",
        architectures=["Gemma3ForCausalLM"],
    ).save_pretrained(out)
    sentencepiece_tokenizer(out, "GemmaTokenizer")  # a SentencePiece vocabulary, as Gemma's (padded to 262,144)
    save_file(dict(gemma3_tensors(shape, seed)), out / "model.safetensors", metadata={"format": "pt"})


def hf_tensors(shape: dict, seed: int):
    """(Hugging Face name, bfloat16 tensor) of every weight, drawn one by one (peak memory: one tensor)."""
    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = (
        shape["hidden"],
        shape["intermediate"],
        shape["heads"] * shape["head_dim"],
        shape["kv_heads"] * shape["head_dim"],
    )
    rand = lambda *size: (torch.randn(*size, generator=g) * 0.02).bfloat16()  # noqa: E731
    yield "model.embed_tokens.weight", rand(shape["vocab"], h)
    for n in range(shape["layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield p + "self_attn.q_proj.weight", rand(q, h)
        yield p + "self_attn.k_proj.weight", rand(kv, h)
        yield p + "self_attn.v_proj.weight", rand(kv, h)
        yield p + "self_attn.o_proj.weight", rand(h, q)
        yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield p + "mlp.gate_proj.weight", rand(i, h)
        yield p + "mlp.up_proj.weight", rand(i, h)
        yield p + "mlp.down_proj.weight", rand(h, i)
    yield "model.norm.weight", torch.ones(h, dtype=torch.bfloat16)


def write_hf(out: Path, shape: dict, seed: int, tokenizer: str | None = None) -> None:
    """The Hugging Face directory: config, generation config, tokenizer (the default model's, or the one
    saved in the directory `tokenizer`) and model.safetensors."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    out.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        **config_fields(shape),
        rope_theta=shape["rope_theta"],
        max_position_embeddings=shape["context"],
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    load_tokenizer(tokenizer or default_model_path(), tokenizer).save_pretrained(out)
    save_file(dict(hf_tensors(shape, seed)), out / "model.safetensors", metadata={"format": "pt"})


def gguf_name(hf: str) -> str:
    """llama.cpp's tensor name for a Hugging Face one (convert_hf_to_gguf.py's Llama mapping)."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in fixed:
        return fixed[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    return (
        f"blk.{layer}."
        + {
            "input_layernorm.weight": "attn_norm.weight",
            "self_attn.q_proj.weight": "attn_q.weight",
            "self_attn.k_proj.weight": "attn_k.weight",
            "self_attn.v_proj.weight": "attn_v.weight",
            "self_attn.o_proj.weight": "attn_output.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
            "mlp.gate_proj.weight": "ffn_gate.weight",
            "mlp.up_proj.weight": "ffn_up.weight",
            "mlp.down_proj.weight": "ffn_down.weight",
        }[rest]
    )


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for arch llama (its converter's LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, kind: str, shape: dict, seed: int) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    w = GGUFWriter(str(path), "llama")
    w.add_name("llama-1b-random")
    w.add_block_count(shape["layers"])
    w.add_context_length(shape["context"])
    w.add_embedding_length(shape["hidden"])
    w.add_feed_forward_length(shape["intermediate"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_key_length(shape["head_dim"])
    w.add_value_length(shape["head_dim"])
    w.add_rope_dimension_count(shape["head_dim"])
    w.add_rope_freq_base(shape["rope_theta"])
    w.add_layer_norm_rms_eps(shape["eps"])
    w.add_vocab_size(shape["vocab"])
    w.add_file_type(getattr(LlamaFileType, GGUF_TYPES[kind]))
    for key, field in GGUFReader(default_model_path()).fields.items():  # the tokenizer, as the default model has it
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(
                key, field.contents(), vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None
            )
    qtype = getattr(GGMLQuantizationType, kind)
    for name, tensor in hf_tensors(shape, seed):
        data = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            data = permute(data, shape["heads"])
        elif name.endswith("k_proj.weight"):
            data = permute(data, shape["kv_heads"])
        if data.ndim == 1:  # norms stay float32, as llama.cpp writes them
            w.add_tensor(gguf_name(name), data)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["llama", "gemma3"], default="llama", help="Llama-3.2-1B's shape or Gemma-3-1B's")
    ap.add_argument("--out", type=Path, help="default: ~/.cache/minivllm/models/{llama,gemma3}-1b-random")
    ap.add_argument(
        "--formats",
        nargs="+",
        help="default: hf F16 Q8_0 Q4_0 Q4_K_M (llama), hf F16 Q4_K_M (gemma3)",
        choices=["hf", "F16", "Q8_0", "Q4_0", "Q4_K_M"],
    )
    ap.add_argument("--llama-bin", type=Path, default=CACHE_DIR / "llama.cpp" / "build" / "bin")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="fewer layers for a quick check")
    args = ap.parse_args()
    gemma = args.arch == "gemma3"
    shape = dict(GEMMA3_1B if gemma else SHAPE, layers=args.layers or (GEMMA3_1B if gemma else SHAPE)["layers"])
    args.out = args.out or CACHE_DIR / "models" / f"{args.arch}-1b-random"
    args.out.mkdir(parents=True, exist_ok=True)
    formats = list(args.formats or (["hf", "F16", "Q4_K_M"] if gemma else ["hf", "F16", "Q8_0", "Q4_0", "Q4_K_M"]))
    if "Q4_K_M" in formats and "F16" not in formats:
        formats.insert(0, "F16")  # llama-quantize's input
    for kind in formats:
        path = args.out / ("hf" if kind == "hf" else f"model-{kind}.gguf")
        if path.exists():
            print(f"{path}: exists")
            continue
        start = time.perf_counter()
        if kind == "hf":
            (write_gemma3_hf if gemma else write_hf)(path, shape, args.seed)
        elif gemma and kind == "F16":  # as users' files are made: llama.cpp's converter on the directory
            if not (args.out / "hf").exists():
                write_gemma3_hf(args.out / "hf", shape, args.seed)
            llama_cpp.convert(args.out / "hf", path, "f16")
        elif gemma and kind != "Q4_K_M":
            raise SystemExit(f"--arch gemma3 makes hf, F16 and Q4_K_M, not {kind}")
        elif kind == "Q4_K_M":
            quantizer = args.llama_bin / "llama-quantize"
            if not quantizer.exists():
                print(f"{quantizer} is missing (scripts/build_llama_server.sh builds it): no Q4_K_M file")
                continue
            subprocess.run(
                [str(quantizer), str(args.out / "model-F16.gguf"), str(path), "Q4_K_M"], check=True, capture_output=True
            )
        else:
            write_gguf(path, kind, shape, args.seed)
        size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
        print(f"{path}: {size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
