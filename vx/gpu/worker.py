"""The Worker process: load the model, size the KV pool, then run steps until told to stop.

Runs in: one Worker process per device (per tensor-parallel rank), a `multiprocessing` spawn
child. It reads every `SchedulerOutput` from the EngineCore's broadcast ring; rank 0 alone
answers on its result ring, since every rank samples the same tokens.

Invariants: exactly one `ModelRunnerOutput` per `SchedulerOutput` (from rank 0), in order; a
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


def _init_torch(config: EngineConfig, rank: int, dist_port: int) -> str:
    """Threads, device and (for TP > 1) the process group; returns the device string."""
    import torch

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = "cpu"
    if config.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    tp = config.parallel.tensor_parallel_size
    if tp > 1:
        import torch.distributed as dist

        # CUDA tensors go over NCCL; the few CPU tensors (the pool-size agreement) over gloo.
        dist.init_process_group(
            backend="cuda:nccl,cpu:gloo" if config.device == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{dist_port}",
            rank=rank,
            world_size=tp,
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


def _min_across_ranks(value: int, tp: int) -> int:
    """Every rank must use the same pool size: the smallest any rank can hold."""
    if tp == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def run_worker(
    config_bytes: bytes,
    rank: int,
    input_handle: bytes,
    output_handle: bytes | None,
    dist_port: int = 0,
) -> None:
    """Process entry point; arguments are bytes (msgpack) so spawning pickles none of ours."""
    config = EngineConfig.decode(config_bytes)
    setup_logging(f"worker{rank}")
    # The front orders shutdown (Ctrl-C reaches the whole process group): ignore SIGINT here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox = RingReader.attach(msgspec.msgpack.decode(input_handle, type=RingHandle), rank)
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
        from vx.gpu.model_runner import ModelRunner

        tp = config.parallel.tensor_parallel_size
        device = _init_torch(config, rank, dist_port)
        runner = ModelRunner(config, rank=rank, device=device)
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
            num_blocks = min(num_blocks, 2 * config.scheduler.max_num_seqs * per_seq)
        kv_bytes = num_blocks * block_bytes
        num_blocks = _min_across_ranks(num_blocks, tp)
        runner.initialize_kv_cache(num_blocks)
        _settle_for_steps(device)
        logger.info(
            "worker %d ready on %s in %.1f s: %d KV blocks", rank, device,
            time.perf_counter() - t0, num_blocks,
        )
        windows = getattr(runner.model, "attention_windows", None) or (None,)
        send(
            messages.WorkerReady(
                rank=rank, pid=os.getpid(), num_blocks=num_blocks, kv_cache_bytes=kv_bytes,
                device=device,
                sliding_window=None if None in windows else max(windows),
            )
        )
        while True:
            msg = in_codec.decode(inbox.recv())
            if isinstance(msg, messages.Shutdown):
                break
            output = runner.execute(msg)
            if rank == 0:
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
