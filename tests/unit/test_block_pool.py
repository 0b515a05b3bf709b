"""Block pool and KV cache manager invariants: hash chain, LRU eviction order, ref counts."""

from types import SimpleNamespace

from engine.core.kv_cache_manager import BlockPool, KVCacheManager, hash_block


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
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(a, 5)
    assert len(kv.req_blocks["a"]) == 3
    assert len(kv.pool.cached) == 2  # two full blocks; the half block is not cached
    b = seq("b", [1, 2, 3, 4, 9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and hits == kv.req_blocks["a"][:2]
    assert kv.allocate_slots(b, 2, hits)
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [2, 2, 1]
    assert kv.prefix_cache_queries == 11 and kv.prefix_cache_hits == 4
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.req_blocks["b"]] == [1, 1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == 8 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = seq("a", [1, 2, 3, 4])
    kv.allocate_slots(a, 4)
    kv.free(a)
    hits, n = kv.get_computed_blocks(seq("b", [1, 2, 3, 4]))
    assert n == 2 and len(hits) == 1  # the second block holds the last token: recomputed


def test_freed_blocks_keep_hash_and_lru_evicts_tails_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = seq("a", range(1, 9))
    assert kv.allocate_slots(a, 8)
    ids = kv.block_ids("a")
    kv.free(a)
    # freed tail first, so the request's last block is the first to be evicted
    assert list(kv.pool.free_queue) == ids[::-1]
    assert len(kv.pool.cached) == 4
    b = seq("b", [1, 2, 3, 4, 99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    assert kv.allocate_slots(b, 2, hits)
    assert kv.block_ids("b") == ids[:2] + [ids[3]]  # took the LRU block: a's tail
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
    assert kv.get_computed_blocks(seq("b", [1, 2, 3, 4, 5])) == ([], 0)


def test_sliding_window_holds_only_the_windows_blocks():
    """A request four windows long holds at most ceil(W / block_size) + 1 blocks at every step (the bound of
    issue 28): the blocks that left its window go back to the pool, the null block in their place, their
    hashes kept, so the same prefix later is still a hit."""
    window, bs = 32, 16
    kv = KVCacheManager(num_blocks=24, block_size=bs, sliding_window=window)
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
    table = kv.block_ids("a")
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
