"""WorkerGroup: the EngineCore's handle on its Workers.

Runs in: the EngineCore process. No torch: the workers are reached only through two rings,
a broadcast ring that every worker reads (`SchedulerOutput`, `Shutdown`) and the driver's
result ring (`ModelRunnerOutput`, `WorkerReady`, `WorkerDead`). Only the driver (rank 0, or the
last pipeline stage's TP rank 0) answers, because every rank that samples samples the same
tokens. Across nodes (`--nnodes`), each other node gets the same bytes over a `vx.ipc.link.Link`
beside the ring, and the driver's answers come over its node's Link when it is not on this
node.

Invariant: results come back in the order the outputs were sent (each worker handles one
`SchedulerOutput` at a time, in ring order), so the caller matches them by position and
checks `step_id`.
"""

from __future__ import annotations

import logging

import anyio

from vx import messages
from vx.errors import EngineDeadError, EngineStartupError
from vx.ipc import codec
from vx.ipc.link import Link
from vx.ipc.ring import RingReader, RingWriter

logger = logging.getLogger(__name__)


class WorkerGroup:
    """Broadcasts each step to every worker and collects rank 0's answer."""

    def __init__(
        self,
        to_workers: RingWriter,
        from_rank0: RingReader | Link,
        *,
        step_timeout_s: float,
        worker_pids: list[int] | None = None,
        remote_nodes: list[Link] | None = None,
    ):
        self._to_workers = to_workers
        #: the other nodes' Links (`--nnodes`), each sent every message the ring carries
        self._remote_nodes = remote_nodes or []
        self._from_rank0 = from_rank0
        self._step_timeout_s = step_timeout_s
        #: Named in a stuck step's error, so the front's one line says which process hung.
        self._worker_pids = worker_pids or []
        self._in_codec = codec.worker_input_codec()
        self._out_codec = codec.worker_event_codec()

    def wait_ready(self, timeout_s: float) -> messages.WorkerReady:
        """Block until rank 0 reports ready (it does so after every rank has loaded)."""
        event = self._recv(timeout_s, what="worker start-up")
        if isinstance(event, messages.WorkerDead):
            raise EngineStartupError(
                f"worker {event.rank} failed to start: {event.reason}", event.exit_code
            )
        if not isinstance(event, messages.WorkerReady):
            raise EngineDeadError(f"unexpected message from worker at start-up: {event!r}")
        return event

    def send(self, scheduler_output: messages.SchedulerOutput) -> None:
        data = self._in_codec.encode(scheduler_output)
        self._to_workers.send(data)
        for link in self._remote_nodes:
            try:
                link.send(data, timeout=self._step_timeout_s)
            except (anyio.BrokenResourceError, TimeoutError) as e:
                raise EngineDeadError(f"lost a node: {e or 'its link timed out'}") from None

    def recv_output(self) -> messages.ModelRunnerOutput:
        """The next step result; raises EngineDeadError on worker death or a stuck step."""
        event = self._recv(self._step_timeout_s, what="a model step")
        if isinstance(event, messages.WorkerDead):
            raise EngineDeadError(f"worker {event.rank} died: {event.reason}")
        if not isinstance(event, messages.ModelRunnerOutput):
            raise EngineDeadError(f"unexpected message from worker: {event!r}")
        return event

    @property
    def has_remote_nodes(self) -> bool:
        return bool(self._remote_nodes)

    def check_nodes(self) -> None:
        """Raise EngineDeadError if another node's Link has closed (an idle EngineCore calls
        this between its waits for input, so a lost node fails the group at once)."""
        for link in self._remote_nodes:
            if link.peer_closed():
                raise EngineDeadError("lost a node: its link to this EngineCore closed")

    def shutdown(self) -> None:
        """Ask every worker to exit; best effort (a dead reader must not block us)."""
        data = self._in_codec.encode(messages.Shutdown())
        for end in (self._to_workers, *self._remote_nodes):
            try:
                end.send(data, timeout=1.0)
            except (anyio.BrokenResourceError, TimeoutError, OSError):
                pass

    def _recv(self, timeout_s: float, *, what: str) -> messages.WorkerEvent:
        try:
            data = self._from_rank0.recv(timeout=timeout_s)
        except TimeoutError:
            pids = ", ".join(map(str, self._worker_pids)) or "?"
            raise EngineDeadError(
                f"worker (pid {pids}) stuck: did not finish {what} within {timeout_s:g} s"
                f" (--step-timeout)"
            ) from None
        except (anyio.BrokenResourceError, anyio.EndOfStream):
            where = " (or its node)" if self._remote_nodes else ""
            raise EngineDeadError(f"a worker process{where} died") from None
        return self._out_codec.decode(data)
