"""LinkEnd: the front's ends of a remote EngineCore's rings, carried by one `vx.ipc.link.Link`.

Runs in: the front process (`vx.engine_procs.EngineProcesses`, data parallel across nodes).
A data-parallel rank on another node (`vx.headless.run_headless_dp`) relays its EngineCore's
input and event rings over a Link; on the front's side a LinkEnd stands for both ring ends, with
their contract as `vx.http.engine_client.EngineClient` uses it: `send_nowait` (raises
anyio.WouldBlock when full), `recv_nowait` and the event loop's `receive`. The client does not
know whether an engine is local or remote.

Two threads make the blocking Link non-blocking: a writer drains a bounded queue into the Link,
a reader puts each message in a deque and wakes the event loop through a socketpair. The Link
arrives after construction (`attach`: the remote node connects while the front already serves
/health); until then messages wait in the queue.

Failure: the Link closing or breaking, for any reason but our own `close`, is a dead engine:
`receive` / `recv_nowait` (once the messages before it are read) and `send_nowait` raise
anyio.BrokenResourceError. A remote EngineCore never closes its Link while the front runs
(its node closes it when the EngineCore exits), so unlike a ring there is no clean EndOfStream.
`close` (the front's ordered shutdown, after the Shutdown it queued) ends the Link with a
goodbye; the remote node reads a Link that ends without one as a lost front and exits non-zero.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import threading

import anyio
import anyio.lowlevel

from vx.ipc.link import Link

logger = logging.getLogger(__name__)

__all__ = ["LinkEnd"]

#: Messages the writer queue holds before `send_nowait` says WouldBlock (the client's outbox
#: then holds the rest, as for a full ring).
MAX_QUEUED = 1024


class LinkEnd:
    """Invariants: messages go out and come in whole and in order; once `_error` is set it
    stays set, and every message read before it is still delivered first."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._link: Link | None = None
        self._out: queue.Queue[bytes | None] = queue.Queue(maxsize=MAX_QUEUED)
        self._in: collections.deque[bytes] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._error: str | None = None
        self._closed = False
        self._threads: list[threading.Thread] = []

    def attach(self, link: Link) -> None:
        """The remote node connected: start relaying."""
        self._link = link
        self._threads = [
            threading.Thread(target=self._read_loop, name=f"{self.name}-in", daemon=True),
            threading.Thread(target=self._write_loop, name=f"{self.name}-out", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def fail(self, reason: str) -> None:
        """The Link is lost (or never came): every later call raises BrokenResourceError."""
        if self._error is None:
            self._error = reason
        self._wake()

    # ─────────── the input ring's writer ───────────

    def send_nowait(self, data: bytes) -> None:
        if self._error is not None:
            raise anyio.BrokenResourceError(self._error)
        try:
            self._out.put_nowait(bytes(data))
        except queue.Full:
            raise anyio.WouldBlock from None

    # ─────────── the event ring's reader ───────────

    def recv_nowait(self) -> bytes:
        if self._in:
            return self._in.popleft()
        if self._error is not None:
            raise anyio.BrokenResourceError(self._error)
        raise anyio.WouldBlock

    async def receive(self) -> bytes:
        while True:
            await anyio.lowlevel.checkpoint()
            try:
                return self.recv_nowait()
            except anyio.WouldBlock:
                pass
            await anyio.wait_readable(self._wake_r.fileno())
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass

    # ─────────── threads ───────────

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def _read_loop(self) -> None:
        assert self._link is not None
        try:
            while True:
                self._in.append(self._link.recv())
                self._wake()
        except anyio.EndOfStream:
            reason = f"{self.name}: its node closed the link"
        except Exception as e:  # the link broke
            reason = f"{self.name}: {type(e).__name__}: {e}"
        if not self._closed:
            self.fail(reason)

    def _write_loop(self) -> None:
        assert self._link is not None
        while (data := self._out.get()) is not None:
            try:
                self._link.send(data)
            except Exception as e:
                if not self._closed:
                    self.fail(f"{self.name}: {type(e).__name__}: {e}")
                return

    def close(self, flush_s: float = 1.0) -> None:
        """Send what is queued (a Shutdown, at most `flush_s`), then close the Link. Idempotent."""
        if self._closed:
            return
        try:
            self._out.put(None, timeout=flush_s)
        except queue.Full:
            pass
        for t in self._threads:
            if t.name.endswith("-out"):
                t.join(flush_s)
        self._closed = True
        if self._link is not None:
            self._link.close(goodbye=True)  # an ordered end: the remote node exits 0
        for t in self._threads:
            t.join(1.0)
        self._wake_r.close()
        self._wake_w.close()
