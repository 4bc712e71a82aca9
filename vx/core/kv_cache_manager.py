"""The KV cache manager: which blocks each request holds, prefix-cache lookups and caching.

Runs in: EngineCore. One KV-cache group and one block size; the BlockPool below it owns the
blocks themselves. A model with layers of different kinds (global beside windowed) gets
`vx.core.hybrid_kv_cache_manager.HybridKVCacheManager`, a table per group over the same pool.

Sliding windows (vLLM's SlidingWindowManager, for the one case one group can take): when
every layer of the model attends within a window of W keys (`sliding_window`), a query at
position p reads only keys (p - W, p], so once a request has computed n tokens its keys
before n - W + 1 are never read again. `allocate_slots` then frees the blocks wholly before
that point back to the pool and puts `NULL_BLOCK` in their places, so positions keep their
blocks' indices (the Worker's table keeps the old ids there; its attention never reads them).
A model with global layers beside windowed ones (Gemma 2/3) has a KV-cache group per kind of
layer (`HybridKVCacheManager`), whose windowed groups free by the same rule.
Prefix caching stays correct: a freed block keeps its hash and its contents until the pool
reuses it, which drops the hash, so a hit never finds a block holding other tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from vx.config import BLOCK_SIZE
from vx.core.block_pool import NULL_BLOCK, BlockPool, BlockPoolStatistics, KVCacheBlock
from vx.core.request import Request

__all__ = ["KVCacheManager", "PrefixCacheStatistics"]

#: Returned by `allocate_slots` when no block was added. Shared and read-only: never mutate it.
NO_NEW_BLOCKS: list[int] = []


class BlockTable(list[KVCacheBlock]):
    """A request's blocks in position order, plus how many of the first ones are cached.

    A list subclass so one dict lookup on the decode path yields both. Its first
    `num_freed` entries are `NULL_BLOCK`: blocks freed after they slid out of the window.
    """

    __slots__ = ("num_cached_blocks", "num_freed")

    def __init__(self) -> None:
        super().__init__()
        self.num_cached_blocks = 0
        self.num_freed = 0


class PrefixCacheStatistics(NamedTuple):
    """Counters in tokens, as vLLM's `vllm:prefix_cache_queries` / `_hits`."""

    #: Prompt tokens looked up at first admission (resumed requests are counted apart).
    queries: int
    hits: int
    preempted_queries: int
    preempted_hits: int


