"""EngineProcesses: create the rings, spawn every EngineCore and Worker, and tear them down.

Runs in: the front process (the ApiServer launcher or the user's process for `vx.LLM`). It
imports no torch: children import their heavy modules inside their entry functions.

Ownership: this object creates every ring, so it alone unlinks them (`close()`); if this process
is killed, Python's resource tracker unlinks the segments, and the children notice the dead
writer/reader within a second and exit by themselves.

Per data-parallel rank there are four rings: front -> engine (inputs), engine -> front (events),
engine -> workers (a broadcast with one reader per Worker: TP x PP of them) and the driver
(the last pipeline stage's TP rank 0) -> engine (results).

Data parallel across nodes: this node runs ranks [start, start + local); on the front's node the
others are `remote`: a `LinkEnd` each, in place of the front's two ring ends, attached when that
rank's node connects to `data_parallel_address:data_parallel_rpc_port` (an acceptor thread; the
front serves /health meanwhile) and is sent this configuration.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import anyio
import msgspec

from vx.config import EngineConfig
from vx.errors import AddressInUseError, ModelNotFoundError
from vx.ipc.link import Link
from vx.ipc.link_end import LinkEnd
from vx.ipc.ring import RingOwner, RingReader, RingWriter
from vx.ipc.wait import sweep_stale_segments

logger = logging.getLogger(__name__)

INPUT_RING_BYTES = 1 << 22
EVENT_RING_BYTES = 1 << 24
WORKER_RING_BYTES = 1 << 24
RESULT_RING_BYTES = 1 << 22
#: How long the front waits for the other nodes' data-parallel ranks to connect.
REMOTE_CONNECT_TIMEOUT_S = 600.0


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """Resolve the model to a local directory and fill `max_model_len` from its config.json.

    Raises:
        ModelNotFoundError: the model is not there (or not a model vx can read).
        ValueError: the configuration does not fit the model.
    """
    from vx.models_hub.resolve import resolve_model  # no torch at import time

    try:
        path = config.model.path or resolve_model(config.model.model)
    except (FileNotFoundError, ValueError) as e:  # no such path, or not a model there
        raise ModelNotFoundError(str(e)) from None
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    limit = int(hf_config.get("max_position_embeddings") or 2048)
    max_model_len = config.model.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's context length {limit}"
        )
    model = msgspec.structs.replace(
        config.model,
        path=path,
        max_model_len=max_model_len,
        served_model_name=config.model.served_model_name or config.model.model,
    )
    resolved = msgspec.structs.replace(config, model=model)
    sp = config.speculative
    if sp.model is not None:  # the draft model, resolved as the target is
        try:
            draft = resolve_model(sp.model)
        except (FileNotFoundError, ValueError) as e:
            raise ModelNotFoundError(f"draft model: {e}") from None
        speculative = msgspec.structs.replace(sp, model=draft)
        resolved = msgspec.structs.replace(resolved, speculative=speculative)
    resolved.validate()
    return resolved


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rendezvous(config: EngineConfig) -> str:
    """torch.distributed's init method for one data-parallel rank's Workers: node 0's
    `master_port` across nodes, a free local port on one node (unused for a world of one)."""
    p = config.parallel
    if p.nnodes > 1:
        return f"tcp://{p.master_addr}:{p.master_port}"
    return f"tcp://127.0.0.1:{_free_port()}" if p.world_size > 1 else ""


@dataclass
class EngineRank:
    """One data-parallel rank: its EngineCore, its Workers, and the front's ends of its rings.

    `engine_proc` is None until `EngineProcesses.start` spawns it, just after the rank's Workers
    (or for good, if the start failed before).
    """

    index: int
    to_engine: RingWriter
    from_engine: RingReader
    to_workers: RingOwner
    from_rank0: RingOwner
    worker_procs: list[BaseProcess] = field(default_factory=list)
    engine_proc: BaseProcess | None = None

    @property
    def processes(self) -> list[BaseProcess]:
        return [p for p in (self.engine_proc, *self.worker_procs) if p is not None]


class EngineProcesses:
    """Every child process of one vx instance, and the rings between them."""

    def __init__(self, config: EngineConfig) -> None:
        if not config.model.path:
            raise ValueError("resolve the model first (resolve_engine_config)")
        self.config = config
        self.ranks: list[EngineRank] = []
        p = config.parallel
        first = p.data_parallel_start_rank
        self.local_ranks = range(first, first + p.dp_local)
        #: The other nodes' ranks, by index (the front's node only: a headless node's ranks
        #: talk to the front through their own node's relay).
        self.remote: dict[int, LinkEnd] = {}
        if first == 0:
            self.remote = {
                i: LinkEnd(f"engine {i}") for i in range(p.dp_local, p.data_parallel_size)
            }
        self._listener: socket.socket | None = None
        self._closed = False

    def start(self) -> None:
        """Create the rings and spawn the children (they load in parallel).

        Raises:
            AddressInUseError: the front cannot listen for its remote data-parallel ranks.
        """
        from vx.core.engine_core import run_engine_core
        from vx.gpu.worker import run_worker

        removed = sweep_stale_segments("vx")
        if removed:
            logger.warning("removed %d shm segments left by dead vx processes", len(removed))
        ctx = multiprocessing.get_context("spawn")
        cfg = self.config.encode()
        p = self.config.parallel
        local = p.workers_per_node  # node 0's Workers: global ranks [0, local)
        driver = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
        enc = msgspec.msgpack.encode
        try:
            if self.remote:
                self._listen()
            for index in self.local_ranks:
                to_engine = RingWriter.create(capacity=INPUT_RING_BYTES)
                from_engine = RingReader.create(capacity=EVENT_RING_BYTES)
                to_workers = RingOwner.create(capacity=WORKER_RING_BYTES, num_readers=local)
                from_rank0 = RingOwner.create(capacity=RESULT_RING_BYTES)
                rank = EngineRank(index, to_engine, from_engine, to_workers, from_rank0)
                self.ranks.append(rank)
                init_method = rendezvous(self.config)
                for r in range(local):
                    out = enc(from_rank0.handle) if r == driver else None
                    rank.worker_procs.append(
                        ctx.Process(
                            target=run_worker,
                            name=f"vx-worker{index}.{r}",
                            args=(cfg, r, enc(to_workers.handle), out, init_method),
                            daemon=False,
                        )
                    )
            for rank in self.ranks:
                for proc in rank.worker_procs:
                    proc.start()
                # The Workers start first so that their pids, every TP rank's, can be handed
                # to the EngineCore, which reports them in EngineReady (only rank 0 talks to it).
                rank.engine_proc = ctx.Process(
                    target=run_engine_core,
                    name=f"vx-engine{rank.index}",
                    args=(
                        cfg,
                        rank.index,
                        enc(rank.to_engine.handle),
                        enc(rank.from_engine.handle),
                        enc(rank.to_workers.handle),
                        enc(rank.from_rank0.handle),
                        enc([proc.pid for proc in rank.worker_procs]),
                    ),
                    daemon=False,
                )
                rank.engine_proc.start()
        except BaseException:
            self.close()
            raise

    def _listen(self) -> None:
        """Listen for the remote ranks (here, so that a taken port fails the start) and accept
        them in a thread: each says its rank (u64) and gets the configuration."""
        p = self.config.parallel
        try:
            self._listener = socket.create_server(
                (p.data_parallel_address, p.data_parallel_rpc_port)
            )
        except OSError as e:
            raise AddressInUseError(
                f"cannot listen for remote data-parallel ranks on {p.data_parallel_address}:"
                f"{p.data_parallel_rpc_port}: {e.strerror or e}"
            ) from None
        logger.info("waiting for data-parallel ranks %s on %s:%d", sorted(self.remote),
                    p.data_parallel_address, p.data_parallel_rpc_port)  # fmt: skip
        threading.Thread(target=self._accept, name="vx-dp-accept", daemon=True).start()

    def _accept(self) -> None:
        assert self._listener is not None
        waiting = dict(self.remote)
        deadline = time.monotonic() + REMOTE_CONNECT_TIMEOUT_S
        try:
            while waiting:
                self._listener.settimeout(max(0.0, deadline - time.monotonic()))
                sock, peer = self._listener.accept()
                link = Link(sock)
                try:  # a stray connection is refused alone
                    (rank,) = struct.unpack("<Q", link.recv(timeout=10.0))  # `connect_link`'s
                    if rank not in waiting:
                        raise ValueError(f"data-parallel rank {rank} is not expected")
                    link.send(self.config.encode(), timeout=10.0)
                except (OSError, ValueError, struct.error, anyio.EndOfStream,
                        anyio.BrokenResourceError) as e:  # fmt: skip
                    logger.error("refused a connection from %s: %s", peer[0], e)
                    link.close()
                    continue
                waiting.pop(rank).attach(link)
                logger.info("data-parallel rank %d connected from %s", rank, peer[0])
        except Exception as e:  # timed out, or closed by `close`
            for rank, end in waiting.items():
                end.fail(f"engine {rank}: its node did not connect: {type(e).__name__}: {e}")
        finally:
            self._listener.close()

    @property
    def processes(self) -> list[BaseProcess]:
        return [p for rank in self.ranks for p in rank.processes]

    @property
    def engine_rings(self) -> list[tuple[object, object]]:
        """Every rank's input writer and event reader, by rank: local rings, remote LinkEnds."""
        local = {rank.index: (rank.to_engine, rank.from_engine) for rank in self.ranks}
        local.update({i: (end, end) for i, end in self.remote.items()})
        return [local[i] for i in sorted(local)]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every child (politely, then by force) and unlink every ring. Idempotent."""
        if self._closed:
            return
        self._closed = True
        from vx import messages
        from vx.ipc import codec

        encode = codec.engine_input_codec().encode
        if self._listener is not None:
            try:  # an accept still waiting returns
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for end in self.remote.values():
            try:
                end.send_nowait(encode(messages.Shutdown(reason="close")))
            except Exception:  # lost already
                pass
            end.close()
        for rank in self.ranks:
            if rank.engine_proc is not None and rank.engine_proc.is_alive():
                try:
                    rank.to_engine.send(encode(messages.Shutdown(reason="close")), timeout=0.5)
                except Exception:  # full or broken: force comes next
                    pass
        _join_all(self.processes, timeout_s)
        for proc in self.processes:
            if proc.is_alive():
                logger.warning("killing %s (pid %s) after %.1f s", proc.name, proc.pid, timeout_s)
                proc.kill()
        _join_all(self.processes, 5.0)
        for rank in self.ranks:
            for ring in (rank.to_engine, rank.from_engine, rank.to_workers, rank.from_rank0):
                ring.close()


def _join_all(procs: list[BaseProcess], timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join(max(0.0, deadline - time.monotonic()))

