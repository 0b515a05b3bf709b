"""The paged KV cache's bookkeeping: a block pool with automatic prefix caching, and block tables.

After vLLM v1's KVCacheManager/BlockPool (PagedAttention, Kwon et al. SOSP 2023). A full block is
identified by a chained hash of (parent block's hash, its token ids), so equal prefixes map to equal
blocks. Blocks are ref-counted; a block whose count drops to zero keeps its hash and joins an LRU
free queue, so a later request with the same prefix can take it back; it loses its hash only when
allocation evicts it.

A request has one block table per KV cache group (engine.core.kv_cache_spec: the layers of one attention
kind), all over one pool, as in vLLM v1's hybrid KV cache manager. In a sliding-window group (its layers
attend to the last W positions: Mistral, Phi-3, Gemma's local layers) a request's blocks that lie wholly
before the window of its next queries are freed as it advances, as vLLM's SlidingWindowManager does: in the
block table they become the null block (never allocated, never read, as the attention kernels start at the
window), and they keep their hash, so a later request can still hit them. A request then holds at most
ceil(W / block_size) + 1 blocks of such a group beyond the tokens of its step.

A model with recurrent layers (MambaSpec: LFM2's short convolutions) has one more group, last, whose table holds
a single state slot per request, taken from a pool of `num_state_slots` at the request's first allocation and
given back when it is freed (finished or preempted; a preempted request computes its state again from its first
token, as prefix caching is off for such models).
"""

from collections import OrderedDict
from dataclasses import dataclass

from engine.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MambaSpec


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: equal only for equal token prefixes (up to hash collisions)."""
    return hash((parent_hash, token_ids))


class BlockPool:
    """`num_blocks` KV blocks: ref counts, the hash -> block map, and the LRU free queue.

    Free blocks (ref_cnt 0) sit in `free_queue` oldest first; allocation takes from the front, and
    evicts a taken block's hash. `touch` revives a cached free block for a new owner.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self.enable_caching = enable_caching

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[Block]:
        """Takes n blocks from the front of the free queue. Raises ValueError if fewer are free."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Adds an owner to each block (prefix-cache hits), taking free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drops an owner from each block; blocks reaching zero go to the back of the LRU queue, in
        the given order (callers pass a request's blocks tail first, so tails are evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, block: Block, block_hash: int) -> None:
        """Registers a just-filled block under its hash (first writer wins for duplicates)."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def uncache(self, blocks: list[Block]) -> None:
        """Forgets the hashes of blocks whose contents cannot be trusted (a failed step)."""
        for block in blocks:
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None


