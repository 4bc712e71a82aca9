"""The EngineCore process: drain input -> schedule -> execute -> update -> emit.

Runs in: one EngineCore process per data-parallel rank (a `multiprocessing` spawn child). It is
synchronous and single-threaded: no torch, no asyncio. It owns the Scheduler (and through it the
KV BlockPool) and drives its Workers through a `WorkerGroup`.

With async scheduling the loop keeps a batch queue of two: step n+1 is scheduled and sent while
step n runs, with placeholders standing for step n's tokens, so the workers never wait for this
process. With pipeline parallel the queue holds one step per stage, of different requests, so
that every stage has a step to run. Aborts are drained again just before a step's output is
applied, so a request that was aborted while its step ran is freed before its tokens could be
emitted.

Invariants: every `SchedulerOutput` sent is matched by exactly one `ModelRunnerOutput`, in order;
an idle engine blocks on its input ring (no spinning); any exception ends in `EngineDead` on the
output ring and a non-zero exit, never a silent hang.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import signal
import time

import anyio
import msgspec

from vx import messages
from vx.affinity import pin_host_process
from vx.config import EngineConfig
from vx.core.block_pool import group_block_states
from vx.core.executor import WorkerGroup
from vx.core.kv_events import ZmqEventPublisher
from vx.core.request import RequestStatus
from vx.core.scheduler import Scheduler
from vx.errors import EngineDeadError, EngineStartupError
from vx.fault_injection import PoisonedStopSet, poison_seed
from vx.ipc import codec
from vx.ipc.link import Link, accept_links
from vx.ipc.ring import RingHandle, RingReader, RingWriter
from vx.log import log_request, request_extra, requests_logged, setup_logging

logger = logging.getLogger(__name__)

#: How long the EngineCore waits for its workers to load the model and size the KV pool.
STARTUP_TIMEOUT_S = 600.0


class _ShutdownRequested(Exception):
    pass


class EngineCore:
    """The busy loop around one Scheduler and one WorkerGroup."""

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int,
        input_ring: RingReader,
        output_ring: RingWriter,
        workers: WorkerGroup,
        num_blocks: int,
        sliding_window: int | None = None,
        group_windows: list[int | None] | None = None,
    ) -> None:
        self.config = config
        self.engine_index = engine_index
        self._input = input_ring
        self._output = output_ring
        self._workers = workers
        self.scheduler = Scheduler(
            config, num_blocks, sliding_window=sliding_window, group_windows=group_windows
        )
        self._in_codec = codec.engine_input_codec()
        self._out_codec = codec.engine_event_codec()
        pp = config.parallel.pipeline_parallel_size
        #: steps in flight: two with async scheduling; one per stage with pipeline parallel
        #: (each stage runs a different step, `Scheduler.pp_size`)
        self._depth = max(2, pp) if pp > 1 else 2 if config.scheduler.async_scheduling else 1
        self._pp = pp > 1
        self._in_flight: collections.deque[messages.SchedulerOutput] = collections.deque()
        self._shutdown = False
        self._stats_dirty = False
        self._poison_seed = poison_seed("engine")
        #: When each request was last scheduled anew (epoch s), until its next output carries
        #: it to the front (`EngineCoreOutput.scheduled_time`); one entry per admission.
        self._scheduled_at: dict[str, float] = {}
        # Per-step profile, accumulated between INFO lines when --profile-steps is on.
        self._prof = collections.Counter[str]()
        #: `--kv-events-config`: the routers' ZMQ publisher (pyzmq is imported only then).
        self._kv_events: ZmqEventPublisher | None = None
        if config.kv_events.enabled:
            self._kv_events = ZmqEventPublisher(config.kv_events, engine_index)

    # ── input ──────────────────────────────────────────────────────────────────
    def _handle_input(self, msg: messages.EngineCoreInput) -> None:
        if isinstance(msg, messages.AddRequest):
            log_request(logger, msg.request_id, "request %s admitted: %d prompt tokens, "
                        "max_tokens %s", msg.request_id, len(msg.prompt_token_ids),
                        msg.sampling_params.max_tokens)  # fmt: skip
            try:
                self.scheduler.add_request(msg)
                if self._poison_seed is not None and msg.sampling_params.seed == self._poison_seed:
                    req = self.scheduler.requests[msg.request_id]
                    req.stop_token_set = PoisonedStopSet()  # test-only: its update raises
            except ValueError as e:  # one bad request fails alone; the engine goes on
                logger.warning("rejected request %s: %s", msg.request_id, e,
                               extra=request_extra(msg.request_id))  # fmt: skip
                self._emit(
                    messages.EngineCoreOutputs(
                        engine_index=self.engine_index,
                        outputs=[
                            messages.EngineCoreOutput(
                                msg.request_id, [], finish_reason="error", error=str(e)
                            )
                        ],
                        timestamp=time.time(),
                    )
                )
        elif isinstance(msg, messages.AbortRequests):
            if requests_logged(logger):
                for request_id in msg.request_ids:
                    if request_id in self.scheduler.requests:
                        log_request(logger, request_id, "request %s aborted (%s)", request_id,
                                    msg.cause)  # fmt: skip
            self.scheduler.finish_requests(msg.request_ids, RequestStatus.FINISHED_ABORTED)
            # Freed blocks must show on /metrics even if no step follows (an idle engine).
            self._stats_dirty = True
        elif isinstance(msg, messages.UtilityRequest):
            self._emit(self._call_utility(msg))
        elif isinstance(msg, messages.Shutdown):
            self._shutdown = True

    def _drain_input(self, *, block: bool) -> None:
        """Apply every queued input; with `block`, wait for at least one first."""
        if block and self._workers.has_remote_nodes:
            # Across nodes, an idle engine still notices a lost node within a second.
            while True:
                try:
                    data = self._input.recv(timeout=1.0)
                    break
                except TimeoutError:
                    self._workers.check_nodes()
            self._handle_input(self._in_codec.decode(data))
        elif block:
            self._handle_input(self._in_codec.decode(self._input.recv()))
        while True:
            try:
                data = self._input.recv_nowait()
            except anyio.WouldBlock:
                return
            self._handle_input(self._in_codec.decode(data))

    def _call_utility(self, msg: messages.UtilityRequest) -> messages.UtilityResult:
        try:
            if msg.method == "reset_prefix_cache":
                result: dict[str, object] = {"ok": self.scheduler.reset_prefix_cache()}
                # The emptied cache must show on /metrics though no step follows.
                self._stats_dirty = True
            elif msg.method == "kv_self_check":
                idle = not self._in_flight and not self.scheduler.has_unfinished_requests()
                result = dict(self.scheduler.kv_self_check())
                result["idle"] = idle
            elif msg.method == "get_stats":
                result = msgspec.structs.asdict(self.scheduler.make_stats())
            elif msg.method == "kv_block_map":
                # The dashboard's pool view (vx/http/dashboard.py), polled only while watched.
                t0 = time.perf_counter()
                pool = self.scheduler.kv_cache_manager.block_pool
                max_cells = msg.args.get("max_cells", 4096)
                group_size, cells = group_block_states(
                    pool.block_states(), max_cells if isinstance(max_cells, int) else 4096
                )
                result = {
                    "num_blocks": pool.num_blocks,
                    "group_size": group_size,
                    "cells": cells,
                    "cost_s": time.perf_counter() - t0,
                }
            else:
                return messages.UtilityResult(
                    call_id=msg.call_id, error=f"unknown method {msg.method!r}"
                )
        except Exception as e:  # a bad utility call must not kill the engine
            logger.exception("utility call %s failed", msg.method)
            return messages.UtilityResult(call_id=msg.call_id, error=str(e))
        return messages.UtilityResult(call_id=msg.call_id, result=result)

    # ── output ─────────────────────────────────────────────────────────────────
    def _emit(self, event: messages.EngineCoreEvent) -> None:
        self._output.send(self._out_codec.encode(event))

    # ── the loop ───────────────────────────────────────────────────────────────
    def run(self) -> None:
        while not self._shutdown:
            idle = not self._in_flight and not self.scheduler.has_unfinished_requests()
            self._drain_input(block=idle)
            if self._shutdown:
                break
            self.step()
            if self._kv_events is not None:
                # Every change to the prefix-cache map this turn (scheduling, a step's update,
                # an abort, a reset), published before the loop may block on its input.
                events = self.scheduler.kv_cache_manager.block_pool.take_events()
                if events:
                    self._kv_events.publish(events)
            if self._stats_dirty and not self._in_flight:
                self._stats_dirty = False
                self._emit(
                    messages.EngineCoreOutputs(
                        engine_index=self.engine_index,
                        outputs=[],
                        timestamp=time.time(),
                        scheduler_stats=self.scheduler.make_stats(),
                    )
                )
        logger.info("EngineCore %d shutting down", self.engine_index)

    def step(self) -> None:
        """Schedule (up to the queue depth), then finish the oldest in-flight step.

        With async scheduling, step n+1 is scheduled while step n runs, except when step n
        carries prefill tokens: such a step is long (a 1,024-token chunk on CPU), and a request
        arriving during it could otherwise only join step n+2, after another whole step; the
        overlap given up there is the EngineCore's part of one step boundary, small against
        such a step. Which tokens each request gets is the same either way.
        """
        t0 = time.perf_counter()
        if (
            len(self._in_flight) < self._depth
            and self.scheduler.has_unfinished_requests()
            and (self._pp or not (self._in_flight and _carries_prefill(self._in_flight[-1])))
            and self._schedule_and_send()
            and len(self._in_flight) < self._depth
        ):
            # Queue not full yet: go back and schedule step n+1 before waiting on step n.
            self._prof["schedule"] += time.perf_counter() - t0
            return
        t1 = time.perf_counter()
        if not self._in_flight:
            return
        waiting_since = time.time()
        result = self._workers.recv_output()
        t2 = time.perf_counter()
        if result.sent_at > waiting_since:  # sent while we waited: its transit alone
            self._prof["delivered"] += 1
            self._prof["delivery"] += time.time() - result.sent_at
        scheduler_output = self._in_flight.popleft()
        if result.step_id != scheduler_output.step_id:
            raise EngineDeadError(
                f"worker answered step {result.step_id}, expected {scheduler_output.step_id}"
            )
        # Drain aborts just before applying the output, so aborted requests emit nothing more.
        self._drain_input(block=False)
        outputs = self.scheduler.update_from_output(scheduler_output, result)
        if self._scheduled_at:
            self._stamp_scheduled(outputs)
        if requests_logged(logger):
            self._log_outputs(outputs)
        self._stats_dirty = False
        stats = self._make_stats(scheduler_output, result, t2 - t1)
        if self._pp:
            # The stages idle until their next step (the first since its part of this one):
            # send it before the front gets these outputs, whose streaming would otherwise take
            # the CPU from this process in the pipeline's turnaround (on CPU they share cores).
            while (
                len(self._in_flight) < self._depth
                and self.scheduler.has_unfinished_requests()
                and self._schedule_and_send()
            ):
                pass
        self._emit(
            messages.EngineCoreOutputs(
                engine_index=self.engine_index,
                outputs=outputs,
                timestamp=time.time(),
                scheduler_stats=stats,
            )
        )
        t3 = time.perf_counter()
        if self.config.profile_steps:
            self._profile(t1 - t0, t2 - t1, t3 - t2, result.execute_time_s, scheduler_output)

    def _schedule_and_send(self) -> bool:
        """Schedule a step and send it to the workers; False if it had nothing to run."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            return False
        if scheduler_output.scheduled_new_reqs:
            now = time.time()
            for new in scheduler_output.scheduled_new_reqs:
                self._scheduled_at[new.req_id] = now
        if self.config.profile_steps:
            scheduler_output = msgspec.structs.replace(scheduler_output, sent_at=time.time())
        self._workers.send(scheduler_output)
        self._in_flight.append(scheduler_output)
        return True

    def _stamp_scheduled(self, outputs: list[messages.EngineCoreOutput]) -> None:
        """Give each request's first output since it was scheduled its scheduling time."""
        at = self._scheduled_at
        for i, out in enumerate(outputs):
            t = at.pop(out.request_id, None)
            if t is not None:
                outputs[i] = msgspec.structs.replace(out, scheduled_time=t)
        # A request that finished or was aborted without an output (an abort mid-prefill)
        # leaves nothing behind.
        for request_id in [r for r in at if r not in self.scheduler.requests]:
            del at[request_id]

    def _log_outputs(self, outputs: list[messages.EngineCoreOutput]) -> None:
        """The request lines of one step: a first token, a finish (with its reason)."""
        for out in outputs:
            req = self.scheduler.requests.get(out.request_id)
            if out.new_token_ids and (
                req is None or req.num_output_tokens == len(out.new_token_ids)
            ) and out.finish_reason is None:
                log_request(logger, out.request_id, "request %s first token", out.request_id)
            if out.finish_reason is not None:
                log_request(logger, out.request_id, "request %s finished (%s)%s",
                            out.request_id, out.finish_reason,
                            f": {out.error}" if out.error else "")  # fmt: skip

    def _make_stats(
        self,
        scheduler_output: messages.SchedulerOutput,
        result: messages.ModelRunnerOutput,
        wait_s: float,
    ) -> messages.SchedulerStats:
        return msgspec.structs.replace(
            self.scheduler.make_stats(), step_time_s=result.execute_time_s or wait_s
        )

    def _profile(
        self,
        schedule_s: float,
        wait_s: float,
        update_s: float,
        exec_s: float,
        step: messages.SchedulerOutput,
    ) -> None:
        p = self._prof
        now = time.perf_counter()
        p.setdefault("start", now - schedule_s - wait_s - update_s)
        p["steps"] += 1
        p["schedule"] += schedule_s
        p["wait"] += wait_s
        p["update"] += update_s
        p["execute"] += exec_s
        # Steps that carry prefill tokens apart from decode-only ones: the two cost very
        # differently, and where the time goes under load is their mix.
        rows = len(step.num_scheduled_tokens)
        kind = "decode" if step.total_num_scheduled_tokens == rows else "prefill"
        p[kind] += 1
        p[kind + "_s"] += exec_s
        p[kind + "_rows"] += rows
        p[kind + "_tokens"] += step.total_num_scheduled_tokens
        if p["steps"] >= 200:
            n = p["steps"]
            host = p["schedule"] + p["update"]
            total = host + p["wait"]
            wall = now - p["start"]
            logger.info(
                "profile over %d steps (%.2f s, idle %.1f%%): schedule %.0f us, update+emit "
                "%.0f us, wait %.2f ms (worker execute %.2f ms, result delivery %.2f ms); "
                "host share %.1f%%; %s",
                n,
                wall,
                100.0 * max(0.0, wall - total) / wall if wall > 0 else 0.0,
                1e6 * p["schedule"] / n,
                1e6 * p["update"] / n,
                1e3 * p["wait"] / n,
                1e3 * p["execute"] / n,
                1e3 * p["delivery"] / max(p["delivered"], 1),
                100.0 * host / total if total else 0.0,
                "; ".join(
                    f"{k} steps {p[k]:.0f}: {p[k + '_rows'] / p[k]:.1f} requests, "
                    f"{p[k + '_tokens'] / p[k]:.0f} tokens, {1e3 * p[k + '_s'] / p[k]:.1f} ms "
                    f"each, {p[k + '_s']:.2f} s in all"
                    for k in ("decode", "prefill")
                    if p[k]
                ),
            )
            p.clear()

    def shutdown(self) -> None:
        self._workers.shutdown()
        if self._kv_events is not None:
            self._kv_events.shutdown()


