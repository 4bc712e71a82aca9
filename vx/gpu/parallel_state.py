"""The Worker's place in the process grid: its tensor-parallel group and its pipeline stage.

Runs in: each Worker process.

The grid follows vLLM's layout: `world = pp * tp` Workers, global rank `pp_rank * tp + tp_rank`,
so each pipeline stage is `tp` consecutive ranks (one tensor-parallel group) and a stage's
tensor-parallel rank t talks to rank t of the next stage. The layers are split across the
stages as vLLM's `get_pp_indices` splits them, except that the last stage's LM head counts as
the layers it weighs (`get_pp_indices`). The one torch.distributed world (gloo on CPU;
NCCL for CUDA tensors, gloo for the CPU ones) carries the tensor-parallel collectives, inside
a stage's group, and the hidden states and residual from stage to stage (`send_to_next` /
`recv_from_prev`); its CPU side also carries the start-up's pool-size agreement.

Invariant: `init` runs once per process before the model is built; with world size 1 no
process group exists and every collective here is a no-op (or is never called).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from vx import envs

logger = logging.getLogger(__name__)

__all__ = [
    "Grid",
    "get_pp_indices",
    "grid",
    "hand_off_min_tokens",
    "init",
    "irecv_from_next",
    "recv_from_prev",
    "send_to_next",
    "send_to_prev",
    "shift_layers",
    "wait_recv",
]


@dataclasses.dataclass(frozen=True)
class Grid:
    """This Worker's coordinates: `rank = pp_rank * tp_size + tp_rank`."""

    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def driver_rank(self) -> int:
        """The rank that answers the EngineCore: the last stage's tensor-parallel rank 0 (the
        last stage samples)."""
        return (self.pp_size - 1) * self.tp_size


_grid = Grid()
#: This stage's tensor-parallel group; None: the whole world is one TP group (pp 1).
_tp_group = None
#: The send of the previous step's hidden states, still in flight (`send_to_next`).
_pending: list = []
#: Sends to the previous stage still in flight (`send_to_prev`), oldest first.
_pending_prev: list = []
#: Seconds this stage has spent waiting on the previous stage's hidden states, on the next
#: stage's K/V (`wait_recv`) and on its own previous send (`--profile-steps` reports
#: them: the pipeline's bubble).
wait_s = 0.0


def grid() -> Grid:
    return _grid


def tp_group():
    """The group tensor-parallel collectives run in (None: the default world)."""
    return _tp_group


