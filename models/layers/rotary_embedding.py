"""Rotary position embeddings (RoPE, Su et al. 2021): inverse frequencies with Llama 3's or linear scaling,
and the float32 cos/sin table gathered once per step."""

import math

import torch
from torch import nn


def rope_inv_freq(config, head_dim: int, layer_type: str | None = None) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2] (float32), with Llama 3's frequency scaling or linear
    position interpolation (Chen et al. 2023) if set: from the config's parameters (a Hugging Face directory;
    Gemma 3 keeps one set per layer type, picked by `layer_type`), or as the per-dimension divisors llama.cpp's
    converter writes into a GGUF file as `rope_freqs` (`freq_factors`). Raises ValueError for another rope
    type."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type not in ("default", None):
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3, linear)")
    if "freq_factors" in params:
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over a precomputed float32 cos/sin table of [max_len, head_dim // 2]."""

    def __init__(self, config, head_dim: int, max_len: int, layer_type: str | None = None):
        super().__init__()
        self.config, self.head_dim, self.max_len, self.layer_type = config, head_dim, max_len, layer_type
        self.cos = self.sin = None
        device = torch.empty(0).device  # the device being built on (torch.device context)
        if device.type != "meta":
            self.compute_table(device)

    def compute_table(self, device: torch.device) -> None:
        """Fills the float32 tables on `device`: at construction, or after loading for a model built on
        the meta device (no checkpoint holds them). Plain attributes, not buffers, so that
        `model.to(bfloat16)` leaves the angles in float32 and materializing the meta model does not drop them."""
        positions = torch.arange(self.max_len, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, rope_inv_freq(self.config, self.head_dim, self.layer_type).to(device))
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions (int64 [T]): float32 [T, head_dim // 2] each, gathered once per step."""
        return self.cos[positions], self.sin[positions]
