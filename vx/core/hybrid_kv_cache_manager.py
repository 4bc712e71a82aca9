"""The hybrid KV cache manager: one block table per KV-cache group, every group drawing from
one block pool (vLLM's `HybridKVCacheCoordinator` over its `FullAttentionManager` and
`SlidingWindowManager`s).

Runs in: EngineCore. Used for a model whose layers attend in different ways (Gemma 2 and 3:
global layers beside sliding-window ones); a model of one kind of layer keeps the one-group
`KVCacheManager`.

The Worker groups the layers (`vx.gpu.kv_cache.kv_cache_groups`): by kind (global, or window
W), each kind cut into groups of the same number of layers, so that one block id's memory is
one layer's K/V slot in each of that many tensors, whatever the group. The groups reach this
manager as their windows (`group_windows`, None for global; global groups first).

Per request every group holds a table of the same length (the positions it covers); a global
group keeps every block, a windowed group of window W gives back, each step, the blocks wholly
before key ``num_computed - W + 1`` and leaves `NULL_BLOCK` in their places (block ids -1 on
the wire). The scheduler sees one budget: a step needs the sum of its groups' new blocks.

Prefix caching: each group caches its own full blocks under its own key (the block's hash,
plus the group's index past group 0), so a block never answers for another group. A hit of n
blocks needs, in every global group, blocks 0..n-1, and in a windowed group only the last
ceil((W - 1) / block_size) of them, the keys the first recomputed query reads (vLLM's
`find_longest_cache_hit`): its earlier positions come back as `NULL_BLOCK`. Only group 0
(global) announces KV events.
"""

from __future__ import annotations

from collections.abc import Sequence

from vx.config import BLOCK_SIZE
from vx.core.block_pool import NULL_BLOCK, KVCacheBlock
from vx.core.kv_cache_manager import NO_NEW_BLOCKS, BlockTable, KVCacheManager
from vx.core.request import Request

__all__ = ["HybridKVCacheManager"]


class _GroupHashes(Sequence[bytes]):
    """A request's block hashes as group `group`'s cache keys (the hash and the group byte)."""

    __slots__ = ("_hashes", "_suffix")

    def __init__(self, hashes: Sequence[bytes], group: int) -> None:
        self._hashes, self._suffix = hashes, bytes([group])

    def __len__(self) -> int:
        return len(self._hashes)

    def __getitem__(self, i):  # type: ignore[override]
        return self._hashes[i] + self._suffix


