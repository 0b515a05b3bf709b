"""The CPU kernels in `models/kernels/csrc/`: built once with the system C compiler, cached, loaded with ctypes.

One shared library holds every kernel (paged attention, small-batch linear, GGUF quantized linear, fused
norm / rotary / SiLU-and-mul, the recurrent layers' one-token updates). It is compiled with -O3 -march=native and
OpenMP (the libgomp torch already loaded, so kernels and torch share one thread pool) into
~/.cache/minivllm/kernels, keyed by the sources and flags, and called through ctypes, which releases the GIL.
Without a working compiler `load()` returns None and callers use their torch paths.
"""

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from models.cache_dir import CACHE_DIR

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]

_p, _i, _f, _l = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
# name -> argument types; kernels that can refuse a shape return int (0 = done), the others nothing
RETURNS_STATUS = {
    "paged_attention_float",
    "paged_attention_bf16",
    "paged_attention_float_q",
    "paged_attention_bf16_q",
    "attention_isa",
    "linear_bf16",
    "linear_half",
    "gguf_linear",
    "gguf_dequantize",
    "gguf_r16_isa",
    "gguf_r16_takes",
    "gguf_q8_isa",
    "gguf_q8_linear",
    "gguf_moe",
    "gguf_repack_r16",
    "gguf_r16_dequantize_rows",
    "gguf_refine_top",
    "gguf_r16_linear",
    "gguf_r16_linear_i8",
    "gguf_amx_probe",
    "gguf_amx_enable",
    "decoder_layer_float",
    "decoder_layers_float",
    "decoder_step_float",
    "gguf_embed_rows",
    "delta_layer_float",
    "top_k_float",
}
RETURNS_LONG = {"gguf_r16_bytes"}
SIGNATURES = {
    **{
        f"paged_attention_{name}": [_p, _i, _p, _i, _p, _i, _p, _p, _p, _i, _p, _p, _p, _p]
        + [_i] * 6
        + [_f, _i, _f, _i, _i, _i, _p]
        for name in ("float", "bf16", "float_q", "bf16_q")
    },
    "attention_isa": [],
    "linear_bf16": [_p, _i, _p, _p, _p, _i, _i, _i, _i],
    "linear_half": [_p, _i, _p, _i, _p, _i, _i, _i, _i],
    "gguf_linear": [_p, _i, _i, _p, _i, _p, _i, _i, _i, _i, _i, _i],
    "gguf_dequantize": [_i, _p, _i, _i, _p, _i, _i],
    "gguf_r16_isa": [],
    "gguf_r16_takes": [_i, _i],
    "gguf_q8_isa": [],
    "gguf_q8_linear": [_p, _i, _i, _p, _i, _p, _i, _i, _i, _i, _i, _i],
    "gguf_moe": [_p, _i, _i, _p, _p, _i, _p, _i, _p, _i, _p, _i, _i, _i, _p, _p, _f, _f, _i, _i, _p, _i],
    "gguf_repack_r16": [_i, _p, _i, _i, _p],
    "gguf_r16_bytes": [_i, _i, _i],
    "gguf_r16_dequantize_rows": [_i, _p, _i, _p, _i, _p, _i, _i],
    "gguf_refine_top": [_p, _i, _i, _p, _i, _i, _p, _i, _i, _i],
    "gguf_r16_linear": [_p, _i, _i, _p, _i, _p, _i, _i, _i, _i, _i, _i],
    "gguf_r16_linear_i8": [_p, _i, _i, _p, _i, _p, _i, _i, _i, _i, _i, _i],
    "gguf_amx_probe": [],
    "gguf_amx_enable": [_i],
    "decoder_layer_float": [_p, _p, _p, _p, _i] + [_p] * 8 + [_i] * 4,
    "decoder_layers_float": [_p, _i, _p, _p, _p, _i] + [_p] * 8 + [_i] * 4,
    "decoder_step_float": [_p, _p, _i, _p, _p, _p, _p, _i] + [_p] * 6 + [_i] * 4 + [_p, _i, _p, _p],
    "gguf_embed_rows": [_i, _p, _i, _i, _i, _p, _i, _p, _i, _i],
    "top_k_float": [_p, _i, _i, _i, _p, _i],
    "delta_layer_float": [_p, _p, _p, _p, _i, _p, _l, _p, _i],
    "moe_route_float": [_p, _i, _i, _p, _p, _i, _i, _i, _p, _p, _i],
    "gated_delta_net_decode": [_p, _l, _p, _i] + [_p] * 5 + [_i] + [_p] * 3 + [_f] + [_i] * 5 + [_p, _i],
}
for _t in ("float", "bf16"):
    SIGNATURES |= {
        f"add_rms_norm_{_t}": [_p, _p, _p, _p, _i, _i, _f, _i],
        f"rotary_{_t}": [_p, _i, _i, _i, _i, _i, _p, _p, _i],
        f"sigmoid_gate_{_t}": [_p, _i, _p, _i, _i, _i, _i],
        f"silu_and_mul_{_t}": [_p, _p, _i, _i, _i],
        f"gelu_tanh_and_mul_{_t}": [_p, _p, _i, _i, _i],
    }


def build_library(cc: str, tmp: Path, sources: list[Path] = SOURCES) -> str | None:
    """Compiles every source (default: this tree's csrc/*.c) into tmp/lib.so, one compiler process per source at
    once (the two large files take ~2.3 s each: a first start on 2 cores waits half as long), then links. Returns
    the compiler's error output, or None when built. scripts/bench_kernel_ab.py builds other revisions with it."""
    objects = [tmp / f"{src.stem}.o" for src in sources]
    procs = [
        subprocess.Popen(
            [cc, *FLAGS, "-c", str(src), "-o", str(obj)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for src, obj in zip(sources, objects)
    ]
    errors = [err for proc in procs if (err := proc.communicate()[1]) and proc.returncode != 0]
    if errors:
        return "\n".join(errors)
    link = subprocess.run(
        [cc, *FLAGS, *map(str, objects), "-o", str(tmp / "lib.so"), "-lm"], capture_output=True, text=True
    )
    return link.stderr if link.returncode != 0 else None


@functools.cache
def load() -> ctypes.CDLL | None:
    """Builds (once per sources and flags) and loads the kernels; None if no C compiler works."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        logger.warning("no C compiler (%s); the CPU runs torch ops for attention and layers", cc)
        return None
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(FLAGS).encode()).hexdigest()[
        :16
    ]
    lib_path = CACHE_DIR / "kernels" / f"cpu_kernels-{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
            error = build_library(cc, Path(tmp))
            if error is not None:
                logger.warning("building the CPU kernels failed; using torch ops:\n%s", error)
                return None
            os.replace(Path(tmp) / "lib.so", lib_path)  # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(str(lib_path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_long if name in RETURNS_LONG else ctypes.c_int if name in RETURNS_STATUS else None
        fn.argtypes = argtypes
    return lib
