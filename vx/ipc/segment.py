"""The shared-memory side of `vx.ipc.ring`: the segment's byte layout, its owner, and its handle.

Runs in: every process that holds a ring end (ApiServer, EngineCore, Workers), and the launcher
(which owns the EngineCore <-> Worker segments through `RingOwner`).

Segment (`/dev/shm/<prefix>-<creator pid>-<random>`, mode 0600) of native u64 slots; each
party's hot fields have their own 64-byte line::

    line 0        magic | version | capacity | num_readers | data_offset        (constant)
    line 1        write_pos | writer_pid | writer_parked | writer_closed | writer_busy
    line 2 + i    read_pos | reader_pid | reader_parked | reader_closed         (reader i writes)
    data_offset   `capacity` bytes of frames, addressed by position % capacity

A frame is a u64 header (`length | flags << 32`) and the payload padded to 8 bytes; frames are
8-aligned, so a header never straddles the end of the data area (a payload may). `flags` is
START and/or END (the frames of one message), or PAD alone: filler up to the end of the data
area that readers skip, so that a whole message can start again at offset 0 in one piece.

The creator owns the name: it registers it with its resource tracker (which unlinks it if the
creator is killed -9) and unlinks it in `close()`. Attaching processes open it with `shm_open`
directly and never register. NOTE: on Python 3.11 `SharedMemory(create=False)` always
registers; the tracker's set is shared with spawned children, so unregistering after such an
attach would also drop the creator's entry.
"""

from __future__ import annotations

import _posixshmem
import errno
import logging
import mmap
import os
import secrets
from multiprocessing import resource_tracker
from typing import NamedTuple

import msgspec

__all__ = [
    "RingHandle",
    "RingOwner",
    "RingStatistics",
    "ShmSegment",
    "pid_alive",
    "sweep_stale_segments",
]

logger = logging.getLogger(__name__)

# The header, as u64 slot indices (the layout is drawn above).
MAGIC, VERSION = 0x7672696E67763031, 2  # "vringv01"; version 2: PAD frames, writer_busy
CAPACITY, NUM_READERS, DATA_OFFSET = 2, 3, 4
WRITE_POS, WRITER_PID, WRITER_PARKED, WRITER_CLOSED, WRITER_BUSY = 8, 9, 10, 11, 12
READERS = 16  # reader i's line starts at READERS + 8 * i; its slots are relative to that:
READ_POS, READER_PID, READER_PARKED, READER_CLOSED = 0, 1, 2, 3

# Frames.
HDR = 8
START, END, PAD = 1, 2, 4
LEN_MASK = 0xFFFFFFFF


class RingHandle(msgspec.Struct, frozen=True):
    """Everything a process needs to open an end of an existing ring (sent to spawned children).

    Wake-up sockets are named after `name` (`<name>.w`, `<name>.r<i>`), so nothing else is needed.
    """

    #: Shared-memory segment name (no leading slash): `<prefix>-<creator pid>-<random hex>`.
    name: str
    #: Bytes in the data area (a multiple of 8).
    capacity: int
    num_readers: int


class RingStatistics(NamedTuple):
    capacity: int
    #: Bytes published and not yet consumed (by the slowest reader, for the writer).
    num_bytes_pending: int
    #: This end's 64-bit byte position.
    position: int


class ShmSegment:
    """One mapped POSIX shm segment (mode 0600); `q` views it as native u64 slots, `buf` as
    read-only bytes (readers hand out slices of `buf`: zero-copy views), `mm` is writable.

    Invariant: `q` and `buf` are the only views this object takes of `mm`, so `close()` can
    unmap unless a caller still holds a slice of `buf`.
    """

    __slots__ = ("buf", "mm", "name", "owner", "q")

    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self.mm = mmap.mmap(fd, size)
        whole = memoryview(self.mm)
        self.q = whole.cast("Q")
        # Read-only: a reader that wrote into a broadcast message would change what the other
        # readers see.
        self.buf = whole.toreadonly()
        whole.release()

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

    @classmethod
    def create_ring(cls, prefix: str, num_readers: int, capacity: int, position: int) -> ShmSegment:
        """A new ring segment with its header written (every position at `position`)."""
        if not 64 <= capacity <= 1 << 31:
            raise ValueError(f"capacity must be in [64, 2**31], got {capacity}")
        if len(prefix) > 48:  # the wake-up socket names must stay under 108 bytes
            raise ValueError(f"name_prefix is too long: {prefix!r}")
        if not 1 <= num_readers <= 1024:
            raise ValueError(f"num_readers must be in [1, 1024], got {num_readers}")
        if position < 0 or position % 8:
            raise ValueError(f"initial_position must be a non-negative multiple of 8: {position}")
        capacity = (capacity + 7) & -8
        data_offset = (READERS + 8 * num_readers) * 8
        seg = cls.create(f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}", data_offset + capacity)
        q = seg.q
        q[CAPACITY], q[NUM_READERS], q[DATA_OFFSET] = capacity, num_readers, data_offset
        for i in [WRITE_POS] + [READERS + 8 * i + READ_POS for i in range(num_readers)]:
            q[i] = position
        q[1] = VERSION
        q[0] = MAGIC  # last: marks the header complete
        return seg

    @classmethod
    def attach_ring(cls, name: str, capacity: int, num_readers: int) -> ShmSegment:
        """Maps an existing ring segment; ValueError unless its header matches."""
        seg = cls.attach(name)
        q = seg.q
        ok = (q[0], q[1], q[CAPACITY], q[NUM_READERS]) == (MAGIC, VERSION, capacity, num_readers)
        if not ok or len(seg.mm) < q[DATA_OFFSET] + capacity:  # NOTE: >=, may be rounded up
            seg.close()
            raise ValueError(f"shm segment {name!r} does not match its handle")
        return seg

    def layout(self) -> tuple[RingHandle, int, int]:
        """(handle, capacity, data offset) from the header."""
        q = self.q
        return RingHandle(self.name, q[CAPACITY], q[NUM_READERS]), q[CAPACITY], q[DATA_OFFSET]

    def close(self) -> None:
        self.q.release()
        self.buf.release()
        try:
            self.mm.close()
        except BufferError:
            # A caller still holds a slice of a received view: the mapping lives on until that
            # slice is garbage; the name is unlinked all the same.
            logger.warning("ring %s: closed while a received view is still referenced", self.name)
        if self.owner:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass
            resource_tracker.unregister("/" + self.name, "shared_memory")


class RingOwner:
    """Owns a ring's segment without holding either end.

    The launcher creates the EngineCore <-> Worker rings this way: both ends live in children,
    but the segment must belong to the process that outlives them, so that it (or, if it is
    killed, its resource tracker) unlinks it.
    """

    def __init__(self, seg: ShmSegment) -> None:
        self._seg, self._closed = seg, False
        self.handle: RingHandle = seg.layout()[0]

    @classmethod
    def create(
        cls, *, capacity: int = 1 << 22, num_readers: int = 1, name_prefix: str = "vx"
    ) -> RingOwner:
        return cls(ShmSegment.create_ring(name_prefix, num_readers, capacity, 0))

    def close(self) -> None:
        """Unlinks the segment (ends that are open keep their mapping). Idempotent."""
        if not self._closed:
            self._closed = True
            self._seg.close()


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
