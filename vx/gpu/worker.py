"""The Worker process: load the model, size the KV pool, then run steps until told to stop.

Runs in: one Worker process per device (per tensor-parallel rank of each pipeline stage), a
`multiprocessing` spawn child. It reads every `SchedulerOutput` from the EngineCore's broadcast
ring; the driver (the last stage's TP rank 0; rank 0 without pipeline parallel) alone answers
on its result ring, since every rank of the last stage samples the same tokens.

Invariants: exactly one `ModelRunnerOutput` per `SchedulerOutput` (from the driver), in order; a
fatal error is reported as `WorkerDead` (best effort) and the process exits non-zero; the death
of the EngineCore (its ring's writer) makes the worker exit within about a second.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import signal
import time

import anyio
import msgspec

from vx import envs, messages
from vx.config import EngineConfig
from vx.errors import EngineStartupError
from vx.ipc import codec
from vx.ipc.ring import RingHandle, RingReader, RingWriter
from vx.log import setup_logging

logger = logging.getLogger(__name__)


def _init_torch(config: EngineConfig, rank: int, local_rank: int, init_method: str) -> str:
    """Threads, device and (for more than one Worker) the process grid
    (`vx.gpu.parallel_state`); returns the device string."""
    import torch

    from vx.gpu import parallel_state

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = "cpu"
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    p = config.parallel
    # CUDA tensors go over NCCL; the CPU tensors (the pool-size agreement) over gloo.
    parallel_state.init(
        tp_size=p.tensor_parallel_size,
        pp_size=p.pipeline_parallel_size,
        rank=rank,
        init_method=init_method,
        backend="cuda:nccl,cpu:gloo" if config.device == "cuda" else "gloo",
        # a stage waits on the previous one's hidden states for at most a step's deadline
        timeout_s=max(config.step_timeout_s, 60.0),
    )
    return device


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _settle_for_steps(device: str) -> None:
    """Once the model and KV cache are in place, before the first step.

    - On CPU, glibc's malloc keeps the memory that freed tensors give back: by default a
      block over its mmap threshold (128 KiB, rising to at most 32 MiB) is unmapped when freed
      and a heap top over 128 KiB is trimmed, so each step's activations came back as fresh
      pages, zeroed by the kernel on first touch (a 1,024-token prefill step spent a
      measurable share of its time in those page faults; decode steps did not). A step's working
      set repeats, so what a step frees the next one reuses; the cost is that the Worker's RSS
      stays at its peak. `VX_CPU_MALLOC_TUNING=0` leaves malloc alone.
    - On CPU, torch's OpenMP threads are bound one per core (`_bind_omp_threads`).
    - `gc.freeze()` moves every object alive now (the model's modules and parameters, tens of
      thousands) out of the collector's reach: a full collection during a step no longer walks
      them all.
    """
    if device == "cpu" and envs.VX_CPU_MALLOC_TUNING:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            mallopt = getattr(libc, "mallopt", None)  # glibc only
        except OSError:
            mallopt = None
        if mallopt is not None:
            ok = mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, 1 << 30)
            logger.debug("malloc keeps freed memory for reuse: %s", bool(ok))
    if device == "cpu" and envs.VX_CPU_BIND_THREADS:
        _bind_omp_threads()
    gc.collect()
    gc.freeze()


def _bind_omp_threads() -> None:
    """On CPU, each of torch's OpenMP threads on its own core, as vLLM's CPU worker binds its
    own: `vx.affinity` puts the front and the EngineCores on the last core, and a thread left
    free was moved onto its partner's core while they ran there. Only where the threads are
    as many as the allowed cores: with fewer, which cores to take is the user's choice (two
    servers side by side would both bind the lowest ones), and they stay free.
    `VX_CPU_BIND_THREADS=0` leaves the threads free."""
    import torch

    from vx.gpu.cpu.library import load_cpu_kernels

    lib = load_cpu_kernels()
    cpus = sorted(os.sched_getaffinity(0))
    n = torch.get_num_threads()
    if lib is None or n != len(cpus):
        return
    arr = (ctypes.c_int * n)(*cpus[:n])
    team = lib.vx_bind_threads(arr, n)
    logger.debug("OpenMP threads bound to cores %s (team %d)", cpus[:n], team)


def _min_across_ranks(value: int, world: int) -> int:
    """Every rank must use the same pool size: the smallest any rank (of any pipeline stage,
    each holding its own layers' caches) can hold."""
    if world == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class _StageProfile:
    """`--profile-steps` with pipeline parallel: each TP rank 0 of a stage logs, once per busy
    period, how its wall time split into computing, waiting on the stage before it (or on its
    own previous send), and waiting for the next step. The time not spent computing is this
    stage's share of the pipeline's bubble.

    A busy period ends when no step came for `IDLE_GAP_S` (the engine had no requests), at
    shutdown, or after `max_steps` steps (`VX_PP_PROFILE_STEPS`); the idle gap itself is not
    counted. So one load phase (a `vx bench serve` run at one concurrency) gives its own line,
    over exactly its steps, unless it is longer than `max_steps`."""

    IDLE_GAP_S = 1.0

    def __init__(self, grid) -> None:
        self.grid = grid
        self.max_steps = max(envs.VX_PP_PROFILE_STEPS, 1)
        self.steps = 0
        self.exec_s = 0.0
        self.t_start = self.t0 = self.t_end = time.perf_counter()
        self.wait0 = 0.0
        #: steps sent after this stage was idle, and their total EngineCore -> stage transit
        self.delivered, self.delivery_s = 0, 0.0

    def begin(self, sent_at: float) -> None:
        """A step arrived; `sent_at`: when the EngineCore sent it (epoch s)."""
        from vx.gpu import parallel_state

        self.t0 = time.perf_counter()
        if self.steps and self.t0 - self.t_end >= self.IDLE_GAP_S:
            self.flush()
        if self.steps == 0:
            self.t_start, self.wait0 = self.t0, parallel_state.wait_s
        now = time.time()
        if sent_at > now - (self.t0 - self.t_end):  # sent while this stage waited: transit
            self.delivered += 1
            self.delivery_s += now - sent_at

    def end(self) -> None:
        self.t_end = time.perf_counter()
        self.exec_s += self.t_end - self.t0
        self.steps += 1
        if self.steps >= self.max_steps:
            self.flush()

    def flush(self) -> None:
        """Log the busy period that ended at the last step's end, and start a new one."""
        from vx.gpu import parallel_state

        wall = self.t_end - self.t_start
        pp_wait = parallel_state.wait_s - self.wait0
        if self.steps and self.grid.tp_rank == 0 and wall > 0:
            logger.info(
                "pp stage %d profile over %d steps (%.2f s): compute %.1f%%, waiting on the "
                "stage before %.1f%%, waiting for steps %.1f%% (bubble %.1f%%); step "
                "delivery %.2f ms (%d steps sent while idle)",
                self.grid.pp_rank, self.steps, wall, 100 * (self.exec_s - pp_wait) / wall,
                100 * pp_wait / wall, 100 * (wall - self.exec_s) / wall,
                100 * (wall - self.exec_s + pp_wait) / wall,
                1e3 * self.delivery_s / max(self.delivered, 1), self.delivered,
            )  # fmt: skip
        self.steps, self.exec_s = 0, 0.0
        self.delivered, self.delivery_s = 0, 0.0


def run_worker(
    config_bytes: bytes,
    rank: int,
    input_handle: bytes,
    output_handle: bytes | None,
    init_method: str = "",
    local_rank: int | None = None,
) -> None:
    """Process entry point; arguments are bytes (msgpack) so spawning pickles none of ours.

    `rank` is the global rank (`vx.gpu.parallel_state`), `local_rank` this node's index of the
    Worker (its reader of the broadcast ring, its GPU; `rank` on one node); `init_method` is
    torch.distributed's rendezvous (unused for a world of one)."""
    local_rank = rank if local_rank is None else local_rank
    config = EngineConfig.decode(config_bytes)
    setup_logging(f"worker{rank}")
    # The front orders shutdown (Ctrl-C reaches the whole process group): ignore SIGINT here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox = RingReader.attach(msgspec.msgpack.decode(input_handle, type=RingHandle), local_rank)
    outbox = (
        RingWriter.attach(msgspec.msgpack.decode(output_handle, type=RingHandle))
        if output_handle is not None
        else None
    )
    in_codec = codec.worker_input_codec()
    out_codec = codec.worker_event_codec()

    def send(event: messages.WorkerEvent) -> None:
        if outbox is not None:
            outbox.send(out_codec.encode(event))

    # NOTE: tqdm (the weight loader's bar, and libraries') makes a multiprocessing RLock, a
    # named semaphore registered with the front's resource tracker; a Worker killed by a
    # signal never unregisters it, and the tracker then warns of a "leaked semaphore" when the
    # front exits. A thread lock does for one process.
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        from vx.gpu import parallel_state
        from vx.gpu.model_runner import ModelRunner

        device = _init_torch(config, rank, local_rank, init_method)
        grid = parallel_state.grid()
        driver = rank == grid.driver_rank
        runner = ModelRunner(config, rank=grid.tp_rank, device=device)
        t0 = time.perf_counter()
        runner.load_model()
        num_blocks, kv_bytes = runner.determine_num_blocks()
        block_bytes = kv_bytes // max(num_blocks, 1)
        if config.cache.num_blocks_override is not None:
            num_blocks = config.cache.num_blocks_override
        else:
            # More blocks than every sequence at full length (twice, for prefix reuse) would
            # only cost memory and EngineCore start-up time.
            per_seq = -(-(config.model.max_model_len or 2048) // config.cache.block_size)
            assert runner.kv_groups is not None  # a block table per KV-cache group
            per_seq *= runner.kv_groups.num_groups
            num_blocks = min(num_blocks, 2 * config.scheduler.max_num_seqs * per_seq)
        kv_bytes = num_blocks * block_bytes
        num_blocks = _min_across_ranks(num_blocks, grid.world_size)
        runner.initialize_kv_cache(num_blocks)
        _settle_for_steps(device)
        logger.info(
            "worker %d ready on %s in %.1f s: %d KV blocks", rank, device,
            time.perf_counter() - t0, num_blocks,
        )
        groups = runner.kv_groups
        assert groups is not None
        windows = getattr(runner.model, "attention_windows", None) or (None,)
        draft = getattr(runner.proposer, "model", None)  # a draft model reads the same blocks
        if draft is not None:
            windows = (*windows, *(getattr(draft, "attention_windows", None) or (None,)))
        send(
            messages.WorkerReady(
                rank=rank, pid=os.getpid(), num_blocks=num_blocks, kv_cache_bytes=kv_bytes,
                device=device,
                sliding_window=None if None in windows else max(windows),
                kv_group_windows=[w or 0 for w in groups.windows] if groups.num_groups > 1 else [],
            )
        )
        stage_profile = _StageProfile(grid) if config.profile_steps and grid.pp_size > 1 else None
        while True:
            msg = in_codec.decode(inbox.recv())
            if isinstance(msg, messages.Shutdown):
                if stage_profile is not None:
                    stage_profile.flush()
                break
            if stage_profile is not None:
                stage_profile.begin(msg.sent_at)
            output = runner.execute(msg)
            if stage_profile is not None:
                stage_profile.end()
            if driver:
                if config.profile_steps:  # the EngineCore times the result's delivery
                    output = msgspec.structs.replace(output, sent_at=time.time())
                send(output)
    except (anyio.BrokenResourceError, anyio.EndOfStream):
        logger.warning("worker %d: the EngineCore is gone; exiting", rank)
    except BaseException as e:
        if isinstance(e, EngineStartupError):  # named (the KV pool does not fit): one line
            logger.error("worker %d cannot start: %s", rank, e)
        else:
            logger.exception("worker %d died", rank)
        dead = messages.WorkerDead(
            rank=rank, reason=f"{type(e).__name__}: {e}", exit_code=getattr(e, "exit_code", 0)
        )
        try:
            send(dead)
        except Exception:  # the engine may be gone; it watches our ring's liveness anyway
            pass
        raise SystemExit(1) from None
    finally:
        inbox.close()
        if outbox is not None:
            outbox.close()
