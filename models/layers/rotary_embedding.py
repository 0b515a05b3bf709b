"""Rotary position embeddings (RoPE, Su et al. 2021): inverse frequencies with Llama 3's, YaRN's, LongRoPE's or
linear scaling, and the float32 cos/sin table gathered once per step."""

import logging
import math

import torch
from torch import nn

logger = logging.getLogger(__name__)

LONGROPE = ("longrope", "su")  # LongRoPE's rope_type ("su": its name in older configs)


def rope_params(config, layer_type: str | None = None) -> dict:
    """The config's rope parameters (`rope_parameters`, or the older `rope_scaling`): Gemma 3 keeps one set per
    layer type, picked by `layer_type`."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    return params


def rotary_dim(config, head_dim: int) -> int:
    """The leading features of each head that rotate: head_dim times `partial_rotary_factor` (a quarter in
    Qwen3.5, three quarters in Phi-4-mini), even."""
    factor = rope_params(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * (factor or 1.0)) // 2 * 2


def yarn_attention_factor(params: dict) -> float:
    """YaRN's scale of cos and sin (so of every attention score by its square): `attention_factor` where given,
    else 0.1 ln(factor) + 1 (Peng et al. 2023; with DeepSeek's mscale / mscale_all_dim where both are set),
    as transformers computes it."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = params["factor"]
    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


def _yarn(inv_freq: torch.Tensor, params: dict, head_dim: int, theta: float) -> torch.Tensor:
    """YaRN's frequencies (Peng et al. 2023): divided by `factor` (interpolated) below the wavelengths that turn
    fewer than `beta_slow` times over the original context, kept (extrapolated) above `beta_fast` turns, a linear
    ramp between; the ramp's ends rounded outwards unless `truncate` is false (gpt-oss), as transformers does."""
    factor, old_len = params["factor"], params["original_max_position_embeddings"]
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times over old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def longrope_original_length(config, params: dict) -> int:
    """LongRoPE's pretraining context: in the rope parameters (transformers 5), else the config's top level."""
    return params.get("original_max_position_embeddings") or config.original_max_position_embeddings


def longrope_attention_factor(config, params: dict) -> float:
    """LongRoPE's scale of cos and sin: `attention_factor` where given, else sqrt(1 + ln(s) / ln(original
    context)) with s = max_position_embeddings / original_max_position_embeddings (Phi-3's rule, transformers' and
    llama.cpp's converter's), 1 when s <= 1."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    old_len = longrope_original_length(config, params)
    scale = params.get("factor") or config.max_position_embeddings / old_len
    return math.sqrt(1 + math.log(scale) / math.log(old_len)) if scale > 1 else 1.0


def rope_inv_freq(config, head_dim: int, layer_type: str | None = None, long: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim // 2] (float32), with Llama 3's frequency scaling, YaRN, LongRoPE
    (Ding et al. 2024: each frequency divided by its `short_factor`, or its `long_factor` when `long`) or linear
    position interpolation (Chen et al. 2023) if set: from the config's parameters (a Hugging Face directory;
    Gemma 3 keeps one set per layer type, picked by `layer_type`), or as the per-dimension divisors llama.cpp's
    converter writes into a GGUF file as `rope_freqs` (`freq_factors`). `head_dim`: the rotating features of a
    head. Raises ValueError for another rope type, or LongRoPE factors of another length."""
    params = rope_params(config, layer_type)
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
    elif rope_type == "yarn":
        inv_freq = _yarn(inv_freq, params, head_dim, theta)
    elif rope_type in LONGROPE:
        factors = params["long_factor" if long else "short_factor"]
        if len(factors) != head_dim // 2:
            raise ValueError(
                f"rope {'long' if long else 'short'}_factor has {len(factors)} values, not {head_dim // 2}"
            )
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    elif rope_type == "proportional":
        # Gemma 4's global layers: the first partial_rotary_factor of each head's rotate-half pairs turn at the
        # frequencies of the whole head_dim, the others not at all (frequency 0), as transformers computes it
        turning = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq[turning:] = 0.0
        inv_freq = inv_freq / params.get("factor", 1.0)
    elif rope_type not in ("default", None):
        raise ValueError(
            f"unsupported rope_type {rope_type!r} (supported: default, llama3, linear, yarn, longrope, proportional)"
        )
    if "freq_factors" in params:
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over a precomputed float32 cos/sin table of [max_len, head_dim // 2] (`head_dim`: the
    rotating features of a head).

    LongRoPE (Phi-3's 128k models, Phi-3.5, Phi-4-mini) takes its long factors when the served context `max_len`
    exceeds `original_max_position_embeddings`, else its short ones, for every position: llama.cpp's rule (by its
    context size), so a request's cached keys never mix the two sets (vLLM switches a whole step once a position
    crosses, transformers recomputes the cache then)."""

    def __init__(self, config, head_dim: int, max_len: int, layer_type: str | None = None):
        super().__init__()
        self.config, self.head_dim, self.max_len, self.layer_type = config, head_dim, max_len, layer_type
        self.cos = self.sin = None
        params = rope_params(config, layer_type)
        self.rope_type = params.get("rope_type", params.get("type"))
        self.long = False
        if self.rope_type in LONGROPE:
            original = longrope_original_length(config, params)
            self.long = max_len > original
            logger.info(
                "LongRoPE: its %s factors for every position (served context %d %s the original %d)",
                "long" if self.long else "short",
                max_len,
                ">" if self.long else "<=",
                original,
            )
        device = torch.empty(0).device  # the device being built on (torch.device context)
        if device.type != "meta":
            self.compute_table(device)

    def compute_table(self, device: torch.device) -> None:
        """Fills the float32 tables on `device`: at construction, or after loading for a model built on
        the meta device (no checkpoint holds them). Plain attributes, not buffers, so that
        `model.to(bfloat16)` leaves the angles in float32 and materializing the meta model does not drop them."""
        positions = torch.arange(self.max_len, dtype=torch.float32, device=device)
        inv_freq = rope_inv_freq(self.config, self.head_dim, self.layer_type, self.long)
        freqs = torch.outer(positions, inv_freq.to(device))
        self.cos, self.sin = freqs.cos(), freqs.sin()
        params = rope_params(self.config, self.layer_type)
        scale = 1.0  # YaRN and LongRoPE scale cos and sin (transformers' way)
        if self.rope_type == "yarn":
            scale = yarn_attention_factor(params)
        elif self.rope_type in LONGROPE:
            scale = longrope_attention_factor(self.config, params)
        if scale != 1.0:
            self.cos, self.sin = self.cos * scale, self.sin * scale

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions (int64 [T]): float32 [T, head_dim // 2] each, gathered once per step."""
        return self.cos[positions], self.sin[positions]
