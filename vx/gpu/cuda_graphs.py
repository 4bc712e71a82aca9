"""CUDA graphs for uniform decode batches: the "full" half of vLLM's FULL_AND_PIECEWISE mode.

Runs in: each Worker process (CUDA devices; the CPU replay stand-in exists for the tests).

A decode step of a small batch is launch-bound: an 8B Llama runs ~10 kernels a layer, 32
layers, and at batch 1 the GPU finishes each kernel faster than Python can launch the next.
A captured graph replays the whole forward as one launch. Graphs have fixed shapes and fixed
addresses, so:

- one graph is captured per *capture size* (`cudagraph_capture_sizes`: 1, 2, 4, then steps of
  8 to 248, then steps of 16 up to min(2 x max_num_seqs, 512): 51 sizes at the defaults);
- every graph reads one set of persistent input buffers (`StaticDecodeInputs`: token ids,
  positions, slot mapping, sequence lengths, block tables, and the constant query offsets and
  Triton tile maps of a uniform decode batch) and writes its own output buffer;
- a batch of B decodes runs in the graph of the next size P >= B (37 runs padded in 40):
  `fill_padded_decode_inputs` copies the B real rows into the buffers and turns rows
  [B, P) into padding: slot -1 (the KV write skips it, so padding never touches the cache)
  and sequence length 0 (attention reads no block and yields zeros), token and position 0;
- a step that scores drafts (speculative decoding) is such a batch too: each of a request's
  1 + k rows is a decode row of the attention (`ModelRunner.prepare_inputs`), so it replays
  the graph of its row count;
- batches that mix prefills, and decode batches above the largest size, run eagerly (vLLM
  runs these as piecewise graphs around attention; vx does not capture pieces).

`--enforce-eager` (EngineConfig.enforce_eager) turns graphs off; tensor parallelism does too
for now (the NCCL all-reduce inside a captured graph is not validated here).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vx.config import BLOCK_SIZE
from vx.gpu.attention.paged import AttentionMetadata

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_CAPTURE_SIZE",
    "PAD_SLOT_ID",
    "CudaGraphRunner",
    "StaticDecodeInputs",
    "capture_cuda_graphs",
    "cudagraph_capture_sizes",
    "fill_padded_decode_inputs",
    "padded_batch_size",
]

#: vLLM's cap on the largest captured batch.
MAX_CAPTURE_SIZE = 512
#: Slot of a padding row: the Triton KV write skips negative slots.
PAD_SLOT_ID = -1


def cudagraph_capture_sizes(max_num_seqs: int, max_size: int | None = None) -> list[int]:
    """[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), cut at `max_size`
    (default min(2 x max_num_seqs, 512)): 51 sizes when the cap is 512."""
    if max_size is None:
        max_size = min(2 * max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, MAX_CAPTURE_SIZE + 1, 16)]
    return [s for s in sizes if s <= max_size]


def padded_batch_size(num_reqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= num_reqs (sizes ascending), or None if none is."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) and num_reqs >= 1 else None


@dataclass(eq=False)
class StaticDecodeInputs:
    """The persistent buffers every captured graph reads (allocated once, never reallocated).

    Invariants: `query_start_loc` is ``arange(max_size + 1)``, `tile_req` ``arange(max_size)``
    and `tile_q_start` zeros (a uniform decode batch: request i owns token i, one Triton tile
    each); after `fill_padded_decode_inputs(size=P)` rows [0, P) of the other buffers hold the
    batch and its padding. Rows >= P are stale and no graph of size P reads them.
    """

    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    slot_mapping: torch.Tensor  # [max_size] int64
    seq_lens: torch.Tensor  # [max_size] int32
    block_table: torch.Tensor  # [max_size, max_blocks_per_req] int32
    query_start_loc: torch.Tensor  # [max_size + 1] int32
    tile_req: torch.Tensor  # [max_size] int32
    tile_q_start: torch.Tensor  # [max_size] int32

    @classmethod
    def allocate(
        cls, max_size: int, max_blocks_per_req: int, device: torch.device | str
    ) -> StaticDecodeInputs:
        def z(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        static = cls(
            input_ids=z(max_size, dtype=torch.int64),
            positions=z(max_size, dtype=torch.int64),
            slot_mapping=torch.full((max_size,), PAD_SLOT_ID, dtype=torch.int64, device=device),
            seq_lens=z(max_size, dtype=torch.int32),
            block_table=z(max_size, max(max_blocks_per_req, 1), dtype=torch.int32),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
            tile_req=torch.arange(max_size, dtype=torch.int32, device=device),
            tile_q_start=z(max_size, dtype=torch.int32),
        )
        return static

    @property
    def max_size(self) -> int:
        return self.input_ids.shape[0]

    def metadata(self, size: int, tile_block_m: int = 16) -> AttentionMetadata:
        """Attention metadata over the first `size` rows (views: a replay sees every refill)."""
        return AttentionMetadata(
            num_tokens=size,
            num_reqs=size,
            num_decodes=size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            max_query_len=1,
            max_seq_len=self.block_table.shape[1] * BLOCK_SIZE,
            tile_req=self.tile_req[:size],
            tile_q_start=self.tile_q_start[:size],
            tile_block_m=tile_block_m,
        )


def fill_padded_decode_inputs(
    static: StaticDecodeInputs,
    size: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """Copy a decode batch of B rows into rows [0, B) of `static` and pad rows [B, size).

    Device-agnostic (plain torch copies and fills on whatever device `static` lives on).
    Padding rows get token 0, position 0, slot `PAD_SLOT_ID` and sequence length 0, so a graph
    replayed over them writes no KV and reads none; their outputs are discarded.
    """
    b = input_ids.shape[0]
    if not 1 <= b <= size <= static.max_size:
        raise ValueError(f"cannot pad a batch of {b} to {size} (buffers hold {static.max_size})")
    width = block_table.shape[1]
    if width > static.block_table.shape[1]:
        raise ValueError(f"block table of width {width} exceeds {static.block_table.shape[1]}")
    static.input_ids[:b].copy_(input_ids, non_blocking=True)
    static.positions[:b].copy_(positions, non_blocking=True)
    static.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
    static.seq_lens[:b].copy_(seq_lens, non_blocking=True)
    # Columns past `width` keep stale ids: a row's attention stops at its own sequence length.
    static.block_table[:b, :width].copy_(block_table, non_blocking=True)
    if size > b:
        static.input_ids[b:size].zero_()
        static.positions[b:size].zero_()
        static.slot_mapping[b:size].fill_(PAD_SLOT_ID)
        static.seq_lens[b:size].zero_()


class _CudaGraph:
    """One captured forward: `replay()` reruns it and returns its (fixed) output buffer."""

    def __init__(self, graph: Any, output: torch.Tensor) -> None:
        self.graph, self.output = graph, output

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class _RerunGraph:
    """The CPU stand-in (tests): "replay" calls the forward again over the same buffers."""

    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self.forward = forward

    def replay(self) -> torch.Tensor:
        return self.forward()


class CudaGraphRunner:
    """Per-size captured forwards of one model over its KV caches, for decode-only batches.

    Invariants: captured after the KV caches exist (graphs hold their addresses) and never
    re-captured; every graph reads only `self.static` and `kv_caches`; `forward` refills the
    buffers for the padded size before each replay and returns the first B rows of the output,
    which stay valid until the next call.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        sizes: Sequence[int],
        max_blocks_per_req: int,
        device: torch.device | str,
        tile_block_m: int = 16,
    ) -> None:
        if not sizes:
            raise ValueError("no capture sizes")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(set(sizes))
        self.device = torch.device(device)
        self.tile_block_m = tile_block_m
        self.static = StaticDecodeInputs.allocate(self.sizes[-1], max_blocks_per_req, device)
        self.graphs: dict[int, _CudaGraph | _RerunGraph] = {}
        self.num_replays = 0
        self._pool: Any = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first (the later ones fit in the first's memory pool).
        Returns the seconds it took."""
        t0 = time.perf_counter()
        for size in reversed(self.sizes):
            self.graphs[size] = self._capture_one(size)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _capture_one(self, size: int) -> _CudaGraph | _RerunGraph:
        s = self.static
        md = s.metadata(size, self.tile_block_m)
        ids, pos = s.input_ids[:size], s.positions[:size]
        # All rows are padding during capture: the warm-up writes no KV and reads none.
        s.slot_mapping[:size].fill_(PAD_SLOT_ID)
        s.seq_lens[:size].zero_()

        def forward() -> torch.Tensor:
            return self.model(ids, pos, self.kv_caches, md)

        if self.device.type != "cuda":
            return _RerunGraph(forward)
        # The warm-up compiles the Triton kernels (no compilation may happen in a capture).
        forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward()
        if self._pool is None:
            self._pool = graph.pool()
        return _CudaGraph(graph, out)

    def padded_size(self, md: AttentionMetadata) -> int | None:
        """The graph size for this step, or None when it must run eagerly."""
        if md.num_reqs == 0 or md.num_decodes != md.num_reqs:
            return None
        return padded_batch_size(md.num_reqs, self.sizes)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        md: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's forward for this step: a graph replay when one fits, else eager.
        `keep` (rows to return; see LlamaModel.forward) always runs eagerly."""
        size = self.padded_size(md) if keep is None else None
        graph = self.graphs.get(size) if size is not None else None
        if graph is None or kv_caches is not self.kv_caches:
            return self.model(input_ids, positions, kv_caches, md, keep)
        fill_padded_decode_inputs(
            self.static, size, input_ids, positions, md.slot_mapping, md.seq_lens, md.block_table
        )
        self.num_replays += 1
        return graph.replay()[: md.num_reqs]


class GraphedRunner(Protocol):
    """What `capture_cuda_graphs` reads of the ModelRunner (after its KV init)."""

    config: Any  # vx.config.EngineConfig
    device: torch.device
    max_model_len: int
    model: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


def capture_cuda_graphs(runner: GraphedRunner) -> CudaGraphRunner | None:
    """Build and capture the graphs for `runner` (after its KV init), or None when graphs are
    off: not CUDA, `enforce_eager`, tensor parallelism, or a model whose forward syncs with the
    host (mixture of experts: `vx.gpu.layers.fused_moe`)."""
    config = runner.config
    if runner.device.type != "cuda" or config.enforce_eager:
        return None
    if config.parallel.tensor_parallel_size > 1:
        logger.info("CUDA graphs are off under tensor parallelism; running eagerly")
        return None
    if not getattr(runner.model, "graph_capturable", True):
        logger.info("CUDA graphs are off: this model's forward reads values back to the host")
        return None
    sizes = cudagraph_capture_sizes(config.scheduler.max_num_seqs)
    max_blocks = -(-runner.max_model_len // config.cache.block_size)
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, sizes, max_blocks, runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    seconds = graphs.capture()
    logger.info(
        "captured %d CUDA graphs (decode batches %d..%d) in %.1f s, %.0f MiB",
        len(sizes), sizes[0], sizes[-1], seconds,
        (torch.cuda.memory_allocated(runner.device) - before) / 2**20,
    )  # fmt: skip
    return graphs
