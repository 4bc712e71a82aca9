"""Link: one TCP connection between two nodes, carrying whole messages with a ring end's contract.

Runs in: the EngineCore of node 0 (one Link per other node) and the headless node's process
(`vx.node_link`). Across nodes the shared-memory rings cannot reach; a Link carries the same
msgspec bytes (`vx.ipc.codec`, never pickle) in its place: `send(data, timeout)` and
`recv(timeout)` behave as `RingWriter.send` and `RingReader.recv` do, so the EngineCore's
`WorkerGroup` reads and writes either alike.

A message is a u64 little-endian length and the payload. A clean end is a goodbye frame (the
reserved length `GOODBYE`, sent by `close(goodbye=True)` after the peer was told to shut down):
`recv` raises anyio.EndOfStream, as a ring's closed writer does. Peer loss: a connection closed
without a goodbye (its process died or was killed) or reset raises anyio.BrokenResourceError, so
a node can tell a lost peer from an ordered shutdown; a silent peer
(a node that vanished) shows as a `recv` timeout, the step deadline's, and, where nobody waits
with a deadline (an idle front, a headless node), as a broken Link once TCP keepalive gives up
(`KEEPALIVE_IDLE_S` + `KEEPALIVE_COUNT` x `KEEPALIVE_INTERVAL_S`; `TCP_USER_TIMEOUT` for data
left unacknowledged as long).

Invariant: messages arrive whole and in order, or the Link is broken for good. `send` is called
from one thread and `recv` from one thread (they may be two).
"""

from __future__ import annotations

import select
import socket
import struct
import time

import anyio

__all__ = ["Link", "accept_links", "connect_link"]

_LEN = struct.Struct("<Q")
#: The length that is no message: the sender's goodbye (`close(goodbye=True)`).
GOODBYE = 2**64 - 1

#: TCP keepalive: the kernel probes an idle connection after this many seconds...
KEEPALIVE_IDLE_S = 5
#: ... every this many seconds, and gives the connection up after this many unanswered probes.
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_COUNT = 5


class Link:
    """A framed, blocking TCP connection."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        # NOTE: the peer's kernel answers the probes, so a busy or paused peer process is never
        # given up; only a node or network that is gone.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        give_up_ms = 1000 * (KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, give_up_ms)
        self._sock = sock
        self._closed = False

    def send(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        try:
            self._sock.settimeout(timeout)
            self._sock.sendall(_LEN.pack(len(data)) + bytes(data))
        except TimeoutError:
            raise
        except OSError as e:
            raise anyio.BrokenResourceError(f"link to the other node broke: {e}") from None

    def recv(self, timeout: float | None = None) -> bytes:
        """The next message; TimeoutError if none within `timeout` (a partial message keeps
        the Link unusable: the caller treats a timeout as fatal)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        (n,) = _LEN.unpack(self._read(_LEN.size, deadline))
        if n == GOODBYE:
            raise anyio.EndOfStream
        return self._read(n, deadline)

    def _read(self, n: int, deadline: float | None) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("no message from the other node in time")
            try:
                self._sock.settimeout(left)
                k = self._sock.recv_into(view[got:])
            except TimeoutError:
                raise
            except OSError as e:
                raise anyio.BrokenResourceError(f"link to the other node broke: {e}") from None
            if k == 0:
                raise anyio.BrokenResourceError(
                    "the other node closed the link without a goodbye (its process is gone)"
                )
            got += k
        return bytes(buf)

    def peer_closed(self) -> bool:
        """Whether the other node has closed or reset the connection (checked without
        reading: an idle EngineCore asks this of every node between its waits)."""
        poller = select.poll()
        poller.register(self._sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

    def close(self, goodbye: bool = False) -> None:
        """Close the connection; with `goodbye`, first tell the peer that this is an ordered
        end (best effort, at most a second: a peer that is gone cannot be told)."""
        if not self._closed:
            self._closed = True
            if goodbye:
                try:
                    self._sock.settimeout(1.0)
                    self._sock.sendall(_LEN.pack(GOODBYE))
                except OSError:
                    pass
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


def accept_links(host: str, port: int, n: int, timeout_s: float) -> dict[int, Link]:
    """Node 0: accept the other `n` nodes; each opens with its node rank (u64). Returns the
    Links by node rank. Raises TimeoutError if they do not all come in time."""
    links: dict[int, Link] = {}
    deadline = time.monotonic() + timeout_s
    with socket.create_server((host, port), reuse_port=False) as server:
        while len(links) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(links)} of {n} other nodes connected in {timeout_s:g} s")
            server.settimeout(left)
            sock, _ = server.accept()
            link = Link(sock)
            (rank,) = _LEN.unpack(link.recv(timeout=10.0))
            links[int(rank)] = link
    return links


def connect_link(host: str, port: int, node_rank: int, timeout_s: float) -> Link:
    """A headless node: connect to node 0 (retrying until it listens) and say who we are."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"node 0 at {host}:{port} did not answer in {timeout_s:g} s"
                ) from None
            time.sleep(0.2)  # node 0 is still starting (its listener comes with its engine)
    link = Link(sock)
    link.send(_LEN.pack(node_rank))
    return link
