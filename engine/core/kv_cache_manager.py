"""The paged KV cache's bookkeeping: a block pool with automatic prefix caching, and block tables.

After vLLM v1's KVCacheManager/BlockPool (PagedAttention, Kwon et al. SOSP 2023). A full block is
identified by a chained hash of (parent block's hash, its token ids), so equal prefixes map to equal
blocks. Blocks are ref-counted; a block whose count drops to zero keeps its hash and joins an LRU
free queue, so a later request with the same prefix can take it back; it loses its hash only when
allocation evicts it.

With a sliding window (every layer of the model attends to the last W positions: Mistral, Phi-3), a
request's blocks that lie wholly before the window of its next queries are freed as it advances, as vLLM's
SlidingWindowManager does: in the block table they become the null block (never allocated, never read, as
the attention kernels start at the window), and they keep their hash, so a later request can still hit
them. A request then holds at most ceil(W / block_size) + 1 blocks beyond the tokens of its step.
"""

from collections import OrderedDict
from dataclasses import dataclass


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
    """Block tables of the running requests, over one `BlockPool`.

    Requests are objects with `request_id`, `all_token_ids` (prompt + output), `num_computed_tokens`
    and `block_hashes` (a list this manager extends as blocks fill). Counters are in tokens.
    `sliding_window`: the window of every layer (vLLM's SlidingWindowSpec), None for full attention (or a
    model that mixes both: its blocks are kept whole); with one, block 0 is the null block.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int | None = None
    ):
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.null_block: Block | None = None
        if sliding_window is not None:  # never handed out: stands for the blocks that left the window
            self.null_block = self.pool.free_queue.pop(0)
        self.num_skipped: dict[str, int] = {}  # leading blocks of a request freed as out of its window
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request registered in the cache
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free; the null block is none)."""
        return 1.0 - self.pool.num_free_blocks / (self.num_blocks - (self.null_block is not None))

    def get_computed_blocks(self, request) -> tuple[list[Block], int]:
        """The longest cached prefix of a new request: (blocks, number of tokens they hold).

        The last token is always left to compute (its logits are needed), so a hit covers at most
        len - 1 tokens.
        """
        tokens = request.all_token_ids
        self._update_hashes(request, len(tokens))
        hits = []
        if self.pool.enable_caching:
            for h in request.block_hashes[: (len(tokens) - 1) // self.block_size]:
                block = self.pool.lookup(h)
                if block is None:
                    break
                hits.append(block)
        self.prefix_cache_queries += len(tokens)
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        computed_blocks: list[Block] = (),
        delay_cache: bool = False,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Gives `request` blocks for `num_new_tokens` more tokens (after `computed_blocks`, if it is
        new) and `num_lookahead_tokens` after those (where a draft model writes the K/V of its proposals,
        vLLM's lookahead slots). Returns False, changing nothing, when too few blocks are free. Blocks that
        the new tokens fill are registered in the prefix cache at once: their K/V is written in this step,
        before any later step can read them. New tokens past `request.all_token_ids` (draft tokens
        of speculative decoding, which may be rejected) get slots, but their blocks are registered
        only once a later call finds them verified. With `delay_cache` (K/V that arrives later, from a
        KV transfer) nothing is registered: `cache_blocks` does it once the K/V has arrived.
        """
        blocks = self.req_blocks.get(request.request_id, [])
        if blocks and self.sliding_window is not None:
            self.remove_skipped_blocks(request, request.num_computed_tokens)
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = -(-(num_tokens + num_lookahead_tokens) // self.block_size) - len(blocks) - len(computed_blocks)
        # cached blocks we are about to touch are counted in the free queue but are not available
        reviving = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reviving:
            return False
        self.pool.touch(list(computed_blocks))
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        num_verified = min(num_tokens, len(request.all_token_ids))
        self._update_hashes(request, num_verified)
        if not delay_cache:
            self.cache_blocks(request, num_verified)
        if computed_blocks and self.sliding_window is not None:  # a hit reaching past the first window
            self.remove_skipped_blocks(request, len(computed_blocks) * self.block_size)
        return True

    def remove_skipped_blocks(self, request, num_computed_tokens: int) -> None:
        """Frees the request's blocks that no query from position `num_computed_tokens` on can see (they end
        before its window), putting the null block in their place (vLLM's name). They keep their hash."""
        blocks = self.req_blocks[request.request_id]
        first_seen = max(0, num_computed_tokens - self.sliding_window + 1)  # the first key a next query sees
        skipped = min(first_seen // self.block_size, len(blocks))
        start = self.num_skipped.get(request.request_id, 0)
        freed = []
        for i in range(start, skipped):
            freed.append(blocks[i])
            blocks[i] = self.null_block
        self.pool.free(freed)
        self.num_skipped[request.request_id] = max(start, skipped)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks a request holds (the null block not counted)."""
        return sum(b is not self.null_block for b in self.req_blocks.get(request_id, ()))

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Registers in the prefix cache the request's blocks that its first `num_tokens` tokens fill
        and that are not registered yet, once their K/V is in the cache."""
        blocks = self.req_blocks[request.request_id]
        first = self.num_cached_blocks.get(request.request_id, 0)  # blocks before it are registered
        last = num_tokens // self.block_size
        for i in range(first, last):
            if blocks[i] is not self.null_block:
                self.pool.cache(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(first, last)

    def _update_hashes(self, request, num_tokens: int) -> None:
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, tuple(tokens[i * bs : (i + 1) * bs])))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def free(self, request, uncache: bool = False) -> None:
        """Releases all blocks of a request, tail first. `uncache` also drops their prefix-cache
        hashes (their K/V may be garbage after a failed step)."""
        blocks = [b for b in self.req_blocks.pop(request.request_id, []) if b is not self.null_block]
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_skipped.pop(request.request_id, None)
        if uncache:
            self.pool.uncache([b for b in blocks if b.ref_cnt == 1])
        self.pool.free(list(reversed(blocks)))
