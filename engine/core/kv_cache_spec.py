"""What each layer keeps in the KV cache, and which layers share a block table (vLLM v1's KVCacheSpec and KV
cache groups: vllm/v1/kv_cache_interface.py, vllm/v1/core/kv_cache_utils.py).

Layers of one attention kind (full, or one sliding window W) share block tables; a model that mixes kinds
(Gemma 2/3: sliding and global layers) gets one group per kind, so that a sliding group frees its blocks as
its window moves on while the full group keeps them. Every group holds the same number of layers (the
bigger kinds split into several groups of that size, the last one possibly short), so that a block of the
pool is the same bytes whichever group holds it: the model runner's KV cache is `group_size` tensors of
`num_blocks` blocks, and the i-th layer of every group is stored in the i-th tensor, at its group's blocks.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    """Layers that attend to every earlier position: a request keeps all its blocks."""

    sliding_window: None = None


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Layers whose query at position p attends to positions p - sliding_window + 1 .. p only: a request's
    blocks that end before its window can be freed."""

    sliding_window: int


@dataclass(frozen=True)
class MambaSpec:
    """Layers that keep a fixed-size state per request instead of K/V (vLLM v1's MambaSpec: LFM2's short
    convolutions): a running request holds one state slot, from a pool of its own, whatever its length; the
    slot is its block table's one entry. Prefix caching is off for a model with such layers (a state is not
    split by blocks)."""

    sliding_window: None = None


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec


def spec_of(sliding_window: int | None) -> KVCacheSpec:
    """The spec of a layer with this window (None: full attention)."""
    return FullAttentionSpec() if sliding_window is None else SlidingWindowSpec(sliding_window)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers (model layer indices, ascending) that share one block table, and what they keep."""

    layer_indices: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


def kv_cache_groups(
    sliding_windows: Sequence[int | None],
    num_layers: int,
    state_layers: Sequence[int] = (),
    kv_shapes: Sequence[tuple[int, int]] = (),
    kv_sharing: Sequence[int | None] = (),
) -> list[KVCacheGroupSpec]:
    """The KV cache groups of a model whose layer i has window `sliding_windows[i]` (None: full attention; an
    empty sequence: every one of `num_layers` layers full). One group when every layer is of one kind. Else
    vLLM's uniform-page-size grouping: the group size is the smallest kind's layer count (the biggest's when
    that is within 1.25x of it, to waste less), and each kind's layers in order fill groups of that size.
    Full attention comes first, then the windows in order of first appearance; the `state_layers` (MambaSpec,
    keeping no K/V) last, in one group of their own. Layers of one window but another K/V shape (`kv_shapes[i]`:
    layer i's (KV heads, head_dim), where they differ by layer) are kinds of their own, so that a group's layers
    share one attention backend. A layer with a `kv_sharing` target (Gemma 4's last layers) keeps no K/V of its
    own: it is in no group (it reads its target's, with the target's block tables)."""
    windows = tuple(sliding_windows) or (None,) * num_layers
    kinds: dict[tuple, list[int]] = {}
    for i, w in enumerate(windows):
        if i not in state_layers and (not kv_sharing or kv_sharing[i] is None):
            kinds.setdefault((w, kv_shapes[i] if kv_shapes else None), []).append(i)
    kinds = dict(sorted(kinds.items(), key=lambda kind: kind[0][0] is not None))  # full attention first (stable)
    sizes = [len(layers) for layers in kinds.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    groups = [
        KVCacheGroupSpec(tuple(layers[i : i + size]), spec_of(w))
        for (w, _), layers in kinds.items()
        for i in range(0, len(layers), size)
    ]
    return groups + ([KVCacheGroupSpec(tuple(state_layers), MambaSpec())] if state_layers else [])


def blocks_per_request(
    groups: Sequence[KVCacheGroupSpec], num_tokens: int, block_size: int, max_num_batched_tokens: int
) -> int:
    """The most blocks one request of `num_tokens` tokens holds at once over all groups: every block of its
    tokens in a full-attention group; in a sliding one at most the window's and a step's (vLLM's
    SlidingWindowSpec.max_memory_usage_bytes)."""
    full = -(-num_tokens // block_size)
    total = 0
    for group in groups:
        if isinstance(group.kv_cache_spec, MambaSpec):  # a state slot, not a block of the pool
            continue
        window = group.kv_cache_spec.sliding_window
        total += full if window is None else min(full, -(-(window - 1 + max_num_batched_tokens) // block_size) + 1)
    return total


def max_request_tokens(
    groups: Sequence[KVCacheGroupSpec], num_blocks: int, block_size: int, max_num_batched_tokens: int, limit: int
) -> int:
    """The longest request (at most `limit` tokens) whose blocks fit in `num_blocks` (the null block, held by
    no request, is left out where a group slides); 0 when not even one token's do."""
    usable = num_blocks - any(g.kv_cache_spec.sliding_window is not None for g in groups)
    lo, hi = 0, limit
    while lo < hi:  # the largest n with blocks_per_request(n) <= usable; it grows with n
        mid = (lo + hi + 1) // 2
        if blocks_per_request(groups, mid, block_size, max_num_batched_tokens) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return lo