def _carries_prefill(scheduler_output: messages.SchedulerOutput) -> bool:
    """More tokens than requests, drafts aside: some request is in a prefill (or
    prefix-recompute) chunk."""
    num_tokens = scheduler_output.total_num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    if spec:
        num_tokens -= sum(map(len, spec.values()))
    return num_tokens > len(scheduler_output.num_scheduled_tokens)


def run_engine_core(
    config_bytes: bytes,
    engine_index: int,
    input_handle: bytes,
    output_handle: bytes,
    to_workers_handle: bytes,
    from_rank0_handle: bytes,
    worker_pids: bytes,
) -> None:
    """Process entry point. Every argument is bytes (msgpack), so spawning pickles none of ours.

    `worker_pids` are this rank's Workers (every TP rank, in rank order), started by the launcher
    before this process; they are reported in EngineReady as they are.
    """
    config = EngineConfig.decode(config_bytes)
    setup_logging(f"engine{engine_index}")
    # The front orders shutdown (Ctrl-C reaches the whole process group): ignore SIGINT here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_host_process(config.device)
    input_ring = RingReader.attach(msgspec.msgpack.decode(input_handle, type=RingHandle))
    output_ring = RingWriter.attach(msgspec.msgpack.decode(output_handle, type=RingHandle))
    to_workers = RingWriter.attach(msgspec.msgpack.decode(to_workers_handle, type=RingHandle))
    from_rank0 = RingReader.attach(msgspec.msgpack.decode(from_rank0_handle, type=RingHandle))
    pids = msgspec.msgpack.decode(worker_pids, type=list[int])
    workers = WorkerGroup(
        to_workers, from_rank0, step_timeout_s=config.step_timeout_s, worker_pids=pids
    )
    remote: dict[int, Link] = {}
    clean = False  # the front ordered the shutdown (the other nodes' Links say goodbye)
    out_codec = codec.engine_event_codec()
    engine: EngineCore | None = None
    try:
        remote = _accept_nodes(config, config_bytes)
        if remote:  # the driver may be on another node: its answers come over that Link
            p = config.parallel
            driver_node = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
            driver_node //= p.workers_per_node
            workers = WorkerGroup(
                to_workers, remote.get(driver_node, from_rank0),
                step_timeout_s=config.step_timeout_s, worker_pids=pids,
                remote_nodes=[remote[r] for r in sorted(remote)],
            )  # fmt: skip
        ready = workers.wait_ready(STARTUP_TIMEOUT_S)
        engine = EngineCore(
            config, engine_index, input_ring, output_ring, workers, ready.num_blocks,
            ready.sliding_window, [w or None for w in ready.kv_group_windows],
        )  # fmt: skip
        # The block pool's objects (one per KV block) live as long as the engine: out of the
        # collector's reach, a full collection during a step no longer walks them all.
        gc.collect()
        gc.freeze()
        output_ring.send(
            out_codec.encode(
                messages.EngineReady(
                    engine_index=engine_index,
                    num_blocks=ready.num_blocks,
                    block_size=config.cache.block_size,
                    max_model_len=engine.scheduler.max_model_len,
                    max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                    max_num_seqs=config.scheduler.max_num_seqs,
                    kv_cache_bytes=ready.kv_cache_bytes,
                    engine_pid=os.getpid(),
                    worker_pids=pids,
                    async_scheduling=config.scheduler.async_scheduling,
                    batch_invariant=config.batch_invariant,
                )
            )
        )
        logger.info(
            "EngineCore %d ready: %d KV blocks (%.1f MiB)",
            engine_index,
            ready.num_blocks,
            ready.kv_cache_bytes / 2**20,
        )
        engine.run()
        engine.shutdown()
        clean = True
    except (anyio.BrokenResourceError, anyio.EndOfStream):
        # The front went away: there is nobody to serve, so stop the workers and leave.
        logger.warning("EngineCore %d: the front is gone; exiting", engine_index)
        workers.shutdown()
    except BaseException as e:
        if isinstance(e, (EngineDeadError, EngineStartupError)):
            # A named failure (a Worker died, hung or failed to load): one line, no traceback;
            # the front names the cause once more with every child's exit status.
            logger.error("EngineCore %d stopping: %s", engine_index, e)
        else:
            logger.exception("EngineCore %d died", engine_index)
        dead = messages.EngineDead(
            engine_index=engine_index, reason=str(e), exit_code=getattr(e, "exit_code", 0)
        )
        try:
            output_ring.send(out_codec.encode(dead), timeout=1.0)
        except Exception:  # the front may be gone too; the launcher watches our pid anyway
            pass
        workers.shutdown()
        raise SystemExit(1) from None
    finally:
        for ring in (input_ring, output_ring, to_workers, from_rank0):
            ring.close()
        for link in remote.values():
            # Only an ordered shutdown says goodbye: otherwise the other nodes fail (exit 3).
            link.close(goodbye=clean)


def _accept_nodes(config: EngineConfig, config_bytes: bytes) -> dict[int, Link]:
    """With `--nnodes N`, wait for the N - 1 headless nodes (`vx.headless`) and hand each the
    configuration; their Links by node rank (none on one node)."""
    p = config.parallel
    if p.nnodes == 1:
        return {}
    logger.info("waiting for %d other node(s) on %s:%d", p.nnodes - 1, p.master_addr,
                p.master_port + 1)  # fmt: skip
    links = accept_links(p.master_addr, p.master_port + 1, p.nnodes - 1, STARTUP_TIMEOUT_S)
    for link in links.values():
        link.send(config_bytes)
    return links