class KVCacheManager:
    """Block tables of the running requests, one per KV cache group, over one `BlockPool`.

    Requests are objects with `request_id`, `all_token_ids` (prompt + output), `num_computed_tokens`
    and `block_hashes` (a list this manager extends as blocks fill). Counters are in tokens.
    `specs`: each group's KVCacheSpec (one FullAttentionSpec by default); where one slides, block 0 is the
    null block. Block lists go per group: `req_blocks[request_id][g]`, `block_ids` a tuple of lists, a prefix
    hit a tuple of lists of equal length. A full block is cached under its hash in group 0, and under a hash
    of (group, its hash) in group g > 0, since each group holds its own K/V of the same tokens. A MambaSpec
    group (the last; `state_group`) lists the request's state slot, from `state_pool` of `num_state_slots`.
    Raises ValueError for a MambaSpec group with prefix caching on.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        specs: tuple[KVCacheSpec, ...] = (FullAttentionSpec(),),
        num_state_slots: int = 0,
    ):
        self.block_size = block_size
        self.windows = tuple(s.sliding_window for s in specs)
        self.state_group = next((g for g, s in enumerate(specs) if isinstance(s, MambaSpec)), None)
        if self.state_group is not None and enable_caching:
            raise ValueError("prefix caching is not built for models with recurrent (state) layers")
        self.state_pool = BlockPool(num_state_slots, enable_caching=False)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.null_block: Block | None = None
        if any(w is not None for w in self.windows):  # never handed out: stands for blocks that left the window
            self.null_block = self.pool.free_queue.pop(0)
        self.req_blocks: dict[str, tuple[list[Block], ...]] = {}
        self.num_skipped: dict[str, list[int]] = {}  # per group: leading blocks freed as out of its window
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request registered in the cache
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free; the null block is none)."""
        return 1.0 - self.pool.num_free_blocks / (self.num_blocks - (self.null_block is not None))

    def _key(self, group: int, block_hash: int) -> int:
        return block_hash if group == 0 else hash((group, block_hash))

    def get_computed_blocks(self, request) -> tuple[tuple[list[Block], ...], int]:
        """The longest cached prefix of a new request: (each group's blocks, number of tokens they hold).

        The last token is always left to compute (its logits are needed), so a hit covers at most
        len - 1 tokens. A full-attention group needs every block of the prefix; a sliding one only those
        its first computed query sees (the others are the null block). With several groups the hit is the
        longest every group has: each group searches within the last one's hit until all agree (vLLM's
        HybridKVCacheCoordinator).
        """
        tokens = request.all_token_ids
        self._update_hashes(request, len(tokens))
        n = (len(tokens) - 1) // self.block_size if self.pool.enable_caching else 0
        hits: list[list[Block]] = [[] for _ in self.windows]
        while n:
            m = n
            for g in range(self.num_groups):
                hits[g] = self._find_hit(g, request.block_hashes[:m])
                m = len(hits[g])
            if m == n:
                break
            n = m
        self.prefix_cache_queries += len(tokens)
        self.prefix_cache_hits += n * self.block_size
        return tuple(h[:n] for h in hits), n * self.block_size

    def _find_hit(self, group: int, hashes: list[int]) -> list[Block]:
        """Group `group`'s longest hit within `hashes`: the cached blocks from the start (full attention), or
        the last run of ceil((W - 1) / block_size) cached blocks, null before it (vLLM's SlidingWindowManager)."""
        window = self.windows[group]
        if window is None:
            hits = []
            for h in hashes:
                block = self.pool.lookup(self._key(group, h))
                if block is None:
                    break
                hits.append(block)
            return hits
        need = max(1, -(-(window - 1) // self.block_size))
        hits, run = [self.null_block] * len(hashes), 0
        for i in range(len(hashes) - 1, -1, -1):
            block = self.pool.lookup(self._key(group, hashes[i]))
            if block is None:
                run = 0
                continue
            hits[i], run = block, run + 1
            if run >= need:
                return hits[: i + run]
        return hits[:run]  # the run from block 0: the whole (short) prefix

    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        computed_blocks: tuple[list[Block], ...] | None = None,
        delay_cache: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Gives `request` blocks in every group for `num_new_tokens` more tokens (after `computed_blocks`, a
        prefix hit, if it is new) and `num_lookahead_tokens` after those (where a draft model writes the K/V
        of its proposals, vLLM's lookahead slots). Returns False, changing nothing, when too few blocks are
        free. Blocks that the new tokens fill are registered in the prefix cache at once: their K/V is written
        in this step, before any later step can read them. New tokens past `request.all_token_ids` (draft
        tokens of speculative decoding, which may be rejected) get slots, but their blocks are registered
        only once a later call finds them verified. With `delay_cache` (K/V that arrives later, from a
        KV transfer) nothing is registered: `cache_blocks` does it once the K/V has arrived.
        """
        rid = request.request_id
        tables = self.req_blocks.get(rid)
        if tables is not None:
            self.remove_skipped_blocks(request, request.num_computed_tokens)
        computed = computed_blocks or tuple([] for _ in self.windows)
        num_tokens = request.num_computed_tokens + len(computed[0]) * self.block_size + num_new_tokens
        total = -(-(num_tokens + num_lookahead_tokens) // self.block_size)
        held = tables or tuple([] for _ in self.windows)
        need = [max(0, total - len(held[g]) - len(computed[g])) for g in range(self.num_groups)]
        state = self.state_group
        if state is not None:  # one state slot, from its own pool
            need[state] = 0
            if not held[state] and not self.state_pool.num_free_blocks:
                return False
        hit_blocks = [b for blocks in computed for b in blocks if b is not self.null_block]
        # cached blocks we are about to touch are counted in the free queue but are not available
        reviving = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if sum(need) > self.pool.num_free_blocks - reviving:
            return False
        self.pool.touch(hit_blocks)
        tables = self.req_blocks.setdefault(rid, held)
        for g, blocks in enumerate(tables):
            blocks.extend(computed[g])
            if need[g]:
                blocks.extend(self.pool.allocate(need[g]))
        if state is not None and not tables[state]:
            tables[state].extend(self.state_pool.allocate(1))
        num_verified = min(num_tokens, len(request.all_token_ids))
        self._update_hashes(request, num_verified)
        if not delay_cache:
            self.cache_blocks(request, num_verified)
        if computed_blocks and self.null_block is not None:  # a hit reaching past the first window
            self.remove_skipped_blocks(request, len(computed[0]) * self.block_size)
        return True

    def remove_skipped_blocks(self, request, num_computed_tokens: int) -> None:
        """Frees the request's blocks in sliding-window groups that no query from position
        `num_computed_tokens` on can see (they end before its window), putting the null block in their place
        (vLLM's name). They keep their hash."""
        tables = self.req_blocks[request.request_id]
        skipped_so_far = self.num_skipped.setdefault(request.request_id, [0] * self.num_groups)
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            blocks = tables[g]
            first_seen = max(0, num_computed_tokens - window + 1)  # the first key a next query sees
            skipped = min(first_seen // self.block_size, len(blocks))
            freed = []
            for i in range(skipped_so_far[g], skipped):
                if blocks[i] is not self.null_block:
                    freed.append(blocks[i])
                    blocks[i] = self.null_block
            self.pool.free(freed)
            skipped_so_far[g] = max(skipped_so_far[g], skipped)

    def held_blocks(self, request_id: str) -> list[Block]:
        """The KV blocks a request holds, group after group (the null block and a state slot not counted)."""
        tables = self.req_blocks.get(request_id, ())
        return [
            b for g, blocks in enumerate(tables) if g != self.state_group for b in blocks if b is not self.null_block
        ]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks a request holds in all groups (the null block not counted)."""
        return len(self.held_blocks(request_id))

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Registers in the prefix cache the request's blocks that its first `num_tokens` tokens fill
        and that are not registered yet, once their K/V is in the cache."""
        tables = self.req_blocks[request.request_id]
        first = self.num_cached_blocks.get(request.request_id, 0)  # blocks before it are registered
        last = num_tokens // self.block_size
        for g, blocks in enumerate(tables):
            if g == self.state_group:
                continue
            for i in range(first, last):
                if blocks[i] is not self.null_block:
                    self.pool.cache(blocks[i], self._key(g, request.block_hashes[i]))
        self.num_cached_blocks[request.request_id] = max(first, last)

    def _update_hashes(self, request, num_tokens: int) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(tokens[i * bs : (i + 1) * bs])))

    def block_ids(self, request_id: str, after: tuple[int, ...] | None = None) -> tuple[list[int], ...]:
        """Each group's block table of a request (empty lists when it holds none); with `after` (the tables'
        lengths before an allocation, table_lengths), only each table's blocks past them."""
        tables = self.req_blocks.get(request_id) or tuple([] for _ in self.windows)
        after = after or (0,) * len(tables)
        return tuple([b.block_id for b in blocks[k:]] for blocks, k in zip(tables, after))

    def table_lengths(self, request_id: str) -> tuple[int, ...]:
        """The length of each group's block table of a request (zeros when it holds none)."""
        return tuple(len(blocks) for blocks in self.req_blocks.get(request_id, ())) or (0,) * self.num_groups

    def free(self, request, uncache: bool = False) -> None:
        """Releases all blocks of a request, each group's tail first. `uncache` also drops their prefix-cache
        hashes (their K/V may be garbage after a failed step)."""
        tables = self.req_blocks.pop(request.request_id, ())
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_skipped.pop(request.request_id, None)
        for g, table in enumerate(tables):
            if g == self.state_group:
                self.state_pool.free(table)
                continue
            blocks = [b for b in table if b is not self.null_block]
            if uncache:
                self.pool.uncache([b for b in blocks if b.ref_cnt == 1])
            self.pool.free(list(reversed(blocks)))
