"""The per-step attention metadata: what every layer's attention reads, built once a step by
`vx.gpu.attention.paged.build_attention_metadata`.

Runs in: each Worker process. Its own module so that the attention backends (the CPU path in
`vx.gpu.attention.paged`, the Triton kernels in `vx.gpu.attention.triton`) share it without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["AttentionMetadata", "PrefillChunk"]


@dataclass(eq=False)
class PrefillChunk:
    """One request with more than one query token (CPU path)."""

    #: Token range of this chunk in the flattened batch.
    start: int
    end: int
    num_computed: int
    #: Blocks holding the context [0, num_computed + q_len); None when num_computed == 0.
    block_ids: torch.Tensor | None
    #: [q_len, ctx] bool, True = attend; None when num_computed == 0 (plain causal).
    mask: torch.Tensor | None


@dataclass(eq=False)
class AttentionMetadata:
    """What every layer's attention needs for one step; built once, read by all layers.

    Invariants: requests ``[0, num_decodes)`` have query length 1 and own tokens
    ``[0, num_decodes)``; `query_start_loc[-1] == num_tokens`; every slot in `slot_mapping`
    lies in a block listed in its request's `block_table` row; ``seq_lens[i]`` is the
    context length after this step's tokens (computed + scheduled).
    """

    num_tokens: int
    num_reqs: int
    num_decodes: int
    #: [T] int64: cache slot (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    #: [R + 1] int32 cumulative query lengths.
    query_start_loc: torch.Tensor
    #: [R] int32 context lengths including this step's tokens.
    seq_lens: torch.Tensor
    #: [R, max_blocks] int32, the block tables cut to the widest row needed this step.
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # ── CPU decode path ──
    #: True: the C kernel reads `decode_block_table`/`decode_seq_lens`; False: the torch
    #: fallback reads `decode_block_ids`/`decode_mask`.
    decode_kernel: bool = False
    #: [num_decodes, decode_num_blocks] int32 (contiguous) and [num_decodes] int32.
    decode_block_table: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    #: [num_decodes * decode_num_blocks] int64 blocks to gather (padded rows repeat block 0).
    decode_block_ids: torch.Tensor | None = None
    decode_num_blocks: int = 0
    #: [1, num_decodes, 1, decode_num_blocks * block_size] bool, True = attend.
    decode_mask: torch.Tensor | None = None
    # ── CPU prefill path ──
    prefills: list[PrefillChunk] = field(default_factory=list)
    #: For the C prefill kernel (bf16: AMX, or AVX2), one call for every chunk: [P] int32 first
    #: token, query length and cached tokens of each chunk, and [P, blocks] int32 block table
    #: rows; None where the kernel is not available here.
    prefill_starts: torch.Tensor | None = None
    prefill_lens: torch.Tensor | None = None
    prefill_computed: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None
    # ── Triton path ──
    #: [num_tiles] int32 request index and first query token (in the request) of each tile.
    tile_req: torch.Tensor | None = None
    tile_q_start: torch.Tensor | None = None
    tile_block_m: int = 16
    #: Per-step scratch (the decode gather buffers), shared by all layers of the step.
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Several KV-cache groups (`vx.gpu.kv_cache.kv_cache_groups`): every group's metadata
    #: (this one is group 0's), each over its own block table and slots; None: one group.
    groups: list[AttentionMetadata] | None = None

    def for_cache(self, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> AttentionMetadata:
        """The metadata of the group whose table addresses `kv_cache` (a layer's; a
        `GroupKVCache` names its group)."""
        groups = self.groups
        return self if groups is None else groups[kv_cache.group]  # type: ignore[attr-defined]
