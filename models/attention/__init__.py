"""Attention backends: `torch_native` everywhere (the reference), `cpu` (a C paged-attention kernel;
the CPU default), `flashinfer` on CUDA when it is installed and the dtype is float16 or bfloat16."""

import logging

import torch

from models.attention.base import AttentionBackend
from models.attention.cpu import CPUBackend
from models.attention.flashinfer import FlashInferBackend, flashinfer_available
from models.attention.torch_native import TorchNativeBackend
from models.kernels import cpu_kernels

logger = logging.getLogger(__name__)

# FlashInfer's kernels are built for 16-bit (and fp8) inputs; there is none for float32.
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def choose_backend(
    name: str | None, device_type: str, dtype: torch.dtype, flashinfer_ok: bool, cpu_kernels_ok: bool
) -> str:
    """Which backend make_backend builds: "flashinfer", "cpu" or "torch_native".

    name: the one asked for ("torch_native", "cpu", "flashinfer"), or None for the best that runs:
    flashinfer on CUDA for float16 / bfloat16 when `flashinfer_ok` (the package imports), the C
    kernel on the CPU for float32 / bfloat16 when `cpu_kernels_ok` (it builds), else torch_native;
    falling back from flashinfer logs why. An explicit "cpu" that cannot run falls back to torch_native too.
    Raises ValueError for an unknown name, flashinfer asked for off CUDA, in another dtype or not
    installed, and cpu asked for off the CPU.
    """
    if name not in (None, "torch_native", "flashinfer", "cpu"):
        raise ValueError(f"unknown attention_backend {name!r}; choose torch_native, cpu or flashinfer")
    if name == "flashinfer":
        if device_type != "cuda":
            raise ValueError("attention_backend flashinfer needs a CUDA device")
        if dtype not in FLASHINFER_DTYPES:
            raise ValueError(
                f"attention_backend flashinfer supports float16 and bfloat16, not "
                f"{str(dtype).removeprefix('torch.')}; use dtype bfloat16 (--dtype bfloat16) "
                f"or attention_backend torch_native"
            )
        if not flashinfer_ok:
            raise ValueError("attention_backend flashinfer needs the flashinfer-python package (pip install .[cuda])")
        return "flashinfer"
    if name == "cpu" and device_type != "cpu":
        raise ValueError("attention_backend cpu needs the CPU device")
    if name is None and device_type == "cuda":
        if dtype not in FLASHINFER_DTYPES:
            logger.info(
                "FlashInfer supports float16 and bfloat16, not %s; using the torch_native attention backend",
                str(dtype).removeprefix("torch."),
            )
        elif flashinfer_ok:
            return "flashinfer"
        else:
            logger.warning("FlashInfer is not installed; falling back to the torch_native attention backend")
    if device_type == "cpu" and name in (None, "cpu") and dtype in CPU_KERNEL_DTYPES and cpu_kernels_ok:
        return "cpu"
    return "torch_native"


def make_backends(
    name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    shape,
    block_size: int,
    layer_groups: list[int] | None = None,
    kv_cache_dtype: str = "auto",
) -> list[AttentionBackend | None]:
    """The attention backend of each layer of one rank (`shape`: models.config.ModelShape), as choose_backend
    picks it: one backend per KV cache group (`layer_groups[i]`: layer i's group; by default one group per
    distinct sliding window), shared by its layers, so each is planned once per step with its group's block
    tables, sized by the group's first layer (ModelShape.for_layer). Layers that keep a state instead of K/V
    (`shape.state_layers`) get None. Raises ValueError as
    choose_backend does."""
    windows = shape.sliding_windows or (None,) * shape.num_layers
    groups = layer_groups if layer_groups is not None else windows
    by_group = {}
    for i, (g, w) in enumerate(zip(groups, windows)):
        if g not in by_group and i not in shape.state_layers:
            by_group[g] = make_backend(name, device, dtype, shape.for_layer(i), block_size, w, kv_cache_dtype)
    return [None if i in shape.state_layers else by_group[g] for i, g in enumerate(groups)]


def make_backend(
    name: str | None,
    device: torch.device,
    dtype: torch.dtype,
    shape,
    block_size: int,
    sliding_window: int | None = None,
    kv_cache_dtype: str = "auto",
) -> AttentionBackend:
    """Builds the attention backend for one rank's heads (`shape`: models.config.ModelShape), as
    choose_backend picks it, attending within `sliding_window` tokens if given, over a cache of
    `kv_cache_dtype` (models.attention.kv_cache_dtype). Raises ValueError as choose_backend does, and for a
    quantized cache on flashinfer."""
    # Probe only what the choice can use: importing flashinfer takes seconds, and the C kernels
    # are compiled on first use.
    flashinfer_ok = device.type == "cuda" and name in (None, "flashinfer") and flashinfer_available()
    cpu_kernels_ok = device.type == "cpu" and name in (None, "cpu") and cpu_kernels.load() is not None
    choice = choose_backend(name, device.type, dtype, flashinfer_ok, cpu_kernels_ok)
    scale = shape.attention_scale or shape.head_dim**-0.5
    args = (shape.num_heads, shape.num_kv_heads, shape.head_dim, block_size, scale)
    kinds = dict(sliding_window=sliding_window, logits_soft_cap=shape.attn_logit_softcapping)
    if choice == "flashinfer":
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is built for the cpu and torch_native backends only")
        return FlashInferBackend(*args, dtype=dtype, device=device, **kinds)
    backend_cls = CPUBackend if choice == "cpu" else TorchNativeBackend
    return backend_cls(*args, **kinds, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