class KVCacheManager:
    """Maps requests to their KV blocks (a block table that only grows until `free`).

    Token layout of a request for `allocate_slots`:
    ``[computed | new prefix hits | new tokens]``; blocks are held for all of it.

    Invariants: ``req_to_blocks[id]`` covers ``request.num_computed_tokens`` positions (plus
    whatever was just scheduled); its first `num_cached_blocks` blocks are full of known
    tokens and hashed (in the pool's map, or a duplicate left unhashed); a prefix hit
    never covers a request's last known token, so at least one token is always scheduled.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        enable_caching: bool = True,
        kv_events_medium: str | None = None,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        #: Every layer's window (keys; the widest where they differ), or None: some layer
        #: attends to the whole context, and a request keeps all its blocks.
        self.sliding_window = sliding_window if sliding_window and sliding_window > 0 else None
        self.block_pool = BlockPool(num_blocks, enable_caching, kv_events_medium, block_size)
        self.req_to_blocks: dict[str, BlockTable] = {}
        self._queries = self._hits = 0
        self._preempted_queries = self._preempted_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request`: (blocks, number of tokens they cover).

        Walks the hash chain until the first miss (a later block cannot hit once an earlier one
        missed). Stops one token short of the known tokens: the last token is always
        recomputed, because its logits are what the step samples from.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.cached_block_hash_to_block.get
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        *,
        full_sequence_must_fit: bool = False,
    ) -> list[int] | None:
        """Hold blocks for `num_new_tokens` more positions after the computed ones and hits.

        Returns the ids of the blocks added (hits first, then fresh blocks; `NO_NEW_BLOCKS`
        when none), or None when the pool cannot supply them, in which case nothing changed.
        With `full_sequence_must_fit`, it also refuses unless every known token of the request
        would fit (vLLM's full-prompt admission gate against preemption storms), while still
        allocating only for this chunk. Full blocks of known tokens are cached as they fill.
        """
        bs = self.block_size
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if blocks is not None and self.sliding_window is not None:
            self._free_out_of_window(request, blocks)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if (
            blocks is not None
            and num_total <= len(blocks) * bs
            and not new_computed_blocks
            and not full_sequence_must_fit
        ):
            # Decode fast path: the tokens fit in blocks already held.
            if self.enable_caching:
                num_known = request.num_tokens
                num_full = (num_total if num_total < num_known else num_known) // bs
                if num_full > blocks.num_cached_blocks:
                    self._cache_full_blocks(request, blocks, num_full)
            return NO_NEW_BLOCKS

        num_held = 0 if blocks is None else len(blocks)
        hits = new_computed_blocks or ()
        num_hits = len(hits)
        num_new_blocks = max(-(-num_total // bs) - num_held - num_hits, 0)
        num_to_fit = num_new_blocks
        if full_sequence_must_fit:
            num_to_fit = max(num_to_fit, -(-request.num_tokens // bs) - num_held - num_hits)
        # Touching an evictable hit takes it out of the free queue, so it counts against it.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        pool = self.block_pool
        if num_to_fit + num_evictable_hits > pool.get_num_free_blocks():
            return None

        if blocks is None:
            blocks = self.req_to_blocks[request_id] = BlockTable()
        if hits:
            pool.touch(hits)
            blocks.extend(hits)
            # Hit blocks are cached already (they came from the map).
            blocks.num_cached_blocks += num_hits
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            if request.num_computed_tokens == 0:
                self._record_prefix_query(request, num_new_computed_tokens)
            num_full = min(num_total, request.num_tokens) // bs
            if num_full > blocks.num_cached_blocks:
                self._cache_full_blocks(request, blocks, num_full)
        if not hits and not new_blocks:
            return NO_NEW_BLOCKS
        return [b.block_id for b in hits] + [b.block_id for b in new_blocks]

    def _free_out_of_window(self, request: Request, blocks: BlockTable) -> None:
        """Free the blocks whose keys every later query's window has left: those before
        ``num_computed_tokens - W + 1`` (the next query's first key; an in-flight step reads
        before a reused block is written). With async drafts the count less the in-flight
        draft slots (`Request.num_draft_slots`): where they are rejected, the Worker's next
        query comes that much earlier. Full blocks are cached before this (they filled steps
        ago)."""
        assert self.sliding_window is not None
        first = request.num_computed_tokens - request.num_draft_slots
        dead = (first - self.sliding_window + 1) // self.block_size
        if dead > len(blocks):
            dead = len(blocks)
        start = blocks.num_freed
        if dead <= start:
            return
        if self.enable_caching and blocks.num_cached_blocks < dead:
            num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
            if num_full > blocks.num_cached_blocks:
                self._cache_full_blocks(request, blocks, num_full)
        # the latest first: the oldest (the longest-shared prefixes) are evicted last
        self.block_pool.free_blocks(reversed(blocks[start:dead]))
        blocks[start:dead] = [NULL_BLOCK] * (dead - start)
        blocks.num_freed = dead

    def max_tokens_alone(self, max_chunk_tokens: int) -> int:
        """The longest context one request alone can hold (every position a block)."""
        return self.num_blocks * self.block_size

    def group_tables(self, request_id: str) -> list[BlockTable]:
        """The block tables of `request_id`, one per KV-cache group (here one; [] if none)."""
        blocks = self.req_to_blocks.get(request_id)
        return [] if blocks is None else [blocks]

    def num_held_blocks(self, request_id: str) -> int:
        """The pool blocks `request_id` holds now (freed window blocks not counted)."""
        blocks = self.req_to_blocks.get(request_id)
        return 0 if blocks is None else len(blocks) - blocks.num_freed

    def _cache_full_blocks(self, request: Request, blocks: BlockTable, num_full: int) -> None:
        self.block_pool.cache_full_blocks(
            blocks, request.block_hashes, blocks.num_cached_blocks, num_full,
            request.all_token_ids, request.lora_id,
        )  # fmt: skip
        blocks.num_cached_blocks = num_full

    def _record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        if request.num_preemptions:
            self._preempted_queries += request.num_tokens
            self._preempted_hits += num_hit_tokens
        else:
            self._queries += request.num_tokens
            self._hits += num_hit_tokens

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the full blocks among the first `num_tokens` positions (tokens known by now)."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            return
        num_full = min(num_tokens, request.num_tokens, len(blocks) * self.block_size)
        num_full //= self.block_size
        if num_full > blocks.num_cached_blocks:
            self._cache_full_blocks(request, blocks, num_full)

    def free_past(self, request: Request, num_tokens: int) -> int:
        """Release the blocks of `request` past the first `num_tokens` positions (a step's
        rejected drafts: those positions hold nothing it will read, and the scheduler holds
        blocks again when it schedules tokens there); returns how many. Never a cached block
        (cached blocks hold computed known tokens, all within `num_tokens`)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        if keep < blocks.num_cached_blocks:
            raise RuntimeError(f"{request}: freeing cached blocks past {num_tokens} tokens")
        gone = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(gone))
        return len(gone)

    def free(self, request: Request) -> None:
        """Release every block of `request`, last block first (it is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[blocks.num_freed :]))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any request holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def prefix_cache_statistics(self) -> PrefixCacheStatistics:
        return PrefixCacheStatistics(
            self._queries, self._hits, self._preempted_queries, self._preempted_hits
        )

    def statistics(self) -> BlockPoolStatistics:
        return self.block_pool.statistics()
