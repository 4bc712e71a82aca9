"""A headless node (`vx serve --headless --node-rank R`): this node's Workers, joined to node 0.

Runs in: the `vx serve --headless` process of nodes 1 .. N-1 (no torch, no HTTP). Node 0 runs
the front, the EngineCore and its own Workers; this process connects to node 0's EngineCore
(`vx.ipc.link`, at `master_port + 1`), takes node 0's configuration from it (the model resolved
again here), creates this node's rings and spawns its Workers (global ranks
[R * k, (R + 1) * k), k = TP x PP / nnodes), which join node 0's Workers in one
torch.distributed world (`master_port`). Two threads relay: node 0's step broadcast from the
Link into the local broadcast ring, and (where the driver, the last stage's TP rank 0, is
here) the driver's results from its ring back over the Link. The bytes stay the msgspec codec's.

Failure (the whole group fails, never part of it): a Worker of this node exits -> the Link is
closed, node 0's EngineCore sees it at once (EngineDead, /health 503, its tree exits) and this
process stops its other Workers and exits non-zero; node 0 gone (its Link ends without a
goodbye, `vx.ipc.link`) -> the local rings close, the Workers exit within a second and this
process exits 3 (ENGINE_DEAD). Only an ordered shutdown (node 0's Shutdown, then its goodbye)
ends the Workers cleanly and this process with 0.

Data parallel across nodes (`run_headless_dp`, `--headless --data-parallel-start-rank S`): this
node runs whole data-parallel ranks [S, S + local), each an EngineCore and its Workers on this
node's rings (`EngineProcesses`), and joins each EngineCore to the front with one Link to
`data_parallel_address:data_parallel_rpc_port`: two threads a rank relay the front's input into
the EngineCore's input ring and its events back (the front's `LinkEnd`). Failure is as above: a
child of this node exits -> each rank's Link carries an EngineDead naming it (its exit status),
then closes (the front fails: /health 503, exit 3) and this process stops the rest and exits 3;
the front gone (a Link ends without a goodbye) -> the input rings close, the EngineCores and
their Workers exit, and this process exits 3. The front's ordered shutdown (a Shutdown per rank,
then a goodbye) ends it with 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from multiprocessing.connection import wait

import anyio
import msgspec

from vx import messages
from vx.config import EngineConfig
from vx.engine_procs import (
    RESULT_RING_BYTES,
    WORKER_RING_BYTES,
    EngineProcesses,
    _join_all,
    rendezvous,
    resolve_engine_config,
)
from vx.errors import EngineStartupError
from vx.exit_code import ExitCode
from vx.ipc import codec
from vx.ipc.link import Link, connect_link
from vx.ipc.ring import RingReader, RingWriter
from vx.launch import describe_exit

logger = logging.getLogger(__name__)

__all__ = ["run_headless", "run_headless_dp"]

#: How long a headless node waits for node 0 (its EngineCore's listener) and its config.
CONNECT_TIMEOUT_S = 600.0
#: After its Workers exited, how long a node waits for node 0's Link to end (a goodbye or not).
LINK_VERDICT_S = 5.0


def run_headless(hint: EngineConfig, node_rank: int) -> int:
    """Serve as node `node_rank` until node 0 says Shutdown or the group fails; the exit code."""
    p = hint.parallel
    if not 0 < node_rank < p.nnodes:
        logger.error("invalid configuration: --headless needs 0 < --node-rank < --nnodes")
        return ExitCode.BAD_CONFIG
    logger.info("node %d: connecting to node 0 at %s:%d", node_rank, p.master_addr,
                p.master_port + 1)  # fmt: skip
    try:
        link = connect_link(p.master_addr, p.master_port + 1, node_rank, CONNECT_TIMEOUT_S)
        config = EngineConfig.decode(link.recv(timeout=CONNECT_TIMEOUT_S))
    except (TimeoutError, OSError, msgspec.DecodeError) as e:
        logger.error("node %d: no configuration from node 0: %s", node_rank, e)
        return ExitCode.STARTUP_FAILED
    # node 0's configuration, its model found on this node (node 0's path may not exist here)
    try:
        config = resolve_engine_config(
            msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=""))
        )
    except (EngineStartupError, ValueError) as e:
        logger.error("node %d cannot start: %s", node_rank, e)
        link.close()  # node 0 sees it and fails its start
        return getattr(e, "exit_code", ExitCode.BAD_CONFIG)
    node = _Node(config, node_rank, link)
    signal.signal(signal.SIGTERM, lambda *_: node.stop("SIGTERM"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # node 0 orders shutdown
    try:
        return node.run()
    finally:
        node.close()


class _Node:
    """This node's rings, Workers and relay threads."""

    def __init__(self, config: EngineConfig, node_rank: int, link: Link) -> None:
        p = config.parallel
        k = p.workers_per_node
        self.first = node_rank * k
        driver = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
        self.link = link
        self.to_workers = RingWriter.create(capacity=WORKER_RING_BYTES, num_readers=k)
        self.from_driver = (
            RingReader.create(capacity=RESULT_RING_BYTES)
            if self.first <= driver < self.first + k
            else None
        )
        self._failed = threading.Event()
        self._ring_lock = threading.Lock()
        self._ring_closed = False
        self._reason = ""
        enc = msgspec.msgpack.encode
        from vx.gpu.worker import run_worker

        ctx = multiprocessing.get_context("spawn")
        init_method = rendezvous(config)
        self.procs = [
            ctx.Process(
                target=run_worker,
                name=f"vx-worker0.{self.first + i}",
                args=(
                    config.encode(),
                    self.first + i,
                    enc(self.to_workers.handle),
                    enc(self.from_driver.handle) if self.first + i == driver else None,
                    init_method,
                    i,
                ),
                daemon=False,
            )
            for i in range(k)
        ]

    def stop(self, reason: str) -> None:
        if not self._failed.is_set():
            self._reason = reason
            self._failed.set()
        self.link.close()  # node 0 sees it now; the relays' blocking calls return

    def run(self) -> int:
        for proc in self.procs:
            proc.start()
        logger.info("node: workers %s started (pids %s)",
                    [self.first + i for i in range(len(self.procs))],
                    [proc.pid for proc in self.procs])  # fmt: skip
        down = threading.Thread(target=self._down, name="vx-link-down", daemon=True)
        down.start()
        if self.from_driver is not None:
            threading.Thread(target=self._up, name="vx-link-up", daemon=True).start()
        live = {proc.sentinel: proc for proc in self.procs}
        while live and not self._failed.is_set():
            for sentinel in wait(list(live), timeout=0.2):
                proc = live.pop(sentinel)  # type: ignore[call-overload]
                proc.join()
                if proc.exitcode != 0:
                    self.stop(f"{proc.name} (pid {proc.pid}) exited with {proc.exitcode}")
        # NOTE: the Workers also exit cleanly on the Shutdown that node 0's EngineCore sends
        # when its front is gone; how the Link then ends (a goodbye or not) is the verdict.
        down.join(LINK_VERDICT_S)
        if self._failed.is_set():
            logger.error("node: stopping: %s", self._reason)
            return ExitCode.ENGINE_DEAD
        logger.info("node: every worker stopped")
        return ExitCode.OK

    def _down(self) -> None:
        """Node 0's step broadcast -> this node's Workers. When node 0 closes the Link (after
        its Shutdown, or because it died), the ring closes too: Workers that did not get a
        Shutdown see their EngineCore gone and exit."""
        try:
            while True:
                self.to_workers.send(self.link.recv())
        except anyio.EndOfStream:  # node 0's goodbye: an ordered shutdown
            pass
        except Exception as e:  # node 0 lost (no goodbye), or a Worker's ring end is gone
            self.stop(f"lost node 0 (the front): {type(e).__name__}: {e}")
        self._close_ring()

    def _up(self) -> None:
        """The driver's results -> node 0's EngineCore; ends quietly when the driver closes
        its ring (a clean Shutdown), and fails the group when it died."""
        assert self.from_driver is not None
        try:
            while True:
                self.link.send(self.from_driver.recv())
        except anyio.EndOfStream:
            pass
        except Exception as e:
            self.stop(f"driver results: {type(e).__name__}: {e}")

    def _close_ring(self) -> None:
        with self._ring_lock:
            if not self._ring_closed:
                self._ring_closed = True
                self.to_workers.close()

    def close(self) -> None:
        self.link.close()
        self._close_ring()  # the Workers see the writer closed and exit
        _join_all(self.procs, 5.0)
        for proc in self.procs:
            if proc.is_alive():
                logger.warning("killing %s (pid %s)", proc.name, proc.pid)
                proc.kill()
        _join_all(self.procs, 5.0)
        if self.from_driver is not None:
            self.from_driver.close()


