"""OS-level helpers for `vx.ring`: memory fences, wake-up sockets, peer liveness, stale sweeps.

Runs in: every process that holds a ring end (ApiServer, EngineCore, Workers).

Wake-ups travel over Linux *abstract* Unix datagram sockets named after the ring segment
(`"\\0" + segment name + ".w"` / `".r<i>"`). Each ring end binds its own name when it opens, so:

- a spawned child needs nothing but the `RingHandle` (no fd inheritance);
- nothing is ever created in a file system, so a `kill -9` leaves no FIFO or directory behind
  (the kernel drops an abstract name when its last socket closes);
- a second process that tries to take the same ring end fails with `EADDRINUSE`.

NOTE: abstract sockets have no file permissions: any process in the same network namespace that
learns a name (they are visible in /proc/net/unix) can send datagrams to it. The only effect is
a spurious wake-up, after which the ring re-checks its counters, so this costs CPU, never
correctness. The payload itself lives in an owner-only (0600) segment.
"""

from __future__ import annotations

import errno
import os
import platform
import select
import socket
import threading

__all__ = [
    "FENCE_IS_FULL",
    "PeerWatch",
    "WakeSender",
    "Waker",
    "full_fence",
    "pid_alive",
    "sweep_stale_segments",
]

_fence_lock = threading.Lock()
_fence_acquire = _fence_lock.acquire
_fence_release = _fence_lock.release

#: True where `full_fence` is a real StoreLoad barrier: on x86-64 a lock acquire is a
#: `lock cmpxchg`, which orders every earlier store before every later load. Elsewhere it is an
#: acquire/release pair, which is weaker; the rings' bounded re-check interval then bounds the
#: cost of a missed wake-up to `vx.ring.RECHECK_S` of latency (never a hang).
FENCE_IS_FULL = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def full_fence() -> None:
    """Orders this thread's earlier shared-memory stores before its later loads.

    Python exposes no fence, so this borrows the one inside an uncontended lock round trip
    (about 0.1 µs). The rings need it exactly where a Dekker-style handshake stores one flag and
    then loads the peer's (publish a counter, then look at the peer's "parked" flag).
    """
    _fence_acquire()
    _fence_release()


def _abstract(name: str) -> str:
    return "\0" + name


class Waker:
    """The receiving end of one ring end's wake-ups: a bound, non-blocking datagram socket.

    Invariant: while this object is open, the abstract name is held by this process.
    """

    __slots__ = ("_buf", "_sock", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(_abstract(name))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"ring end {name!r} is already open in some process") from exc
            raise
        sock.setblocking(False)
        self._sock = sock
        self._buf = bytearray(64)

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self) -> None:
        """Discards every pending wake-up datagram (each one is a single byte)."""
        recv_into = self._sock.recv_into
        buf = self._buf
        for _ in range(1024):
            try:
                recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return

    def close(self) -> None:
        self._sock.close()


class WakeSender:
    """Sends one-byte wake-ups to other ring ends' `Waker`s; never blocks, never raises."""

    __slots__ = ("_sendto", "_sock")

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)
        self._sendto = self._sock.sendto

    def wake(self, name: str) -> None:
        # NOTE: failures are all benign: ECONNREFUSED means the peer has not bound its name yet
        # or has gone (then it is not parked), EAGAIN means it already has wake-ups queued.
        try:
            self._sendto(b"\x01", _abstract(name))
        except OSError:
            pass

    def close(self) -> None:
        self._sock.close()


def pid_alive(pid: int) -> bool:
    """Whether `pid` names a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # The state letter follows the last ')' (the command name may itself contain ')').
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"x")


class PeerWatch:
    """Watches a changing set of peer pids for death, through pidfds where the kernel has them.

    A pidfd becomes readable when its process exits (including while it is an unreaped zombie),
    so it can sit in the same `poll` as the wake-up socket: death wakes the waiter at once.
    Without pidfds (kernel < 5.3) `poll` falls back to the re-check interval and `/proc`.
    """

    __slots__ = ("_fds", "_poll", "_waker_fd")

    def __init__(self, waker: Waker) -> None:
        self._waker_fd = waker.fileno()
        self._poll = select.poll()
        self._poll.register(self._waker_fd, select.POLLIN)
        self._fds: dict[int, int] = {}  # pid -> pidfd (or -1 when pidfds are unavailable)

    def update(self, pids: list[int]) -> None:
        """Starts watching pids seen for the first time (0 means "not attached yet")."""
        for pid in pids:
            if pid <= 0 or pid in self._fds:
                continue
            fd = -1
            if hasattr(os, "pidfd_open"):
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    fd = -1  # already gone: `dead` reports it through /proc
                except OSError:
                    fd = -1
            if fd >= 0:
                self._poll.register(fd, select.POLLIN)
            self._fds[pid] = fd

    def dead(self, pid: int) -> bool:
        fd = self._fds.get(pid, -1)
        if fd >= 0:
            return bool(select.select([fd], [], [], 0)[0])
        return not pid_alive(pid)

    def wait(self, timeout_s: float) -> None:
        """Blocks until a wake-up arrives, a watched peer dies, or `timeout_s` passes."""
        try:
            self._poll.poll(max(0.0, timeout_s) * 1000.0)
        except InterruptedError:
            pass

    def close(self) -> None:
        for fd in self._fds.values():
            if fd >= 0:
                os.close(fd)
        self._fds.clear()


def sweep_stale_segments(prefix: str = "vx") -> list[str]:
    """Unlinks `/dev/shm/<prefix>-<pid>-<random>` segments whose creator pid is dead.

    For a supervisor at start-up: the resource tracker normally unlinks a killed creator's
    segments, but it is itself gone after e.g. an OOM kill of the whole process tree.
    Returns the names it removed.
    """
    removed: list[str] = []
    try:
        entries = os.listdir("/dev/shm")
    except FileNotFoundError:
        return removed
    for entry in entries:
        parts = entry.rsplit("-", 2)
        if len(parts) != 3 or parts[0] != prefix or not parts[1].isdigit():
            continue
        if pid_alive(int(parts[1])):
            continue
        try:
            os.unlink(os.path.join("/dev/shm", entry))
            removed.append(entry)
        except FileNotFoundError:
            pass
    return removed