class HybridKVCacheManager(KVCacheManager):
    """Maps requests to one block table per KV-cache group, all from one pool.

    Invariants: ``req_to_groups[id]`` holds one `BlockTable` per group, all of one length
    (``req_to_blocks[id]`` is group 0's); a global group's table holds no `NULL_BLOCK`; a
    windowed group's first `num_freed` entries are `NULL_BLOCK` and its others are live; a
    block is in one group's table only (keys differ per group).
    """

    def __init__(
        self,
        num_blocks: int,
        group_windows: Sequence[int | None],
        block_size: int = BLOCK_SIZE,
        enable_caching: bool = True,
        kv_events_medium: str | None = None,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching, kv_events_medium)
        windows = [w if w and w > 0 else None for w in group_windows]
        if len(windows) < 2 or windows[0] is not None:
            raise ValueError(f"a hybrid KV cache needs global group 0 and more: {windows}")
        if len(windows) > 255:
            raise ValueError("at most 255 KV-cache groups")
        #: per group: its window (keys), or None (global)
        self.group_windows: tuple[int | None, ...] = tuple(windows)
        self.num_groups = len(windows)
        self._windowed = [(g, w) for g, w in enumerate(windows) if w is not None]
        #: the distinct windows, each with its groups and the blocks a hit must end with
        self._window_kinds: dict[int, tuple[list[int], int]] = {}
        for g, w in self._windowed:
            groups, _ = self._window_kinds.get(w, ([], 0))
            groups.append(g)
            self._window_kinds[w] = (groups, -(-(w - 1) // block_size))
        self._global = [g for g, w in enumerate(windows) if w is None]
        self.req_to_groups: dict[str, list[BlockTable]] = {}

    # ───────────────────────── budget ─────────────────────────

    def max_tokens_alone(self, max_chunk_tokens: int) -> int:
        """The longest context one request alone can hold: a global group holds all of it, a
        windowed one at most its window and a chunk (vLLM's `max_memory_usage_bytes`)."""
        bs = self.block_size
        caps = [-(-(w - 1 + max_chunk_tokens) // bs) + 1 for _, w in self._windowed]
        lo, hi = 0, self.num_blocks
        while lo < hi:  # the most blocks per global group that fit
            mid = (lo + hi + 1) // 2
            need = len(self._global) * mid + sum(min(mid, c) for c in caps)
            lo, hi = (mid, hi) if need <= self.num_blocks else (lo, mid - 1)
        return lo * bs

    # ───────────────────────── prefix hits ─────────────────────────

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest prefix every group holds: (blocks of every group, group-major, each
        group's `n` in a row; tokens covered). A windowed group's entries before its last
        ceil((W - 1) / block_size) are `NULL_BLOCK`."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        bs = self.block_size
        hashes = request.block_hashes[: (request.num_tokens - 1) // bs]
        get = self.block_pool.cached_block_hash_to_block.get
        suffixes = [b"" if g == 0 else bytes([g]) for g in range(self.num_groups)]
        n = 0
        for h in hashes:  # global groups: the plain prefix
            if any(get(h + suffixes[g]) is None for g in self._global):
                break
            n += 1
        while n:  # windowed: each kind's longest hit within n; again until all agree
            shortest = n
            for groups, need in self._window_kinds.values():
                shortest = min(shortest, self._window_hit(hashes, n, groups, need, suffixes))
            if shortest == n:
                break
            n = shortest
        if not n:
            return [], 0
        out: list[KVCacheBlock] = []
        for g, w in enumerate(self.group_windows):
            suffix = suffixes[g]
            first = 0 if w is None else max(0, n - self._window_kinds[w][1])
            out.extend([NULL_BLOCK] * first)
            out.extend(get(h + suffix) for h in hashes[first:n])  # type: ignore[misc]
        return out, n * bs

    def _window_hit(
        self, hashes: list[bytes], n: int, groups: list[int], need: int, suffixes: list[bytes]
    ) -> int:
        """The largest m <= n whose `need` blocks before it every one of `groups` holds (or
        all of 0..m-1, fewer than `need`, from the start)."""
        if not need:  # a window of one key: the first recomputed query reads only itself
            return n
        get = self.block_pool.cached_block_hash_to_block.get
        run = 0
        for i in range(n - 1, -1, -1):
            h = hashes[i]
            if all(get(h + suffixes[g]) is not None for g in groups):
                run += 1
                if run >= need:
                    return i + need
            else:
                run = 0
        return run

    # ───────────────────────── allocation ─────────────────────────

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        *,
        full_sequence_must_fit: bool = False,
    ) -> list[int] | None:
        """As `KVCacheManager.allocate_slots`, in every group: returns the ids added, group
        by group (each group's hits, with -1 for `NULL_BLOCK`, then its fresh blocks; every
        group adds as many), `NO_NEW_BLOCKS`, or None (nothing changed)."""
        bs = self.block_size
        request_id = request.request_id
        tables = self.req_to_groups.get(request_id)
        if tables is not None:
            self._free_out_of_windows(request, tables)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if (
            tables is not None
            and num_total <= len(tables[0]) * bs
            and not new_computed_blocks
            and not full_sequence_must_fit
        ):
            if self.enable_caching:
                num_full = min(num_total, request.num_tokens) // bs
                for g, table in enumerate(tables):
                    if num_full > table.num_cached_blocks:
                        self._cache_group_blocks(request, g, table, num_full)
            return NO_NEW_BLOCKS

        num_held = 0 if tables is None else len(tables[0])
        hits = new_computed_blocks or ()
        num_hits = len(hits) // self.num_groups
        num_new_blocks = max(-(-num_total // bs) - num_held - num_hits, 0)
        num_to_fit = num_new_blocks * self.num_groups
        if full_sequence_must_fit:
            rest = -(-request.num_tokens // bs) - num_held - num_hits
            for _, w in self._windowed:
                live = -(-(w - 1) // bs) + 1
                num_to_fit += max(min(rest, live), num_new_blocks) - num_new_blocks
            num_to_fit += len(self._global) * (max(rest, num_new_blocks) - num_new_blocks)
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0 and b is not NULL_BLOCK)
        pool = self.block_pool
        if num_to_fit + num_evictable_hits > pool.get_num_free_blocks():
            return None

        if tables is None:
            tables = [BlockTable() for _ in range(self.num_groups)]
            self.req_to_groups[request_id] = tables
            self.req_to_blocks[request_id] = tables[0]
        if num_hits:  # every group's hits out of the free queue before any fresh block
            pool.touch([b for b in hits if b is not NULL_BLOCK])
        ids: list[int] = []
        for g, table in enumerate(tables):
            if num_hits:
                mine = hits[g * num_hits : (g + 1) * num_hits]
                live = [b for b in mine if b is not NULL_BLOCK]
                table.extend(mine)
                if not table.num_freed and len(live) < num_hits:
                    table.num_freed = num_hits - len(live)
                table.num_cached_blocks += num_hits
                ids.extend(b.block_id for b in mine)
            if num_new_blocks:
                new_blocks = pool.get_new_blocks(num_new_blocks)
                table.extend(new_blocks)
                ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            if request.num_computed_tokens == 0:
                self._record_prefix_query(request, num_new_computed_tokens)
            num_full = min(num_total, request.num_tokens) // bs
            for g, table in enumerate(tables):
                if num_full > table.num_cached_blocks:
                    self._cache_group_blocks(request, g, table, num_full)
        return ids or NO_NEW_BLOCKS

    def _free_out_of_windows(self, request: Request, tables: list[BlockTable]) -> None:
        """Each windowed group frees its blocks wholly before its next query's first key
        (`KVCacheManager._free_out_of_window`'s rule, per group: by the computed count less
        the in-flight draft slots, `Request.num_draft_slots`)."""
        bs = self.block_size
        num_computed = request.num_computed_tokens
        first = num_computed - request.num_draft_slots
        for g, w in self._windowed:
            table = tables[g]
            dead = min((first - w + 1) // bs, len(table))
            start = table.num_freed
            if dead <= start:
                continue
            if self.enable_caching and table.num_cached_blocks < dead:
                num_full = min(num_computed, request.num_tokens) // bs
                if num_full > table.num_cached_blocks:
                    self._cache_group_blocks(request, g, table, num_full)
            self.block_pool.free_blocks(reversed(table[start:dead]))
            table[start:dead] = [NULL_BLOCK] * (dead - start)
            table.num_freed = dead

    def _cache_group_blocks(
        self, request: Request, group: int, table: BlockTable, num_full: int
    ) -> None:
        if group == 0:
            self._cache_full_blocks(request, table, num_full)
            return
        self.block_pool.cache_full_blocks(
            table, _GroupHashes(request.block_hashes, group), table.num_cached_blocks,
            num_full, record_events=False,
        )  # fmt: skip
        table.num_cached_blocks = num_full

    def num_held_blocks(self, request_id: str) -> int:
        """The pool blocks `request_id` holds now, every group (freed window blocks not
        counted)."""
        return sum(len(t) - t.num_freed for t in self.req_to_groups.get(request_id, ()))

    def group_tables(self, request_id: str) -> list[BlockTable]:
        return self.req_to_groups.get(request_id, [])

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        tables = self.req_to_groups.get(request.request_id)
        if tables is None:
            return
        num_full = min(num_tokens, request.num_tokens, len(tables[0]) * self.block_size)
        num_full //= self.block_size
        for g, table in enumerate(tables):
            if num_full > table.num_cached_blocks:
                self._cache_group_blocks(request, g, table, num_full)

    def free_past(self, request: Request, num_tokens: int) -> int:
        """Every group's blocks past the first `num_tokens` positions (rejected drafts)."""
        tables = self.req_to_groups.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if not tables or len(tables[0]) <= keep:
            return 0
        num = 0
        for table in tables:
            if keep < table.num_cached_blocks:
                raise RuntimeError(f"{request}: freeing cached blocks past {num_tokens} tokens")
            gone = [b for b in table[keep:] if b is not NULL_BLOCK]
            del table[keep:]
            table.num_freed = min(table.num_freed, keep)
            self.block_pool.free_blocks(reversed(gone))
            num += len(gone)
        return num

    def free(self, request: Request) -> None:
        """Release every group's blocks of `request`, last block first."""
        self.req_to_blocks.pop(request.request_id, None)
        tables = self.req_to_groups.pop(request.request_id, None)
        for table in tables or ():
            self.block_pool.free_blocks(reversed(table[table.num_freed :]))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Every group's ids, group by group (-1: `NULL_BLOCK`)."""
        return [b.block_id for t in self.req_to_groups.get(request_id, ()) for b in t]