def run_headless_dp(hint: EngineConfig) -> int:
    """Serve data-parallel ranks [start, start + local) for the front at
    `data_parallel_address`; the exit code (0 after the front's Shutdown)."""
    p = hint.parallel
    ranks = range(p.data_parallel_start_rank, p.data_parallel_start_rank + p.dp_local)
    host, port = p.data_parallel_address, p.data_parallel_rpc_port
    logger.info("data-parallel ranks %s: connecting to the front at %s:%d", list(ranks), host,
                port)  # fmt: skip
    links: dict[int, Link] = {}
    try:
        for rank in ranks:
            links[rank] = connect_link(host, port, rank, CONNECT_TIMEOUT_S)
        for link in links.values():
            config = EngineConfig.decode(link.recv(timeout=CONNECT_TIMEOUT_S))
        # the front's configuration, with this node's ranks and its own copy of the model
        config = msgspec.structs.replace(
            config,
            model=msgspec.structs.replace(config.model, path=""),
            parallel=msgspec.structs.replace(
                config.parallel, data_parallel_size_local=p.dp_local,
                data_parallel_start_rank=p.data_parallel_start_rank,
            ),
        )  # fmt: skip
        config = resolve_engine_config(config)
    except (TimeoutError, OSError, msgspec.DecodeError, anyio.EndOfStream,
            anyio.BrokenResourceError) as e:  # fmt: skip
        logger.error("no configuration from the front: %s", e)
        for link in links.values():
            link.close()
        return ExitCode.STARTUP_FAILED
    except (EngineStartupError, ValueError) as e:
        logger.error("cannot start: %s", e)
        for link in links.values():
            link.close()  # the front sees it and fails its start
        return getattr(e, "exit_code", ExitCode.BAD_CONFIG)
    node = _DpNode(config, links)
    signal.signal(signal.SIGTERM, lambda *_: node.stop("SIGTERM"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front orders shutdown
    try:
        return node.run()
    finally:
        node.close()


class _DpNode:
    """This node's EngineCores (and Workers), and two relay threads per rank."""

    def __init__(self, config: EngineConfig, links: dict[int, Link]) -> None:
        self.links = links
        self.procs = EngineProcesses(config)
        self._failed = threading.Event()
        self._reason = ""
        self._threads: list[threading.Thread] = []
        self._send_locks = {rank: threading.Lock() for rank in links}
        #: Held to close a ring from a relay; `_rings_done` once `close` owns them.
        self._ring_lock = threading.Lock()
        self._rings_done = False
        #: `close` has begun: the Links' ends are ours, not a lost front.
        self._closing = False
        #: Ranks whose EngineCore exited cleanly: their Link was closed here.
        self._ended: set[int] = set()

    def stop(self, reason: str) -> None:
        """Fail the group: tell the front why (an EngineDead per rank, where its Link is
        free within a second), then close every Link."""
        first = not self._failed.is_set()
        if first:
            self._reason = reason
            self._failed.set()
        for rank, link in self.links.items():
            lock = self._send_locks[rank]
            if first and lock.acquire(timeout=1.0):
                try:  # whole frames only: `_up` sends under the same lock
                    dead = messages.EngineDead(engine_index=rank, reason=reason,
                                               exit_code=ExitCode.ENGINE_DEAD)  # fmt: skip
                    link.send(codec.engine_event_codec().encode(dead), timeout=1.0)
                except Exception:  # the Link is gone already
                    pass
                finally:
                    lock.release()
            link.close()  # the front sees it now; the relays' blocking calls return

    def run(self) -> int:
        self.procs.start()
        for rank in self.procs.ranks:
            link = self.links[rank.index]
            self._threads += [
                threading.Thread(target=self._down, args=(rank.index, link, rank.to_engine),
                                 daemon=True,
                                 name=f"vx-dp{rank.index}-down"),
                threading.Thread(target=self._up, args=(rank.index, link, rank.from_engine),
                                 daemon=True,
                                 name=f"vx-dp{rank.index}-up"),
            ]  # fmt: skip
        for t in self._threads:
            t.start()
        logger.info("data-parallel ranks %s started (pids %s)",
                    [rank.index for rank in self.procs.ranks],
                    [proc.pid for proc in self.procs.processes])  # fmt: skip
        live = {proc.sentinel: proc for proc in self.procs.processes}
        while live and not self._failed.is_set():
            for sentinel in wait(list(live), timeout=0.2):
                proc = live.pop(sentinel)  # type: ignore[call-overload]
                proc.join()
                if proc.exitcode != 0:
                    self.stop(f"{describe_exit(proc, proc.exitcode)} on the node of "
                              f"data-parallel ranks {[r.index for r in self.procs.ranks]}")
        if self._failed.is_set():
            logger.error("stopping: %s", self._reason)
            return ExitCode.ENGINE_DEAD
        logger.info("every EngineCore stopped")
        return ExitCode.OK

    def _down(self, rank: int, link: Link, to_engine: RingWriter) -> None:
        """The front's input -> the EngineCore's input ring. The front gone (the Link closed
        or broke): the ring closes, and the EngineCore, seeing its front gone, stops its
        Workers and exits."""
        try:
            while True:
                to_engine.send(link.recv())
        except anyio.EndOfStream:  # the front's goodbye, after its Shutdown: an ordered end
            pass
        except Exception as e:  # the front lost (no goodbye), unless we closed the Link
            if not self._closing and rank not in self._ended:
                self.stop(f"lost the front: {type(e).__name__}: {e}")
        with self._ring_lock:
            if not self._rings_done:
                to_engine.close()

    def _up(self, rank: int, link: Link, from_engine: RingReader) -> None:
        """The EngineCore's events -> the front; after a clean exit its Link closes. A dead
        EngineCore (its ring broken) is `run`'s to report: its exit status names the cause."""
        try:
            while True:
                data = from_engine.recv()
                with self._send_locks[rank]:
                    link.send(data)
        except anyio.EndOfStream:  # a clean exit (after the front's Shutdown)
            self._ended.add(rank)  # before `_down` sees the Link close under it
            link.close()
        except Exception as e:
            logger.debug("rank %d events: %s: %s", rank, type(e).__name__, e)

    def close(self) -> None:
        self._closing = True
        for link in self.links.values():
            link.close()
        with self._ring_lock:
            self._rings_done = True
        # NOTE: the relays return once their Link is closed or their EngineCore is gone; the
        # rings are unmapped only after that (a relay still in a ring would read freed memory).
        deadline = time.monotonic() + 2.0
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.procs.close(timeout_s=5.0 if not self._failed.is_set() else 0.5)
