"""The shape of one rank's model, read once from the Hugging Face config: what the model, the
attention backend and the KV cache are sized by."""

from dataclasses import dataclass, replace

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
    DeltaNet). layer_head_dims / layer_total_kv_heads: each layer's head_dim and KV heads (of the whole model)
    where they differ by layer (Gemma 4's global layers: `per_layer_config`), else empty (see for_layer).
    kv_sharing: for each layer, the earlier layer whose K/V it attends to instead of computing its own (Gemma 4's
    last `num_kv_shared_layers`), None for a layer with its own; empty when no layer shares.
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
    layer_head_dims: tuple[int, ...] = ()
    layer_total_kv_heads: tuple[int, ...] = ()
    kv_sharing: tuple[int | None, ...] = ()

    def for_layer(self, i: int) -> "ModelShape":
        """The shape of layer i's attention: this shape with the layer's own head_dim and KV heads where they
        differ by layer (`layer_head_dims`, `layer_total_kv_heads`: Gemma 4's global layers), else itself."""
        if not self.layer_head_dims:
            return self
        total = self.layer_total_kv_heads[i]
        return replace(
            self,
            head_dim=self.layer_head_dims[i],
            total_num_kv_heads=total,
            num_kv_heads=max(1, total // self.tp_size),
        )

    @property
    def kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """Each layer's (KV heads of this rank, head_dim)."""
        return tuple((s.num_kv_heads, s.head_dim) for s in map(self.for_layer, range(self.num_layers)))

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
            **per_layer_attention(config, tp_size),
            kv_sharing=kv_sharing_targets(config),
        )


def per_layer_attention(config, tp_size: int) -> dict:
    """ModelShape's layer_head_dims and layer_total_kv_heads of a config whose layers' attention shapes differ
    (transformers' `per_layer_config`: Gemma 4's global layers have their own head_dim and KV heads); empty when
    every layer's is the same. Raises ValueError when a layer's KV heads do not split over `tp_size` ranks."""
    per_layer = getattr(config, "per_layer_config", None)
    if not isinstance(per_layer, list) and "_heterogeneity_spec" not in vars(config):  # GGUF's list, or Gemma 4's
        return {}
    n = config.num_hidden_layers
    dims = tuple(per_layer[i].head_dim for i in range(n))
    kv = tuple(per_layer[i].num_key_value_heads for i in range(n))
    if len(set(zip(dims, kv))) == 1:
        return {}
    for heads in set(kv):
        if (heads >= tp_size and heads % tp_size) or (heads < tp_size and tp_size % heads):
            raise ValueError(f"tensor_parallel_size {tp_size} does not divide a layer's {heads} KV heads")
    return {"layer_head_dims": dims, "layer_total_kv_heads": kv}


def kv_sharing_targets(config) -> tuple[int | None, ...]:
    """For each layer, the layer whose K/V it attends to instead of its own (Gemma 4's last
    `num_kv_shared_layers` layers read the last earlier layer of their own kind, as transformers'
    `kv_sharing_modes` pairs them), None for a layer with its own; empty when no layer shares. Raises ValueError
    when a sharing layer's kind has no earlier layer."""
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    if not shared:
        return ()
    n = config.num_hidden_layers
    types = config.layer_types
    first = n - shared
    targets: list[int | None] = [None] * first
    for i in range(first, n):
        own = [j for j in range(first) if types[j] == types[i]]
        if not own:
            raise ValueError(f"layer {i} ({types[i]}) shares K/V but no earlier layer is of its kind")
        targets.append(own[-1])
    return tuple(targets)


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
    attention_multiplier, query_pre_attn_scalar ** -0.5 (Gemma 2/3), 1 (Gemma 4: its q/k norms size the scores);
    None otherwise."""
    if getattr(config, "model_type", None) == "gemma4_text":
        return 1.0
    if getattr(config, "attention_multiplier", None) is not None:
        return config.attention_multiplier
    if getattr(config, "query_pre_attn_scalar", None) is not None:
        return config.query_pre_attn_scalar**-0.5
    return None
