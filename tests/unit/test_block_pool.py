"""Block pool and KV cache manager invariants: hash chain, LRU eviction order, ref counts."""

from types import SimpleNamespace

import pytest

from engine.core.kv_cache_manager import BlockPool, KVCacheManager, hash_block
from engine.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    blocks_per_request,
    kv_cache_groups,
    max_request_tokens,
)


def seq(request_id, tokens):
    return SimpleNamespace(request_id=request_id, all_token_ids=list(tokens), num_computed_tokens=0, block_hashes=[])


def test_hash_chain_depends_on_whole_prefix():
    a = hash_block(None, (1, 2))
    assert hash_block(None, (1, 2)) == a
    assert hash_block(a, (3, 4)) != hash_block(hash_block(None, (9, 9)), (3, 4))
    assert hash_block(None, (1, 2)) != hash_block(None, (2, 1))


def test_allocate_caches_full_blocks_and_prefix_hit():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == (([],), 0)
    assert kv.allocate_slots(a, 5)
    assert len(kv.req_blocks["a"][0]) == 3
    assert len(kv.pool.cached) == 2  # two full blocks; the half block is not cached
    b = seq("b", [1, 2, 3, 4, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and hits == (kv.req_blocks["a"][0][:2],)
    assert kv.allocate_slots(b, 2, hits)
    assert [blk.ref_cnt for blk in kv.req_blocks["b"][0]] == [2, 2, 1]
    assert kv.prefix_cache_queries == 11 and kv.prefix_cache_hits == 4
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.req_blocks["b"][0]] == [1, 1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == 8 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = seq("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    kv.free(a)
    hits, n = kv.get_computed_blocks(seq("b", [1, 2, 3, 4]))
    assert n == 2 and len(hits[0]) == 1  # the second block holds the last token: recomputed


def test_freed_blocks_keep_hash_and_lru_evicts_tails_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = seq("a", range(1, 9))
    assert kv.allocate_slots(a, 8)
    (ids,) = kv.block_ids("a")
    kv.free(a)
    # freed tail first, so the request's last block is the first to be evicted
    assert list(kv.pool.free_queue) == ids[::-1]
    assert len(kv.pool.cached) == 4
    b = seq("b", [1, 2, 3, 4, 99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    assert kv.allocate_slots(b, 2, hits)
    assert kv.block_ids("b") == (ids[:2] + [ids[3]],)  # took the LRU block: a's tail
    assert kv.pool.blocks[ids[3]].block_hash is not None  # re-hashed with b's tokens [99, 98]
    assert kv.pool.blocks[ids[2]].block_hash in kv.pool.cached  # a's third block still cached
    kv.free(b)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = seq("a", range(10))
    assert not kv.allocate_slots(a, 10)
    assert kv.pool.num_free_blocks == 3 and "a" not in kv.req_blocks


def test_revived_cached_blocks_count_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = seq("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    kv.free(a)  # all three free, two of them cached
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    # needs 5 blocks in all: 2 hits + 3 new, but only 1 block is free besides the hits
    assert not kv.allocate_slots(b, 5, hits)
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks) and kv.pool.num_free_blocks == 3


def test_pool_allocate_and_uncache():
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.cache(blk, 123)
    assert pool.lookup(123) is blk
    pool.uncache([blk])
    assert pool.lookup(123) is None and blk.block_hash is None
    pool.free([blk])
    assert pool.num_free_blocks == 2


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    a = seq("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    kv.free(a)
    assert kv.get_computed_blocks(seq("b", [1, 2, 3, 4, 5])) == (([],), 0)


def test_sliding_window_holds_only_the_windows_blocks():
    """A request four windows long holds at most ceil(W / block_size) + 1 blocks at every step (the bound of
    issue 28): the blocks that left its window go back to the pool, the null block in their place, their
    hashes kept, so the same prefix later is still a hit."""
    window, bs = 32, 16
    kv = KVCacheManager(num_blocks=24, block_size=bs, specs=(SlidingWindowSpec(window),))
    assert kv.null_block.block_id == 0 and kv.pool.num_free_blocks == 23
    a = seq("a", range(1, 41))
    assert kv.allocate_slots(a, 40)  # a 40-token prompt in one chunk
    a.num_computed_tokens = 40
    bound = -(-window // bs) + 1
    while len(a.all_token_ids) < 4 * window:  # decode one token at a time
        a.all_token_ids.append(len(a.all_token_ids) + 1)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        assert kv.num_held_blocks("a") <= bound
        assert kv.pool.num_free_blocks == 23 - kv.num_held_blocks("a")
    (table,) = kv.block_ids("a")
    assert table[: (a.num_computed_tokens - window) // bs] == [0] * ((a.num_computed_tokens - window) // bs)
    kv.free(a)
    assert kv.pool.num_free_blocks == 23 and not kv.num_skipped
    b = seq("b", a.all_token_ids)
    hits, n = kv.get_computed_blocks(b)
    assert n == (len(b.all_token_ids) - 1) // bs * bs  # every block of the prefix, freed or not, still cached
    assert kv.allocate_slots(b, len(b.all_token_ids) - n, hits)
    assert kv.num_held_blocks("b") <= bound  # the hit's blocks before the window go straight back
    kv.free(b)
    assert kv.pool.num_free_blocks == 23


def test_kv_cache_groups_of_uniform_and_mixed_models():
    """One group when every layer is of one kind; vLLM's uniform-size groups when kinds mix (full first)."""
    assert kv_cache_groups((), 4) == [KVCacheGroupSpec((0, 1, 2, 3), FullAttentionSpec())]
    assert kv_cache_groups((8,) * 3, 3) == [KVCacheGroupSpec((0, 1, 2), SlidingWindowSpec(8))]
    gemma2 = kv_cache_groups((8, None) * 3, 6)  # alternating: one group per kind
    assert gemma2 == [
        KVCacheGroupSpec((1, 3, 5), FullAttentionSpec()),
        KVCacheGroupSpec((0, 2, 4), SlidingWindowSpec(8)),
    ]
    gemma3 = kv_cache_groups([None if (i + 1) % 6 == 0 else 512 for i in range(26)], 26)  # Gemma-3-1B: 22 + 4
    assert [g.layer_indices for g in gemma3[:2]] == [(5, 11, 17, 23), (0, 1, 2, 3)]
    assert [len(g.layer_indices) for g in gemma3] == [4, 4, 4, 4, 4, 4, 2]
    assert sorted(i for g in gemma3 for i in g.layer_indices) == list(range(26))
    assert kv_cache_groups([None] * 9 + [4] * 10, 19)[0].layer_indices == tuple(range(9))  # 10 < 1.25 * 9: size 10


def test_mixed_model_frees_only_its_sliding_groups_blocks_and_hits_its_cache():
    """A model mixing global and sliding layers (Gemma): the full group keeps every block of a request four
    windows long, its sliding group holds at most ceil(W / block_size) + 1 at every step; after it finishes,
    the same prefix hits both groups (the sliding one only its last blocks, null before); once the sliding
    group's last blocks are evicted, the hit falls back to what both groups still have."""
    window, bs = 8, 4
    kv = KVCacheManager(num_blocks=40, block_size=bs, specs=(FullAttentionSpec(), SlidingWindowSpec(window)))
    a = seq("a", range(1, 11))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bound = -(-window // bs) + 1
    while len(a.all_token_ids) < 4 * window:
        a.all_token_ids.append(len(a.all_token_ids) + 1)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        full, sliding = kv.req_blocks["a"]
        assert len(full) == -(-len(a.all_token_ids) // bs) and kv.null_block not in full
        assert sum(b is not kv.null_block for b in sliding) <= bound
        assert kv.pool.num_free_blocks == 39 - kv.num_held_blocks("a")
    assert len({b.block_id for b in kv.held_blocks("a")}) == kv.num_held_blocks("a")  # no block in two groups
    kv.free(a)
    assert kv.pool.num_free_blocks == 39
    b = seq("b", a.all_token_ids)
    (full, sliding), n = kv.get_computed_blocks(b)
    assert n == (len(b.all_token_ids) - 1) // bs * bs == len(full) * bs == len(sliding) * bs
    seen = -(-(window - 1) // bs)  # the blocks the first computed query sees
    assert kv.null_block not in sliding[-seen:] and all(blk is kv.null_block for blk in sliding[:-seen])
    assert kv.allocate_slots(b, len(b.all_token_ids) - n, (full, sliding))
    assert sum(blk is not kv.null_block for blk in kv.req_blocks["b"][1]) <= bound
    kv.free(b)
    # evict the sliding group's copy of the last two full blocks: the hit shrinks to where it has a window
    for h in b.block_hashes[n // bs - 2 : n // bs]:
        kv.pool.uncache([kv.pool.lookup(kv._key(1, h))])
    (full, sliding), m = kv.get_computed_blocks(seq("c", a.all_token_ids))
    assert m == n - 2 * bs and len(full) == len(sliding) == m // bs
    assert kv.null_block not in sliding[-seen:]


def test_longest_request_that_fits_counts_every_groups_blocks():
    """max_model_len is capped to what one request can hold: all its blocks in a full group, at most the
    window's and a step's in a sliding one (so a model that only slides is not capped by the cache)."""
    full, sliding = FullAttentionSpec(), SlidingWindowSpec(32)
    one = [KVCacheGroupSpec((0,), full)]
    assert max_request_tokens(one, 10, 16, 64, 4096) == 160
    mixed = [KVCacheGroupSpec((0,), full), KVCacheGroupSpec((1,), sliding)]
    # a sliding group holds at most ceil((32 - 1 + 64) / 16) + 1 = 7 blocks; one is the null block
    assert blocks_per_request(mixed, 1000, 16, 64) == 63 + 7
    assert max_request_tokens(mixed, 71, 16, 64, 4096) == 63 * 16
    assert max_request_tokens([KVCacheGroupSpec((0,), sliding)], 8, 16, 64, 4096) == 4096
    assert max_request_tokens(mixed, 2, 16, 64, 4096) == 0  # the null block and one more: no token fits


def test_recurrent_layers_hold_one_state_slot_per_request():
    """LFM2-like: attention layers 2 and 4 in one group, the conv layers' states last (MambaSpec): a request takes
    one slot at its first allocation whatever its length and gives it back when freed (finished or preempted);
    with every slot taken an allocation fails and changes nothing; the slot is no KV block (not in the pool's
    counts); prefix caching is refused."""
    groups = kv_cache_groups([None] * 5, 5, (0, 1, 3))
    assert groups == [KVCacheGroupSpec((2, 4), FullAttentionSpec()), KVCacheGroupSpec((0, 1, 3), MambaSpec())]
    assert blocks_per_request(groups, 40, 4, 8) == 10  # the attention group's blocks only
    specs = tuple(g.kv_cache_spec for g in groups)
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(16, 4, True, specs, 2)
    kv = KVCacheManager(16, 4, False, specs, num_state_slots=2)
    a, b, c = seq("a", range(10)), seq("b", range(3)), seq("c", range(5))
    assert kv.allocate_slots(a, 10) and kv.allocate_slots(b, 3)
    assert [len(t) for t in kv.req_blocks["a"]] == [3, 1] and kv.state_pool.num_free_blocks == 0
    assert kv.num_held_blocks("a") == 3 and kv.pool.num_free_blocks == 16 - 3 - 1
    assert not kv.allocate_slots(c, 5) and "c" not in kv.req_blocks and kv.pool.num_free_blocks == 12
    a.num_computed_tokens = 10
    before = kv.table_lengths("a")
    slot = kv.block_ids("a")[1]
    assert kv.allocate_slots(a, 3)  # a fourth KV block, the same state slot
    assert kv.block_ids("a", before) == ([kv.req_blocks["a"][0][-1].block_id], []) and kv.block_ids("a")[1] == slot
    kv.free(b)
    assert kv.state_pool.num_free_blocks == 1 and kv.allocate_slots(c, 5)
    kv.free(a), kv.free(c)
    assert kv.state_pool.num_free_blocks == 2 and kv.pool.num_free_blocks == 16
