"""Quantized KV caches (vLLM's --kv-cache-dtype): what a K or V row of one head holds, and the torch reference
of the CPU kernel's quantization (models/kernels/csrc/paged_attention.c), for the torch_native backend and
the tests.

- "int8": llama.cpp's q8_0 layout per row: head_dim int8 values, then one float32 scale per 32 of them
  (x = q * scale, scale = max|x| / 127), head_dim * 1.125 bytes (float32 scales where q8_0 has float16).
- "fp8" / "fp8_e4m3": float8 e4m3 ("fn": largest finite 448), "fp8_e5m2": float8 e5m2 (57344): one byte per
  value, saturated at the largest finite value (vLLM's conversion), rounded to nearest even; no scale (vLLM's
  default k_scale = v_scale = 1.0).
"""

import torch

# --kv-cache-dtype -> the kernels' code (0 = the model dtype)
KV_CACHE_DTYPES = {"auto": 0, "int8": 1, "fp8": 2, "fp8_e4m3": 2, "fp8_e5m2": 3}
STORAGE = {1: torch.int8, 2: torch.float8_e4m3fn, 3: torch.float8_e5m2}
FP8_MAX = {2: 448.0, 3: 57344.0}
INT8_GROUP = 32  # values per int8 scale


def kv_cache_code(name: str, head_dim: int) -> int:
    """The kernels' code of a --kv-cache-dtype. Raises ValueError for an unknown name, or int8 with a head
    size that is not a multiple of 32."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    code = KV_CACHE_DTYPES[name]
    if code == 1 and head_dim % INT8_GROUP:
        raise ValueError(f"kv_cache_dtype int8 needs a head size that is a multiple of 32, not {head_dim}")
    return code


def row_elements(head_dim: int, code: int) -> int:
    """Elements (of the storage dtype) of one K or V row of a head: head_dim, plus the scales' bytes for int8."""
    return head_dim + head_dim // INT8_GROUP * 4 if code == 1 else head_dim


def quantize_rows(x: torch.Tensor, code: int) -> torch.Tensor:
    """Rows x [..., head_dim] (any float dtype) as the cache stores them: [..., row_elements] in STORAGE[code]."""
    x = x.float()
    if code == 1:
        groups = x.unflatten(-1, (-1, INT8_GROUP))
        amax = groups.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        q = torch.round(groups * inv).to(torch.int8).flatten(-2)
        scales = (amax / 127.0).squeeze(-1).contiguous().view(torch.int8)
        return torch.cat([q, scales], -1)
    limit = FP8_MAX[code]
    return x.clamp(-limit, limit).to(STORAGE[code])


def dequantize_rows(rows: torch.Tensor, head_dim: int, code: int) -> torch.Tensor:
    """Float32 [..., head_dim] of cache rows [..., row_elements] (quantize_rows' inverse, up to its rounding)."""
    if code == 1:
        q = rows[..., :head_dim].float().unflatten(-1, (-1, INT8_GROUP))
        scales = rows[..., head_dim:].contiguous().view(torch.float32)
        return (q * scales[..., None]).flatten(-2)
    return rows.float()
