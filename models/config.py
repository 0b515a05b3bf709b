"""The shape of one rank's model, read once from the Hugging Face config: what the model, the
attention backend and the KV cache are sized by."""

from dataclasses import dataclass

# layer kinds (`layer_types`) that keep a fixed-size state per request instead of K/V: LFM2's short convolutions,
# Qwen3.5's Gated DeltaNet (linear attention)
STATE_LAYER_TYPES = ("conv", "linear_attention")


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes as one of `tp_size` tensor-parallel ranks holds it (all of it when 1).

    num_heads / num_kv_heads: this rank's query and KV heads (KV heads fewer than the ranks are
    replicated, one per rank, as vLLM does); total_num_heads / total_num_kv_heads: the model's.
    head_dim: features per head; max_position_embeddings: the model's context limit in tokens.
    sliding_windows: each layer's attention window in tokens (a query sees the W positions up to its own),
    None for full attention (layer_sliding_windows). attention_scale: what the attention scores are multiplied
    by when it is not 1 / sqrt(head_dim) (Granite's attention_multiplier, Gemma's query_pre_attn_scalar), else
    None. attn_logit_softcapping: the attention scores' soft cap (Gemma 2), else None. state_layers: the layers
    that keep a fixed-size state per request and no K/V (STATE_LAYER_TYPES: LFM2's convolutions, Qwen3.5's Gated
    DeltaNet).
    """

    num_layers: int
    hidden_size: int
    vocab_size: int
    total_num_heads: int
    total_num_kv_heads: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...] = ()
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    state_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, config, tp_size: int = 1) -> "ModelShape":
        """From a transformers config. Raises ValueError when the heads (or the MLP's
        intermediate_size) do not split evenly over `tp_size` ranks."""
        heads, kv_heads = partition_heads(config, tp_size)
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            total_num_heads=config.num_attention_heads,
            total_num_kv_heads=config.num_key_value_heads,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            tp_size=tp_size,
            max_position_embeddings=getattr(config, "max_position_embeddings", None) or 1 << 20,
            sliding_windows=layer_sliding_windows(config),
            attention_scale=attention_scale(config),
            attn_logit_softcapping=getattr(config, "attn_logit_softcapping", None),
            state_layers=tuple(
                i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind in STATE_LAYER_TYPES
            ),
        )


def partition_heads(config, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) of one rank for a Hugging Face config split over `tp_size` ranks.

    Query heads are split evenly. KV heads too when there are at least `tp_size` of them; with fewer,
    each rank holds one, shared by tp_size / num_key_value_heads ranks (replicated, as vLLM does).
    Raises ValueError when the heads (or the MLP's intermediate_size) do not split evenly.
    """
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    errors = []
    if heads % tp_size:
        errors.append(f"num_attention_heads ({heads})")
    if kv_heads >= tp_size and kv_heads % tp_size:
        errors.append(f"num_key_value_heads ({kv_heads})")
    elif kv_heads < tp_size and tp_size % kv_heads:
        errors.append(
            f"num_key_value_heads ({kv_heads}; KV heads fewer than the ranks are replicated, "
            f"which needs the ranks to be a multiple of them)"
        )
    if config.intermediate_size % tp_size:
        errors.append(f"intermediate_size ({config.intermediate_size})")
    if errors:
        raise ValueError(f"tensor_parallel_size {tp_size} does not divide the model's {', '.join(errors)}")
    return heads // tp_size, max(1, kv_heads // tp_size)


def layer_sliding_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding attention window in tokens (a query at position p sees keys p - W + 1 .. p, as
    transformers masks them), None for full attention: from the config's `layer_types` where it has them
    ("sliding_attention" layers take `sliding_window`: Gemma 2/3, Qwen2 with use_sliding_window), else
    `sliding_window` for every layer (Mistral, Phi-3); None for state layers (STATE_LAYER_TYPES), which keep
    no K/V. Raises ValueError for another layer type or a window that is not a positive number of tokens."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", None) is False:  # Qwen2, SmolLM3: the window is off
        return (None,) * n
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * n
    unknown = sorted(set(types) - {"full_attention", "sliding_attention", *STATE_LAYER_TYPES})
    if unknown:
        raise ValueError(
            f"layer_types {unknown} are not supported (supported: full_attention, sliding_attention, "
            f"{', '.join(STATE_LAYER_TYPES)})"
        )
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise ValueError(
            f"sliding_window must be a positive number of tokens for sliding_attention layers, got {window!r}"
        )
    return tuple(window if kind == "sliding_attention" else None for kind in types[:n])


def attention_scale(config) -> float | None:
    """What attention scores are multiplied by when the config says other than 1 / sqrt(head_dim): Granite's
    attention_multiplier, or query_pre_attn_scalar ** -0.5 (Gemma); None otherwise."""
    if getattr(config, "attention_multiplier", None) is not None:
        return config.attention_multiplier
    if getattr(config, "query_pre_attn_scalar", None) is not None:
        return config.query_pre_attn_scalar**-0.5
    return None
