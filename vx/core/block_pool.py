"""The KV block pool: every physical KV block, its reference count and the prefix-cache map.

Runs in: EngineCore. The workers own the KV tensors; this module only decides which block ids
hold what. Nothing here allocates Python objects per block operation: the free queue is an
intrusive doubly linked list threaded through the blocks themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from vx.config import BLOCK_SIZE
from vx.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_hash

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "BlockPoolStatistics",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "group_block_states",
]


class KVCacheBlock:
    """One physical KV block.

    Invariants: ``ref_cnt == 0`` iff the block is in the free queue (`prev_free`/`next_free`
    are its links there, None otherwise); `block_hash` is set iff the block is in the pool's
    hash map under that hash (a full block whose tokens are known), whether free or in use.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


#: The place of a block a request freed after it slid out of every window (id -1, in no pool,
#: never hashed, never freed): block tables keep their positions. vLLM's null block.
NULL_BLOCK = KVCacheBlock(-1)


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order: the head is evicted (reused) first.

    A hand-made doubly linked list with two sentinels, because a prefix hit must pull a block
    out of the *middle* in O(1), and `collections.deque` cannot. Freed blocks go to the tail,
    so eviction is least-recently-freed first. Initially ordered by block id.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; for tests and self-checks (O(n))."""
        out = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPoolStatistics(NamedTuple):
    #: All blocks in the pool.
    num_blocks: int
    #: Blocks in the free queue (reusable now), cached or not.
    num_free_blocks: int
    #: Free blocks that still hold a hash (evictable prefix-cache entries).
    num_cached_free_blocks: int
    #: Blocks in the hash map, free or in use.
    num_cached_blocks: int
    #: Fraction of blocks in use by requests, 0..1.
    usage: float


class BlockPool:
    """Owns every `KVCacheBlock`, the free queue and the hash -> block map.

    Invariants (`check_invariants`): every block is either in the free queue with
    ``ref_cnt == 0`` or out of it with ``ref_cnt > 0``; the free queue's links and count are
    consistent; the map and the blocks' `block_hash` fields agree one to one;
    `num_cached_free_blocks` counts the hashed blocks in the free queue. Eviction is lazy: a
    freed block keeps its hash until it is reused from the head of the queue.

    With `kv_events_medium` set, every change to the map is also recorded, in order, as a
    router's KV event (`vx/core/kv_events.py`) until `take_events`: a block entering the map
    (`BlockStored`, one per run of consecutive blocks), leaving it when its block is reused
    (`BlockRemoved`), the whole map dropped (`AllBlocksCleared`). Without it nothing is.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        kv_events_medium: str | None = None,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_cached_free_blocks = 0
        self._medium = kv_events_medium
        self._block_size = block_size
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] | None = (
            None if kv_events_medium is None else []
        )

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The KV events recorded since the last call, oldest first ([] when off)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their hashes; ref_cnt 1."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        cache_map = self.cached_block_hash_to_block
        removed: list[int] | None = None if self._events is None else []
        for block in blocks:
            if block.block_hash is not None:
                # a hybrid manager's other groups key by a longer hash, never announced
                if removed is not None and len(block.block_hash) == 32:
                    removed.append(external_hash(block.block_hash))
                del cache_map[block.block_hash]
                block.block_hash = None
                self.num_cached_free_blocks -= 1
            block.ref_cnt = 1
        if removed and self._events is not None:
            self._events.append(BlockRemoved(block_hashes=removed, medium=self._medium))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0:
                queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the tail in the given order.

        Callers pass a request's blocks in reverse, so its last blocks (the longest, least
        shareable prefixes) are evicted first.
        """
        queue = self.free_block_queue
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] = (),
        lora_id: int | None = None,
        record_events: bool = True,
    ) -> None:
        """Register blocks ``[num_cached_blocks, num_full_blocks)`` of a request under their hashes.

        A block that came from a prefix hit already holds its hash. When another block already
        holds the same hash, this one stays unhashed: block tables are append-only, so the
        request keeps its own copy, and the map keeps one block per hash. `token_ids` (the
        request's tokens) and `lora_id` are read only for the KV events (none without
        `record_events`: a hybrid manager's groups past the first).
        """
        if not self.enable_caching:
            return
        cache_map = self.cached_block_hash_to_block
        stored: list[int] | None = None if self._events is None or not record_events else []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is None and block is not NULL_BLOCK:
                block_hash = block_hashes[i]
                if block_hash not in cache_map:
                    cache_map[block_hash] = block
                    block.block_hash = block_hash
                    if stored is not None:
                        stored.append(i)
        if stored:
            self._record_stored(stored, block_hashes, token_ids, lora_id)

    def _record_stored(
        self,
        indices: list[int],
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        lora_id: int | None,
    ) -> None:
        """One `BlockStored` per run of consecutive newly mapped blocks (a block whose hash
        another block holds already breaks a run: that hash was announced then)."""
        assert self._events is not None
        size = self._block_size
        start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            first, last = indices[start], indices[k - 1]
            self._events.append(
                BlockStored(
                    block_hashes=[external_hash(h) for h in block_hashes[first : last + 1]],
                    parent_block_hash=external_hash(block_hashes[first - 1]) if first else None,
                    token_ids=list(token_ids[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_id=lora_id,
                    medium=self._medium,
                )
            )
            start = k

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_free_blocks = 0
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def statistics(self) -> BlockPoolStatistics:
        return BlockPoolStatistics(
            num_blocks=self.num_blocks,
            num_free_blocks=self.free_block_queue.num_free_blocks,
            num_cached_free_blocks=self.num_cached_free_blocks,
            num_cached_blocks=len(self.cached_block_hash_to_block),
            usage=self.get_usage(),
        )

    def block_states(self) -> bytes:
        """One byte per block, by block id: b"u" in use, b"c" free but still holding a prefix
        (evictable), b"." free. Read-only, O(num_blocks): the dashboard's
        block map, fetched only while someone watches it."""
        return bytes(
            [117 if b.ref_cnt else 46 if b.block_hash is None else 99 for b in self.blocks]
        )

    def check_invariants(self) -> list[str]:
        """Walk every structure (O(num_blocks)); return the problems found, [] when sound."""
        problems: list[str] = []
        queue = self.free_block_queue
        seen: set[int] = set()
        prev = queue._head
        block = prev.next_free
        while block is not None and block is not queue._tail:
            if block.block_id in seen:
                problems.append(f"block {block.block_id} twice in the free queue")
                break
            seen.add(block.block_id)
            if block.prev_free is not prev:
                problems.append(f"block {block.block_id} has a broken prev link")
            if block.ref_cnt != 0:
                problems.append(f"free block {block.block_id} has ref_cnt {block.ref_cnt}")
            prev, block = block, block.next_free
        if block is None:
            problems.append("free queue does not reach its tail")
        if len(seen) != queue.num_free_blocks:
            problems.append(f"free queue holds {len(seen)} blocks, counts {queue.num_free_blocks}")
        num_cached_free = 0
        for b in self.blocks:
            in_queue = b.block_id in seen
            if not in_queue and b.ref_cnt <= 0:
                problems.append(f"block {b.block_id} is neither free nor referenced")
            if not in_queue and (b.prev_free is not None or b.next_free is not None):
                problems.append(f"block {b.block_id} is in use but keeps free-queue links")
            if b.block_hash is not None:
                if self.cached_block_hash_to_block.get(b.block_hash) is not b:
                    problems.append(f"block {b.block_id} has a hash the map does not hold")
                num_cached_free += in_queue
        for h, b in self.cached_block_hash_to_block.items():
            if b.block_hash != h:
                problems.append(f"map entry for block {b.block_id} disagrees with its hash")
        if num_cached_free != self.num_cached_free_blocks:
            problems.append(
                f"{num_cached_free} cached free blocks, counter says {self.num_cached_free_blocks}"
            )
        return problems


def group_block_states(states: bytes, max_cells: int, max_groups: int = 4096) -> tuple[int, str]:
    """Fold `BlockPool.block_states()` into cells for a map view.

    Returns (group_size, cells). A pool of at most `max_cells` blocks (or any pool when
    max_cells < 1) keeps one cell per block: group_size 1 and the states as text. A bigger pool
    is cut into at most `max_groups` cells of group_size consecutive blocks (the last one may
    hold fewer), each two hex digits: the cell's in-use share, then its cached-free share, in
    15ths, rounded up so that a single block never reads as none. (Fewer groups than cells:
    each group costs the engine a microsecond or so.)
    """
    n = len(states)
    if max_cells < 1 or n <= max_cells:
        return 1, states.decode("ascii")
    group_size = -(-n // max(1, min(max_cells, max_groups)))
    digits = "0123456789abcdef"
    count = states.count
    parts = []
    for start in range(0, n, group_size):
        end = start + group_size
        size = min(group_size, n - start)
        parts.append(digits[-(-15 * count(117, start, end) // size)])  # b"u"
        parts.append(digits[-(-15 * count(99, start, end) // size)])  # b"c"
    return group_size, "".join(parts)
