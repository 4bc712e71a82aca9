"""The OS side of `vx.ipc.ring`: fences, spinning, wake-ups, peer liveness, and `RingEnd`, the
part both ring ends share (the segment itself is `vx.ipc.segment`).

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
import time
from collections.abc import Callable
from typing import Self

# NOTE: re-exported: `vx.engine_procs` imports `sweep_stale_segments` from here.
from vx.ipc.segment import RingHandle, ShmSegment, pid_alive, sweep_stale_segments

__all__ = [
    "BUSY_SPIN_S",
    "FENCE_IS_FULL",
    "RECHECK_S",
    "SPIN_S",
    "PeerWatch",
    "RingEnd",
    "ShmSegment",
    "WakeSender",
    "Waker",
    "make_fence",
    "pid_alive",
    "spin_until",
    "sweep_stale_segments",
]

#: True where `make_fence` is known to be a full (StoreLoad) barrier: on x86 every lock
#: operation is a `lock`-prefixed instruction. On ARMv8 a store-release followed by a
#: load-acquire is ordered too (RCsc), but that is untested on such hardware here; the bounded
#: re-check interval caps the cost of any missed wake-up at RECHECK_S of latency (never a hang).
FENCE_IS_FULL = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

#: How long an empty reader (or a writer facing a full ring) polls before it parks.
SPIN_S = 50e-6
#: How long a reader keeps polling past `SPIN_S` while the writer says it is copying a large
#: message (`writer_busy`): parking and waking again would cost more than the wait.
BUSY_SPIN_S = 2e-3
#: Longest uninterrupted OS wait: peer liveness and lost wake-ups are re-checked this often.
RECHECK_S = 0.25


def make_fence() -> tuple[Callable[[], object], Callable[[], object]]:
    """A memory barrier for Python: calling `release(); acquire()` orders earlier loads and
    stores before later ones.

    Python exposes no fence, so this borrows the one inside a lock round trip: the lock is held
    between uses, so each use is an uncontended store-release followed by a load-acquire. Each
    ring end makes its own (it is used by one thread at a time, so the pairs stay balanced).
    """
    lock = threading.Lock()
    lock.acquire()
    return lock.release, lock.acquire


def spin_until(ready: Callable[[], object], seconds: float) -> bool:
    """Polls `ready()` for up to `seconds`, yielding the CPU between rounds of polls; True
    once ready.

    A round is a few polls, which together cost about what one `sched_yield` does, so yielding
    after every poll would add most of a syscall to the time a message waits unseen, and the
    clock is read once per round for the same reason.
    """
    end = time.perf_counter() + seconds
    while True:
        if ready() or ready() or ready() or ready():
            return True
        if time.perf_counter() >= end:
            return False
        os.sched_yield()


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

    def consume(self) -> None:
        """Takes one pending wake-up datagram, if any (a writer sends one per park episode;
        a leftover only causes one spurious wake-up later)."""
        try:
            self._sock.recv_into(self._buf)
        except (BlockingIOError, InterruptedError):
            pass

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


class PeerWatch:
    """Watches a changing set of peer pids for death, through pidfds where the kernel has them.

    A pidfd becomes readable when its process exits (including while it is an unreaped zombie),
    so it can sit in the same `poll` as the wake-up socket: death wakes the waiter at once.
    Without pidfds (kernel < 5.3) `poll` falls back to the re-check interval and `/proc`.
    """

    __slots__ = ("_checked_at", "_fds", "_poll", "_suspect", "_waker_fd")

    #: Without a hint (a pidfd event or an idle timeout), liveness is re-checked at most this
    #: often: each check is a syscall, and parking happens on every idle gap of a busy ring.
    CHECK_INTERVAL_S = 0.05

    def __init__(self, waker: Waker) -> None:
        self._waker_fd = waker.fileno()
        self._poll = select.poll()
        self._poll.register(self._waker_fd, select.POLLIN)
        self._fds: dict[int, int] = {}  # pid -> pidfd (or -1 when pidfds are unavailable)
        self._suspect = True  # the last wait ended by something other than a wake-up
        self._checked_at = 0.0

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

    def should_check(self) -> bool:
        """Whether a round of `dead` checks is due (always after a suspect wait)."""
        now = time.monotonic()
        if not self._suspect and now - self._checked_at < self.CHECK_INTERVAL_S:
            return False
        self._suspect, self._checked_at = False, now
        return True

    def dead(self, pid: int) -> bool:
        fd = self._fds.get(pid, -1)
        if fd >= 0:
            return bool(select.select([fd], [], [], 0)[0])
        return not pid_alive(pid)

    def wait(self, deadline: float | None, recheck_s: float) -> bool:
        """Blocks until a wake-up arrives, a watched peer dies, `recheck_s` passes or the
        `perf_counter` deadline does (then raises TimeoutError). True if woken up."""
        if deadline is not None:
            recheck_s = min(recheck_s, deadline - time.perf_counter())
            if recheck_s <= 0:
                raise TimeoutError("ring wait timed out")
        try:
            events = self._poll.poll(recheck_s * 1000.0)
        except InterruptedError:
            events = []
        woken = any(fd == self._waker_fd for fd, _ in events)
        if len(events) > woken or not events:
            self._suspect = True
        return woken

    def suspect(self) -> None:
        """Marks the next `should_check` as due (e.g. after an idle timeout elsewhere)."""
        self._suspect = True

    def close(self) -> None:
        for fd in self._fds.values():
            if fd >= 0:
                os.close(fd)
        self._fds.clear()


class RingEnd:
    """What both ends of a `vx.ipc.ring` ring share: the mapping, a fence, the wake-up sockets and
    the liveness watch, and the layout (`_handle`, `_cap`: data bytes, `_base`: data offset).

    Takes ownership of `seg`: closes it (and unlinks it, if owned) when opening fails.
    """

    def __init__(self, seg: ShmSegment, wake_name: str) -> None:
        try:
            # First: binding the wake-up name fails if this end is already open elsewhere.
            self._waker = Waker(wake_name)
        except BaseException:
            seg.close()
            raise
        self._seg, self._q, self._mm, self._buf = seg, seg.q, seg.mm, seg.buf
        self._handle, self._cap, self._base = seg.layout()
        self._fence_release, self._fence_acquire = make_fence()
        self._sender = WakeSender()
        self._watch = PeerWatch(self._waker)
        self._closed = False
        self._episode = 0  # counts this end's parks: the parked flag holds the current one
        #: Seconds to poll before parking; 0 parks at once.
        self.spin_s = SPIN_S

    @property
    def handle(self) -> RingHandle:
        return self._handle

    def _fence(self) -> None:
        self._fence_release()
        self._fence_acquire()

    def _spin(
        self, ready: Callable[[], object], deadline: float | None, seconds: float | None = None
    ) -> bool:
        """Spins for `seconds` (default `spin_s`; never when `spin_s` is 0); True once ready."""
        spin = self.spin_s if seconds is None or self.spin_s <= 0 else seconds
        if deadline is not None:
            spin = min(spin, deadline - time.perf_counter())
        return spin > 0 and spin_until(ready, spin)

    def _release(self) -> None:
        self._closed = True
        self._watch.close()
        self._sender.close()
        self._waker.close()
        self._seg.close()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
