"""KV pool sizing and allocation of the per-layer paged K/V tensors.

Runs in: each Worker process.

Layout (the same on CPU and GPU): each layer owns one K and one V tensor of shape
``[num_kv_heads, num_blocks, block_size, head_dim]`` (head-major). A token's *slot* is
``block_id * block_size + offset``; viewing a cache as ``[num_kv_heads, num_blocks * block_size,
head_dim]`` makes the slot a plain index on dim 1. Head-major is chosen for the CPU path: a
gather of whole blocks along dim 1 (`index_select`) yields ``[num_kv_heads, B, ctx, head_dim]``
already contiguous, which is exactly the batch layout of one `matmul` over (kv head, request),
so no permute copy is needed after the gather. The Triton kernels and the C kernels
(`vx.gpu.cpu.library`) take strides and do not care.

Sizing: bytes per block = 2 (K and V) x layers x kv_heads x head_dim x block_size x dtype size,
counting this tensor-parallel rank's kv heads only.

KV-cache groups (`kv_cache_groups`, vLLM's `KVCacheGroupSpec` with its equal-size groups): a
model whose layers attend in different ways (Gemma 2/3: global layers beside sliding-window
ones) has its layers grouped by kind, each kind cut into groups of `group_size` layers, the
fewest layers any kind has (a kind's last group may be short). The engine keeps one block
table per group over one pool (`vx.core.hybrid_kv_cache_manager`). Memory: `group_size` K/V
tensor pairs ("slots") of the pool's size; the layer at position j of its group uses slot j,
so a block id is one layer's K/V in each slot, and every group's blocks cost the same
(`group_size` layers): the pool's blocks, the scheduler's one budget and the memory held
agree, and a block a windowed group frees is a block any group can take. A model of one kind
of layer has one group (`group_size` = its layers): the layout above, unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vx import envs
from vx.config import BLOCK_SIZE
from vx.gpu.cpu.pages import advise_huge

logger = logging.getLogger(__name__)

__all__ = [
    "GroupKVCache",
    "KVCache",
    "KVCacheGroups",
    "allocate_kv_caches",
    "block_bytes",
    "kv_cache_groups",
    "layer_caches",
    "num_cpu_blocks",
    "num_gpu_blocks",
]

#: One layer's (K, V), each [num_kv_heads, num_blocks, block_size, head_dim]. On CPU the
#: memory is block-major ([num_blocks, num_kv_heads, ...] transposed; ``VX_KV_LAYOUT=head``:
#: head-major, for A/B timing); every kernel takes the strides, rows of head_dim contiguous.
KVCache = tuple[torch.Tensor, torch.Tensor]


class GroupKVCache(tuple):
    """One layer's (K, V) in a model of several KV-cache groups, and `group`: the group
    whose block table addresses it (the attention reads that group's metadata,
    `vx.gpu.attention.metadata.AttentionMetadata.for_cache`)."""

    group: int

    def __new__(cls, k: torch.Tensor, v: torch.Tensor, group: int) -> GroupKVCache:
        self = super().__new__(cls, (k, v))
        self.group = group
        return self


@dataclass(frozen=True)
class KVCacheGroups:
    """How a model's layers share the KV pool (see the module docstring).

    Invariants: `windows[g]` is group g's window (None: global), global groups first; layer i
    is in group `layer_group[i]` at slot `layer_slot[i]` < `group_size`; no two layers of one
    group share a slot.
    """

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    group_size: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def kv_cache_groups(windows: Sequence[int | None]) -> KVCacheGroups:
    """Group layers by their window (None: global): one group when every layer attends
    alike, else per kind groups of the fewest layers any kind has, global kinds first."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    if len(kinds) <= 1:
        n = len(windows)
        return KVCacheGroups((windows[0] if n else None,), (0,) * n, tuple(range(n)), n)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    group_windows: list[int | None] = []
    layer_group, layer_slot = [0] * len(windows), [0] * len(windows)
    for w in order:
        layers = kinds[w]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(w)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


def layer_caches(
    slots: list[KVCache], groups: KVCacheGroups, start: int, end: int
) -> list[KVCache]:
    """Layers [start, end)'s caches over the slots (`GroupKVCache`s where the model has
    several groups; the slots themselves where it has one)."""
    if groups.num_groups == 1:
        return slots
    return [
        GroupKVCache(*slots[groups.layer_slot[i]], groups.layer_group[i])
        for i in range(start, end)
    ]


def block_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = BLOCK_SIZE,
) -> int:
    """Bytes one KV block takes across every layer (K and V), on one rank."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * block_size * itemsize


def num_cpu_blocks(kv_cache_memory_bytes: int, block_bytes: int) -> int:
    """CPU: as many whole blocks as the configured byte budget holds."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    return kv_cache_memory_bytes // block_bytes


def num_gpu_blocks(
    total_bytes: int,
    utilization: float,
    weight_bytes: int,
    activation_peak_bytes: int,
    block_bytes: int,
) -> int:
    """GPU: blocks that fit in `utilization` of the device after weights and activations.

    Worked example (the seeds'): Llama 3.1 8B on an 80 GB H100 at 0.92, 8,030,261,248 bf16
    parameters (16.06 GB) and no activation peak: (73.6e9 - 16.06e9) / 2 MiB = 27,436 blocks,
    439K tokens, at most 107 sequences of 4,096 tokens.
    Returns 0 (never negative) when nothing is left for the cache; the caller reports that.
    """
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    budget = math.floor(total_bytes * utilization) - weight_bytes - activation_peak_bytes
    return max(budget, 0) // block_bytes


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    block_size: int = BLOCK_SIZE,
) -> list[KVCache]:
    """Zero-filled K and V tensors for every layer.

    NOTE: zero-filled, not `empty`: attention reads whole blocks and masks the slots past a
    request's length, and a NaN left in uninitialised memory would survive the mask
    (0 * NaN is NaN in the probabilities-times-V product).
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if torch.device(device).type == "cpu" and envs.VX_KV_LAYOUT == "block":
        # Block-major in memory: a block's K (or V) rows for every head are one run of
        # Hkv * BS * D values, so the decode attention, which takes a request's heads one
        # after another, reads its blocks in runs of 6 KB (SmolLM2) instead of 2 KB.
        # In 2 MiB pages (`vx.gpu.cpu.pages.advise_huge`, before the zeros fault them in): a
        # decode step reads a few KB from each of thousands of scattered blocks, one TLB miss
        # apiece in 4 KiB pages (measured at 64 rows x 192 keys over a 4 GiB pool on the AMX
        # host; docs/performance.md).
        def zeros() -> torch.Tensor:
            t = torch.empty(
                (num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device
            )
            advise_huge(t)
            return t.zero_().transpose(0, 1)
    else:
        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
    caches = [(zeros(), zeros()) for _ in range(num_layers)]
    logger.debug("allocated %d layers of KV %s %s on %s", num_layers, shape, dtype, device)
    return caches
