"""OS-level plumbing for `vx.ring`: shm segments, memory fences, wake-ups, peer liveness.

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

import _posixshmem
import errno
import mmap
import os
import platform
import select
import socket
import threading
from multiprocessing import resource_tracker

__all__ = [
    "FENCE_IS_FULL",
    "Fence",
    "PeerWatch",
    "ShmSegment",
    "WakeSender",
    "Waker",
    "pid_alive",
    "sweep_stale_segments",
]

#: True where `Fence` is known to be a full (StoreLoad) barrier: on x86 every lock operation is
#: a `lock`-prefixed instruction. On ARMv8 the store-release of `release()` followed by the
#: load-acquire of `acquire()` is ordered too (RCsc), but that is not tested on such hardware here;
#: the rings' bounded re-check interval caps the cost of any missed wake-up at
#: `vx.ring.RECHECK_S` of latency (never a hang).
FENCE_IS_FULL = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class Fence:
    """A memory barrier callable from Python: `fence()` orders earlier loads and stores before
    later ones (about 0.1 µs).

    Python exposes no fence, so this borrows the one inside a lock round trip. The lock is held
    between calls, so each call is `release()` (a store-release) followed by `acquire()` (a
    load-acquire), both uncontended. One `Fence` per ring end: a ring end is used by one thread
    at a time, which keeps the release/acquire pairs balanced.
    """

    __slots__ = ("_acquire", "_lock", "_release")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._acquire = self._lock.acquire
        self._release = self._lock.release

    def __call__(self) -> None:
        self._release()
        self._acquire()


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


class ShmSegment:
    """One mapped POSIX shm segment (mode 0600); `q` views it as native u64 slots.

    The creator owns the name: it registers it with its resource tracker (which unlinks it if
    the creator is killed -9) and unlinks it in `close()`. Attaching processes open it with
    `shm_open` directly and never register. NOTE: on Python 3.11 `SharedMemory(create=False)`
    always registers; the tracker's set is shared with spawned children, so unregistering after
    such an attach would also drop the creator's entry.
    """

    __slots__ = ("mm", "name", "owner", "q")

    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self.mm = mmap.mmap(fd, size)
        self.q = memoryview(self.mm).cast("Q")

    @classmethod
    def create(cls, name: str, size: int) -> ShmSegment:
        path = "/" + name
        fd = _posixshmem.shm_open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        resource_tracker.register(path, "shared_memory")
        try:
            os.ftruncate(fd, size)
            try:
                # Reserve the tmpfs pages now: a full /dev/shm then fails here with ENOSPC
                # instead of killing a process with SIGBUS on some later write.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            return cls(name, fd, size, owner=True)
        except BaseException:
            _posixshmem.shm_unlink(path)
            resource_tracker.unregister(path, "shared_memory")
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            return cls(name, fd, os.fstat(fd).st_size, owner=False)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.q.release()
        self.mm.close()
        if self.owner:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass
            resource_tracker.unregister("/" + self.name, "shared_memory")


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
