"""A random AWQ checkpoint of a Hugging Face directory's shape, for vLLM-CPU's int4 path as a benchmark peer.

vLLM-CPU runs AWQ checkpoints (4 bits, a group's scale and zero point, AutoAWQ's GEMM packing) through its
`CPUWNA16LinearKernel`: W4A16 everywhere (AMX tiles on a CPU that has them, AVX-512 otherwise), W4A8 with
`VLLM_CPU_INT4_W4A8=1` on an AMX CPU. A real AWQ file comes from calibrating a model; speed does not depend on the
values, so this writes what such a file holds with random codes: every linear of the decoder layers (q, k, v, o,
gate, up, down) as `qweight` int32 [in, out / 8] and `qzeros` int32 [in / group, out / 8] (eight 4-bit codes each),
`scales` float16 [in / group, out] (small, so the text stays finite), and the source directory's other tensors
(embedding, norms, an untied LM head) and files as they are, with `quantization_config` (AutoAWQ's fields) in
config.json.

The group is 128 (AutoAWQ's default) where it divides every linear's input size, else the largest of 64 and 32
that does (the default model's hidden size 576 takes 64).

    python scripts/make_awq_model.py [SRC_HF_DIR] [--out OUT_DIR] [--group-size N]   # prints OUT_DIR
    AWQ=$(python scripts/make_awq_model.py)    # the default model's shape: ~/.cache/minivllm/models/default-awq
    M=~/.cache/minivllm/models/llama-1b-random; python scripts/make_awq_model.py $M/hf --out $M/awq

Without SRC_HF_DIR, the default model's GGUF dequantized to a Hugging Face directory (what bench_peers.py gives
vLLM) is the source.

Outputs that exist are kept. Raises SystemExit when no group size divides the linears' input sizes.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from models.cache_dir import CACHE_DIR  # noqa: E402
from models.loader import default_model_path, export_hf_directory  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUPS = (128, 64, 32)


def awq_tensors(name: str, weight_shape: tuple[int, int], group: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM-packed tensors of one linear `name` (its `.weight` dropped) of [out, in] float weights:
    random codes and zero points, scales 1e-3 .. 2e-3."""
    out_features, in_features = weight_shape
    prefix = name.removesuffix(".weight")
    codes = torch.randint(-(2**31), 2**31 - 1, (in_features, out_features // 8), dtype=torch.int32, generator=gen)
    zeros = torch.randint(
        -(2**31), 2**31 - 1, (in_features // group, out_features // 8), dtype=torch.int32, generator=gen
    )
    scales = (1e-3 * (1 + torch.rand(in_features // group, out_features, generator=gen))).to(torch.float16)
    return {f"{prefix}.qweight": codes, f"{prefix}.qzeros": zeros, f"{prefix}.scales": scales}


def group_size(shapes: list[tuple[int, int]], wanted: int | None) -> int:
    """`wanted`, or the first of GROUPS dividing every input size; SystemExit where it does not divide them."""
    for g in [wanted] if wanted else GROUPS:
        if all(in_features % g == 0 and out_features % 32 == 0 for out_features, in_features in shapes):
            return g
    raise SystemExit(f"no group size of {[wanted] if wanted else GROUPS} divides the linears' shapes {set(shapes)}")


def make_awq(src: str | Path, out: str | Path, wanted_group: int | None = None, seed: int = 0) -> Path:
    """Writes `out` (kept if it has its model.safetensors) from the Hugging Face directory `src`; returns `out`.
    Raises SystemExit where `src` has no decoder linears or no group size divides them."""
    src, out = Path(src), Path(out)
    if (out / "model.safetensors").exists():
        return out
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    linear = [k for k in tensors if k.endswith(".weight") and k.split(".")[-2] in LINEARS]
    if not linear:
        raise SystemExit(f"{src}: no decoder linears ({', '.join(LINEARS)}) among its tensors")
    group = group_size([tuple(tensors[k].shape) for k in linear], wanted_group)
    gen = torch.Generator().manual_seed(seed)
    for k in linear:
        tensors.update(awq_tensors(k, tuple(tensors.pop(k).shape), group, gen))
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, nargs="?", help="a Hugging Face directory of a Llama-family model")
    ap.add_argument("--out", type=Path, help="default: the source's directory + '-awq', or models/default-awq")
    ap.add_argument("--group-size", type=int, help=f"default: the first of {GROUPS} dividing every input size")
    args = ap.parse_args()
    src = args.src.expanduser() if args.src else Path(export_hf_directory(default_model_path()))
    out = args.out or (args.src and src.with_name(src.name + "-awq")) or Path(CACHE_DIR) / "models" / "default-awq"
    print(make_awq(src, out.expanduser(), args.group_size))


if __name__ == "__main__":
    sys.exit(main())
