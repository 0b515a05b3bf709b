"""The R16 int8 kernel of two revisions of models/kernels/csrc on a GGUF file's own tensors, alternating in one
process, so that a kernel change is measured in the same minutes on the same host (this project's VMs move by
10-25% between minutes, more than most changes).

Each revision's sources (`git archive`; "." for the working tree) are built as the engine builds its own
(models/kernels/cpu_kernels.py `build_library`) and loaded with ctypes. Each library repacks the tensors itself
(gguf_repack_r16: a change may change the layout), then `gguf_r16_linear_i8` (float32 activations quantized to
int8, the default path) runs on random activations of M rows, the two libraries alternating for --rounds rounds.
Prints, per tensor and M, each library's median milliseconds and GMAC/s, new / old, and the largest difference of
the outputs relative to the largest old output (0 where a change keeps the arithmetic bit for bit). One JSON line
each.

    python scripts/bench_kernel_ab.py --model M --old HEAD~1 --new . \\
        --tensors blk.0.ffn_gate.weight blk.0.ffn_down.weight token_embd.weight --rows 1 32 512
"""

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.kernels.cpu_kernels import build_library  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CSRC = "models/kernels/csrc"


def build(rev: str, out_dir: Path) -> ctypes.CDLL:
    """Builds revision `rev` ("." = the working tree) of the kernels in a new directory of out_dir and loads it."""
    src = out_dir / f"src-{len(list(out_dir.iterdir()))}"
    src.mkdir()
    if rev == ".":
        for path in (REPO / CSRC).iterdir():
            (src / path.name).write_bytes(path.read_bytes())
    else:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, CSRC], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(src), "--strip-components=3"], input=archive.stdout, check=True)
    error = build_library("cc", src, sorted(src.glob("*.c")))
    if error is not None:
        sys.exit(f"building {rev} failed:\n{error}")
    lib_path = src / "lib.so"
    lib = ctypes.CDLL(str(lib_path))
    lib.gguf_r16_bytes.restype = ctypes.c_long
    if hasattr(lib, "gguf_amx_enable"):
        lib.gguf_amx_enable(0)  # the VNNI kernel itself, also on an AMX CPU
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--old", default="HEAD", help="git revision of the baseline (default HEAD)")
    parser.add_argument("--new", default=".", help='git revision of the change ("." = the working tree)')
    parser.add_argument("--tensors", nargs="+", required=True, help="tensor names of the file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 512])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    vp = ctypes.c_void_p
    with tempfile.TemporaryDirectory() as tmp:
        libs = [build(args.old, Path(tmp)), build(args.new, Path(tmp))]
        tensors = {t.name: t for t in GGUFReader(args.model).tensors}
        for name in args.tensors:
            t = tensors[name]
            K, N, qtype = int(t.shape[0]), int(t.shape[1]), int(t.tensor_type)
            blocks = np.ascontiguousarray(t.data).view(np.uint8)
            weights = []
            for lib in libs:
                size = lib.gguf_r16_bytes(qtype, N, K)
                if size < 0:
                    sys.exit(f"{name}: {t.tensor_type.name} has no R16 layout")
                w = np.zeros(size + 64, np.uint8)
                lib.gguf_repack_r16(qtype, blocks.ctypes.data_as(vp), N, K, w.ctypes.data_as(vp))
                weights.append(w)
            for M in args.rows:
                x = np.random.default_rng(M).standard_normal((M, K), dtype=np.float32)
                ys = [np.zeros((M, N), np.float32) for _ in libs]
                reps = max(1, int(2e9 / (2 * M * N * K)))
                times: list[list[float]] = [[], []]
                for _ in range(args.rounds):
                    for i, lib in enumerate(libs):
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            lib.gguf_r16_linear_i8(
                                x.ctypes.data_as(vp),
                                0,
                                K,
                                weights[i].ctypes.data_as(vp),
                                qtype,
                                ys[i].ctypes.data_as(vp),
                                0,
                                N,
                                M,
                                N,
                                K,
                                args.threads,
                            )
                        times[i].append((time.perf_counter() - t0) / reps)
                old, new = (statistics.median(ts) for ts in times)
                diff = float(np.abs(ys[0] - ys[1]).max() / (np.abs(ys[0]).max() + 1e-30))
                print(
                    json.dumps(
                        {
                            "tensor": name,
                            "type": t.tensor_type.name,
                            "N": N,
                            "K": K,
                            "M": M,
                            "old_ms": round(old * 1e3, 4),
                            "new_ms": round(new * 1e3, 4),
                            "old_gmacs": round(M * N * K / old / 1e9, 1),
                            "new_gmacs": round(M * N * K / new / 1e9, 1),
                            "new_over_old": round(new / old, 3),
                            "max_rel_diff": diff,
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
