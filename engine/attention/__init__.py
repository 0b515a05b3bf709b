"""Attention backends: `torch_native` everywhere (the reference), `cpu` (a C paged-attention kernel;
the CPU default), `flashinfer` on CUDA when it is installed."""
import logging

import torch

from engine.attention.base import AttentionBackend
from engine import cpu_kernels
from engine.attention.cpu import CPUBackend
from engine.attention.torch_native import TorchNativeBackend

logger = logging.getLogger(__name__)


def make_backend(name: str | None, device: torch.device, dtype: torch.dtype, hf_config,
                 block_size: int, tp_size: int = 1) -> AttentionBackend:
    """Builds the attention backend for a model config (for one rank's heads of `tp_size`).

    name: "torch_native", "cpu", "flashinfer", or None (flashinfer on CUDA when importable, cpu on the
    CPU when its kernel builds, else torch_native).
    Raises ValueError for an unknown name or flashinfer asked for where it cannot run.
    """
    from engine.distributed.layers import partition_heads
    from models.llama import head_dim_of

    head_dim = head_dim_of(hf_config)
    args = (*partition_heads(hf_config, tp_size), head_dim, block_size, head_dim ** -0.5)
    if name in (None, "flashinfer") and device.type == "cuda":
        from engine.attention.flashinfer import FlashInferBackend, flashinfer_available

        if flashinfer_available():
            return FlashInferBackend(*args, dtype=dtype, device=device)
        if name == "flashinfer":
            raise ValueError("attention_backend flashinfer needs the flashinfer-python package (pip install .[cuda])")
        logger.warning("FlashInfer is not installed; falling back to the torch_native attention backend")
    elif name == "flashinfer":
        raise ValueError("attention_backend flashinfer needs a CUDA device")
    if name not in (None, "torch_native", "flashinfer", "cpu"):
        raise ValueError(f"unknown attention_backend {name!r}; choose torch_native, cpu or flashinfer")
    if name == "cpu" and device.type != "cpu":
        raise ValueError("attention_backend cpu needs the CPU device")
    if device.type == "cpu" and name in (None, "cpu") and dtype in (torch.float32, torch.bfloat16) \
            and cpu_kernels.load() is not None:
        return CPUBackend(*args)
    return TorchNativeBackend(*args)