def init(
    *, tp_size: int, pp_size: int, rank: int, init_method: str, backend: str, timeout_s: float
) -> Grid:
    """Join the world (when it has more than one rank) and make the stages' TP groups."""
    global _grid, _tp_group
    import datetime

    import torch.distributed as dist

    _grid = Grid(tp_size=tp_size, pp_size=pp_size, tp_rank=rank % tp_size, pp_rank=rank // tp_size)
    if _grid.world_size == 1:
        return _grid
    # Under torchrun, its agent hosts a store on MASTER_PORT and tells its processes (so ours,
    # which inherit the variable) to join that one; vx's world has its own store, hosted by
    # rank 0 at `init_method`.
    envs.export("TORCHELASTIC_USE_AGENT_STORE", None)
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=_grid.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if pp_size > 1 and tp_size > 1:
        # every rank creates every group, in the same order (torch.distributed's rule)
        for stage in range(pp_size):
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == _grid.pp_rank:
                _tp_group = group
    return _grid


def get_pp_indices(
    num_layers: int, pp_rank: int, pp_size: int, last_stage_extra: float = 0.0
) -> tuple[int, int]:
    """[start, end) of stage `pp_rank`'s layers. `VX_PP_LAYER_PARTITION` sets the counts.

    Otherwise, with `last_stage_extra` (the LM head's cost, in layers: a decode step reads its
    weights as it reads a layer's), the last stage takes the layer count that makes the slowest
    stage fastest, counting the head, and the others split the rest evenly (a tie goes to fewer
    layers before the last stage: on CPU the first stage shares its node with the front). With
    none, vLLM's `get_pp_indices`: an even split, the remainder going one each to the stages
    just before the last (the first holds the embedding, the last the final norm and the head).
    Every stage keeps at least one layer."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the {num_layers} layers")
    from vx import envs

    if envs.VX_PP_LAYER_PARTITION:
        parts = [int(x) for x in envs.VX_PP_LAYER_PARTITION.split(",")]
        if len(parts) != pp_size or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(
                f"VX_PP_LAYER_PARTITION={envs.VX_PP_LAYER_PARTITION!r}: need {pp_size} "
                f"positive counts summing to {num_layers}"
            )
    elif last_stage_extra > 0 and pp_size > 1:

        def slowest(last: int) -> float:
            return max(last + last_stage_extra, -(-(num_layers - last) // (pp_size - 1)))

        last = min(range(num_layers - pp_size + 1, 0, -1), key=slowest)  # ties: the larger
        parts = _even(num_layers - last, pp_size - 1) + [last]
    else:
        parts = _even(num_layers, pp_size)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def hand_off_min_tokens() -> int | None:
    """The fewest prompt tokens a step carries for each stage but the last to hand its last
    layer's o_proj, norm and MLP on to the next stage (`LlamaModel.run_layers`), or None:
    never (`VX_PP_HAND_OFF_TOKENS`; by default every step with a prompt token).

    Why: a decode step is bound by reading weights, and the split (`get_pp_indices`) balances
    those, counting the last stage's LM head; a prompt token is bound by arithmetic, which
    the head hardly adds to (it runs on the sampled rows only), so steps with prompt tokens
    cost an earlier stage more than the last. The part handed on needs no KV cache, so the
    stage after may run it; every stage decides alike from the step's SchedulerOutput."""
    from vx import envs

    n = envs.VX_PP_HAND_OFF_TOKENS
    return None if n is None or n < 0 else n


def shift_layers(num_layers: int, stage: int, pp_size: int, last_stage_extra: float = 0.0) -> int:
    """How many of stage `stage`'s last layers the next stage runs instead on a step that hands
    off (`VX_PP_SHIFT_LAYERS`, at most the stage's layers less one; 0 for the last stage, for
    none, and where nothing hands off). Every stage computes it alike for every edge.

    Why: the split (`get_pp_indices`) balances decode steps, which read weights, and the last
    stage's LM head weighs as much as several layers there; on a step with prompt tokens the
    head runs on the sampled rows only, so an earlier stage has more arithmetic than the last.
    The hand-off moves one layer's o_proj and MLP; shifting the boundary moves whole layers,
    whose K/V both stages then keep (`vx.gpu.pipeline_stage`)."""
    from vx import envs

    if not 0 <= stage < pp_size - 1 or hand_off_min_tokens() is None:
        return 0
    start, end = get_pp_indices(num_layers, stage, pp_size, last_stage_extra)
    return max(0, min(envs.VX_PP_SHIFT_LAYERS, end - start - 1))


def _even(num_layers: int, n: int) -> list[int]:
    """vLLM's split: even, the remainder one each to the parts just before the last."""
    parts = [num_layers // n] * n
    for i in range(2, num_layers % n + 2):
        parts[-i] += 1
    return parts


def send_to_next(tensors: list[torch.Tensor]) -> None:
    """Send this stage's output to the same TP rank of the next stage without waiting for it
    to be received: the previous step's send is completed first (the stage runs on while the
    next one has not yet asked), and the tensors are kept alive until then."""
    import torch.distributed as dist

    _wait_pending()
    dst = _grid.rank + _grid.tp_size
    for t in tensors:
        t = t.contiguous()
        _pending.append((dist.isend(t, dst), t))


def recv_from_prev(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device):
    """Tensors of `shapes`, in order, from the same TP rank of the previous stage (the shapes
    are known to both stages: every stage flattens the same SchedulerOutput)."""
    return _recv(shapes, dtype, device, _grid.rank - _grid.tp_size)


def send_to_prev(tensors: list[torch.Tensor]) -> None:
    """Send tensors to the same TP rank of the previous stage without waiting: that stage
    receives them when it next needs them (`irecv_from_next`, `wait_recv`), possibly a
    step later, so this never waits for an earlier send; the tensors are kept alive until
    theirs ends."""
    import torch.distributed as dist

    while _pending_prev and _pending_prev[0][0].is_completed():
        _pending_prev.pop(0)
    dst = _grid.rank - _grid.tp_size
    for t in tensors:
        t = t.contiguous()
        _pending_prev.append((dist.isend(t, dst), t))


def irecv_from_next(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> list[tuple]:
    """Post the receive of tensors of `shapes` from the same TP rank of the next stage (its
    `send_to_prev`) without waiting: (work, tensor) pairs for `wait_recv`.

    Post it where the next stage posts the send, relative to the two stages' other p2p ops:
    on CUDA both directions between two ranks share one NCCL communicator and stream, whose
    ops run in the order posted, so a receive posted only later, after a send of the next
    step's hidden states, would wait behind that send while the next stage's receive of it
    waits behind this stage's send back: a deadlock once the tensors outgrow NCCL's buffers.
    """
    import torch.distributed as dist

    src = _grid.rank + _grid.tp_size
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        out.append((dist.irecv(t, src), t))
    return out


def wait_recv(handles: list[tuple]) -> list[torch.Tensor]:
    """The tensors of `irecv_from_next`'s handles, once received."""
    global wait_s
    t0 = time.perf_counter()
    for work, _ in handles:
        work.wait()
    wait_s += time.perf_counter() - t0
    return [t for _, t in handles]


def _recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, src: int):
    import torch.distributed as dist

    global wait_s
    out = []
    t0 = time.perf_counter()
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        out.append(t)
    wait_s += time.perf_counter() - t0
    return out


def _wait_pending() -> None:
    global wait_s
    t0 = time.perf_counter()
    while _pending:
        work, _ = _pending.pop(0)
        work.wait()
    wait_s += time.perf_counter() - t0
