"""Shared-memory rings: the byte pipes between vx's processes.

Runs in: every process (ApiServer, EngineCore, Workers); each process holds one end of a ring.

A ring has one writer and `num_readers` readers. Every reader sees every message, in order
(1 reader: a pipe; N readers: the EngineCore -> Workers broadcast for tensor parallelism). The
writer never overwrites bytes that some reader has not consumed. Messages are opaque `bytes`
(`vx.codec` turns them into messages); a message larger than the ring is cut into chunks that
the reader joins again, so any size goes through.

Segment layout (one POSIX shm segment, `/dev/shm/<prefix>-<creator pid>-<random>`, mode 0600).
Every field is a native u64 slot, and each party's hot fields sit in their own 64-byte line::

    line 0        magic | version | capacity | num_readers | data_offset        (constant)
    line 1        write_pos | writer_pid | writer_parked | writer_closed        (writer writes)
    line 2 + i    read_pos | reader_pid | reader_parked | reader_closed         (reader i writes)
    data_offset   capacity bytes of frames, addressed as position % capacity

`write_pos` and `read_pos` are monotonically increasing 64-bit *byte* counters (they never wrap
in practice: 2**64 bytes is centuries at 1 GB/s). The bytes in [min(read_pos), write_pos) are
published and unconsumed; the writer may write only into [write_pos, min(read_pos) + capacity).
A frame is an 8-byte header (`length | flags << 32`, one u64) and the payload, padded to 8 bytes.
Frames start 8-aligned, so a header never straddles the end of the data area; a payload may wrap
and is then copied in two pieces. Flags: START (first frame of a message), END (last frame).
A message is either one START|END frame or START, 0..n middle frames, END. If `send` times out
in the middle of a chunked message, the reader drops the torn part when the next START arrives
(or at end of stream): a message is delivered whole or not at all.

Memory ordering. The writer copies the payload first and stores `write_pos` last; the reader
loads `write_pos` first and the payload after; a reader copies the payload out before it stores
its `read_pos`, and the writer loads `read_pos` before it overwrites. Every access goes through
`mmap` slice copies or native `memoryview` u64 items (a single aligned 8-byte `memcpy`, i.e. one
mov: no torn counters), each in its own C call, so the C compiler cannot reorder them. With a
single writer and x86-TSO (stores are seen in program order, loads are not reordered with
loads, nor with later stores), that makes a published counter imply published bytes. On weakly
ordered CPUs (ARM, POWER) that needs barriers: there the ring calls its `Fence` before the
counter store and after the counter load (`_WEAK_ORDER`); on x86 those calls are skipped.

Waiting and the park handshake. An empty reader first spins for `spin_s` (~50 µs, polling with
`sched_yield`), then parks: it stores `reader_parked = 1`, fences, re-checks `write_pos` and
`writer_closed`, and only then blocks in `poll` on its wake-up socket and the writer's pidfd.
The writer stores `write_pos`, fences, and sends a wake-up byte only to readers whose flag is
set. The two fences make this a Dekker handshake: x86 may delay a store past a later load, so
without them both sides could miss each other. A writer blocked on a full ring parks the same
way (`writer_parked`) and the reader that frees space wakes it. So an idle ring costs no CPU,
and a busy one costs no syscalls. Blocking waits also wake every `RECHECK_S` to look at peer
liveness and to bound the cost of any missed wake-up.

Peer death. Each end stores its pid in the header on opening. A waiting reader watches the
writer's pidfd: writer gone without `close()` -> `anyio.BrokenResourceError` once the data it
published is drained; after `close()` -> `anyio.EndOfStream`. A writer blocked on a full ring
watches the readers holding it back: one that died or closed -> `anyio.BrokenResourceError`.

Ownership and cleanup. The creator (`RingWriter.create` or `RingReader.create`) owns the segment
and unlinks it in `close()`. It creates the segment with `_posixshmem.shm_open` (as
`multiprocessing.shared_memory` does) and registers it with its resource tracker, so the tracker
unlinks it if the creator is killed -9. Attaching processes open it with `shm_open` directly and
never register: on Python 3.11 `SharedMemory(create=False)` always registers, the tracker's set
is shared with spawned children, and unregistering would also drop the creator's entry.
`vx.ring_wait.sweep_stale_segments` removes what a dead process tree leaked anyway.

A ring end is not thread-safe: use each from one thread (or one task) at a time.
"""

from __future__ import annotations

import os
import secrets
from time import perf_counter
from typing import NamedTuple

import anyio
import anyio.lowlevel
import msgspec

from vx.ring_wait import FENCE_IS_FULL, Fence, PeerWatch, ShmSegment, Waker, WakeSender

__all__ = [
    "RECHECK_S",
    "SPIN_S",
    "RingHandle",
    "RingOwner",
    "RingReader",
    "RingStatistics",
    "RingWriter",
]

#: How long an empty reader (or a writer facing a full ring) polls before it parks.
SPIN_S = 50e-6
#: Longest uninterrupted OS wait: peer liveness and lost wake-ups are re-checked this often.
RECHECK_S = 0.25

_MAGIC = 0x7672696E67763031  # "vringv01"
_VERSION = 1
_HDR = 8
_START, _END = 1, 2
_LEN_MASK = 0xFFFFFFFF
_WEAK_ORDER = not FENCE_IS_FULL

# u64 slot indices in the header; a reader's are relative to _reader_base(i).
_CAPACITY, _NUM_READERS, _DATA_OFFSET = 2, 3, 4
_WRITE_POS, _WRITER_PID, _WRITER_PARKED, _WRITER_CLOSED = 8, 9, 10, 11
_READ_POS, _READER_PID, _READER_PARKED, _READER_CLOSED = 0, 1, 2, 3


def _reader_base(i: int) -> int:
    return 16 + 8 * i


class RingHandle(msgspec.Struct, frozen=True):
    """Everything a process needs to open an end of an existing ring (sent to spawned children).

    The wake-up sockets are named after `name` (see `vx.ring_wait`), so nothing else is needed.
    """

    #: Shared-memory segment name (no leading slash): `<prefix>-<creator pid>-<random hex>`.
    name: str
    #: Bytes in the data area (a multiple of 8).
    capacity: int
    num_readers: int

    def reader_wake_name(self, reader_index: int) -> str:
        return f"{self.name}.r{reader_index}"

    @property
    def writer_wake_name(self) -> str:
        return f"{self.name}.w"


class RingStatistics(NamedTuple):
    #: Bytes in the data area.
    capacity: int
    #: Bytes published and not yet consumed (by the slowest reader, for the writer).
    num_bytes_pending: int
    #: This end's 64-bit byte position.
    position: int


def _create_segment(prefix: str, num_readers: int, capacity: int, position: int) -> ShmSegment:
    if not 64 <= capacity <= 1 << 31:
        raise ValueError(f"capacity must be in [64, 2**31], got {capacity}")
    if not 1 <= num_readers <= 1024:
        raise ValueError(f"num_readers must be in [1, 1024], got {num_readers}")
    if position < 0 or position % 8:
        raise ValueError(f"initial_position must be a non-negative multiple of 8: {position}")
    capacity = (capacity + 7) & -8
    data_offset = _reader_base(num_readers) * 8
    seg = ShmSegment.create(
        f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}", data_offset + capacity
    )
    q = seg.q
    q[_CAPACITY], q[_NUM_READERS], q[_DATA_OFFSET] = capacity, num_readers, data_offset
    for i in [_WRITE_POS] + [_reader_base(i) + _READ_POS for i in range(num_readers)]:
        q[i] = position
    q[1] = _VERSION
    q[0] = _MAGIC  # last: marks the header complete
    return seg


def _attach_segment(handle: RingHandle) -> ShmSegment:
    seg = ShmSegment.attach(handle.name)
    q = seg.q
    if (
        q[0] != _MAGIC
        or q[1] != _VERSION
        or q[_CAPACITY] != handle.capacity
        or q[_NUM_READERS] != handle.num_readers
        or len(seg.mm) < q[_DATA_OFFSET] + handle.capacity  # NOTE: >=, sizes may be rounded up
    ):
        seg.close()
        raise ValueError(f"shm segment {handle.name!r} does not match its handle")
    return seg


class _End:
    """What both ends share: the mapping, a fence, wake-up sockets, the liveness watch.

    Takes ownership of `seg`: closes it (and unlinks it, if owned) when opening fails.
    """

    def __init__(self, seg: ShmSegment, wake_name: str | None = None) -> None:
        self._handle = RingHandle(seg.name, seg.q[_CAPACITY], seg.q[_NUM_READERS])
        try:
            # First: binding the wake-up name fails if this end is already open elsewhere.
            self._waker = Waker(wake_name or self._handle.writer_wake_name)
        except BaseException:
            seg.close()
            raise
        self._seg, self._q, self._mm = seg, seg.q, seg.mm
        self._cap = self._handle.capacity
        self._base = self._q[_DATA_OFFSET]
        self._fence = Fence()
        self._sender = WakeSender()
        self._watch = PeerWatch(self._waker)
        self._closed = False
        #: Seconds to poll before parking; 0 parks at once.
        self.spin_s = SPIN_S

    @property
    def handle(self) -> RingHandle:
        return self._handle

    def _spin_until(self, ready, deadline: float | None) -> bool:
        """Polls `ready()` for up to spin_s, yielding the CPU between polls."""
        spin = self.spin_s if deadline is None else min(self.spin_s, deadline - perf_counter())
        end = perf_counter() + spin
        while perf_counter() < end:
            if ready():
                return True
            os.sched_yield()
        return False

    def _wait(self, deadline: float | None, what: str) -> None:
        """One parked OS wait: until a wake-up, a watched peer's death, RECHECK_S or deadline."""
        wait = RECHECK_S
        if deadline is not None:
            wait = min(wait, deadline - perf_counter())
            if wait <= 0:
                raise TimeoutError(f"ring {self._handle.name}: {what} timed out")
        self._watch.wait(wait)

    def _release(self) -> None:
        self._closed = True
        self._watch.close()
        self._sender.close()
        self._waker.close()
        self._seg.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class RingWriter(_End):
    """The single writer of a ring.

    Invariants: only this object stores `write_pos`, and `self._wpos` equals it;
    `self._min_read` never exceeds any reader's `read_pos` (refreshed only when space runs out).
    """

    @classmethod
    def create(
        cls,
        *,
        capacity: int = 1 << 22,
        num_readers: int = 1,
        name_prefix: str = "vx",
        initial_position: int = 0,
    ) -> RingWriter:
        """Creates (and owns) a new ring. `initial_position` (a multiple of 8) lets tests start
        the 64-bit counters near 2**32."""
        return cls(_create_segment(name_prefix, num_readers, capacity, initial_position))

    @classmethod
    def attach(cls, handle: RingHandle) -> RingWriter:
        """Opens the writer end of a ring that its reader created."""
        return cls(_attach_segment(handle))

    def __init__(self, seg: ShmSegment) -> None:
        super().__init__(seg)
        q, n = self._q, self._handle.num_readers
        if q[_WRITER_CLOSED]:
            self._release()
            raise ValueError("the writer of this ring has already closed")
        self._read_idx = [_reader_base(i) + _READ_POS for i in range(n)]
        self._wake_targets = [
            (_reader_base(i) + _READER_PARKED, self._handle.reader_wake_name(i)) for i in range(n)
        ]
        self._wpos = q[_WRITE_POS]
        self._min_read = min(q[i] for i in self._read_idx)
        self._max_frame = self._cap - _HDR
        # Chunks of half the ring let the reader drain one while the writer fills the next.
        self._chunk = (self._cap // 2 - _HDR) & -8
        q[_WRITER_PID] = os.getpid()

    def send(self, data: bytes | memoryview, timeout: float | None = None) -> None:
        """Publishes one message, blocking while the ring is full.

        Raises TimeoutError (then no part of the message is delivered), anyio.BrokenResourceError
        when a reader it waits for died or closed, anyio.ClosedResourceError after close().
        """
        if self._closed:
            raise anyio.ClosedResourceError
        if type(data) is not bytes:
            data = memoryview(data).cast("B")
        n = len(data)
        if n > self._max_frame:
            return self._send_chunked(data, _deadline(timeout))
        size = _HDR + ((n + 7) & -8)
        pos = self._wpos
        if pos + size - self._min_read > self._cap:
            self._wait_space(pos + size - self._cap, _deadline(timeout))
        self._put(pos, data, n, _START | _END)
        self._publish(pos + size)

    def send_nowait(self, data: bytes | memoryview) -> None:
        """Publishes one message if it fits now, else raises anyio.WouldBlock.

        A message that can never fit whole (over capacity - 8 bytes) raises ValueError: use send.
        """
        if self._closed:
            raise anyio.ClosedResourceError
        if type(data) is not bytes:
            data = memoryview(data).cast("B")
        n = len(data)
        if n > self._max_frame:
            raise ValueError(f"a {n}-byte message never fits the ring at once: use send()")
        size = _HDR + ((n + 7) & -8)
        pos = self._wpos
        if pos + size - self._min_read > self._cap and self._refresh() < pos + size - self._cap:
            raise anyio.WouldBlock
        self._put(pos, data, n, _START | _END)
        self._publish(pos + size)

    def _send_chunked(self, data: bytes | memoryview, deadline: float | None) -> None:
        view = memoryview(data)
        n, done, flags = len(view), 0, _START
        while done < n:
            k = min(self._chunk, n - done)
            if done + k == n:
                flags |= _END
            size = _HDR + ((k + 7) & -8)
            pos = self._wpos
            if pos + size - self._min_read > self._cap:
                self._wait_space(pos + size - self._cap, deadline)
            self._put(pos, view[done : done + k], k, flags)
            self._publish(pos + size)
            done += k
            flags = 0

    def _put(self, pos: int, data: bytes | memoryview, n: int, flags: int) -> None:
        cap, base, mm = self._cap, self._base, self._mm
        off = pos % cap
        self._q[(base + off) >> 3] = n | (flags << 32)
        start = off + _HDR
        if start == cap:
            start = 0
        end = start + n
        if end <= cap:
            mm[base + start : base + end] = data
        else:  # the payload wraps around the end of the data area
            view, k = memoryview(data), cap - start
            mm[base + start : base + cap] = view[:k]
            mm[base : base + n - k] = view[k:]

    def _publish(self, new_pos: int) -> None:
        q = self._q
        if _WEAK_ORDER:
            self._fence()  # the payload stores before the counter store
        q[_WRITE_POS] = self._wpos = new_pos
        self._fence()  # the counter store before the parked-flag loads (Dekker)
        for parked_idx, wake_name in self._wake_targets:
            if q[parked_idx]:
                self._sender.wake(wake_name)

    def _refresh(self) -> int:
        q = self._q
        self._min_read = min_read = min([q[i] for i in self._read_idx])
        return min_read

    def _wait_space(self, target: int, deadline: float | None) -> None:
        """Waits until every reader's read_pos >= target: spins, then parks."""
        if self._spin_until(lambda: self._refresh() >= target, deadline):
            return
        q = self._q
        while True:
            q[_WRITER_PARKED] = 1
            try:
                self._fence()  # the parked store before the read_pos loads (Dekker)
                if self._refresh() >= target:
                    return
                self._check_readers(target)
                self._wait(deadline, "send on a full ring")
            finally:
                q[_WRITER_PARKED] = 0
            self._waker.drain()

    def _check_readers(self, target: int) -> None:
        """Raises BrokenResourceError if a reader that holds the writer back is gone."""
        q = self._q
        for i in range(self._handle.num_readers):
            b = _reader_base(i)
            if q[b + _READ_POS] >= target:
                continue
            pid = q[b + _READER_PID]
            if q[b + _READER_CLOSED]:
                raise anyio.BrokenResourceError(f"ring {self._handle.name}: reader {i} closed")
            if pid:
                self._watch.update([pid])
                if self._watch.dead(pid) and q[b + _READ_POS] < target:
                    raise anyio.BrokenResourceError(
                        f"ring {self._handle.name}: reader {i} (pid {pid}) died"
                    )

    def statistics(self) -> RingStatistics:
        return RingStatistics(self._cap, self._wpos - self._refresh(), self._wpos)

    def close(self) -> None:
        """Ends the stream (readers drain it, then get EndOfStream); the creator also unlinks
        the segment. Idempotent."""
        if self._closed:
            return
        q = self._q
        q[_WRITER_CLOSED] = 1
        self._fence()
        for parked_idx, wake_name in self._wake_targets:
            if q[parked_idx]:
                self._sender.wake(wake_name)
        self._release()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else perf_counter() + timeout


class RingReader(_End):
    """One reader of a ring.

    Invariants: only this object stores its `read_pos`, and `self._rpos` equals it;
    `self._wseen` is a `write_pos` value already loaded, so [rpos, wseen) is readable without
    touching the writer's line; `self._parts` holds the chunks of a message in progress.
    """

    @classmethod
    def create(
        cls, *, capacity: int = 1 << 22, name_prefix: str = "vx", initial_position: int = 0
    ) -> RingReader:
        """Creates (and owns) a new single-reader ring; the writer attaches with the handle."""
        return cls(_create_segment(name_prefix, 1, capacity, initial_position), 0)

    @classmethod
    def attach(cls, handle: RingHandle, reader_index: int = 0) -> RingReader:
        """Opens reader `reader_index` (0 <= reader_index < num_readers) of an existing ring."""
        if not 0 <= reader_index < handle.num_readers:
            raise ValueError(f"reader_index {reader_index} not in [0, {handle.num_readers})")
        return cls(_attach_segment(handle), reader_index)

    def __init__(self, seg: ShmSegment, reader_index: int) -> None:
        super().__init__(seg, RingHandle(seg.name, 0, 0).reader_wake_name(reader_index))
        b, q = _reader_base(reader_index), self._q
        if q[b + _READER_CLOSED]:
            self._release()
            raise ValueError(f"reader {reader_index} of this ring has already closed")
        self._read_idx = b + _READ_POS
        self._parked_idx = b + _READER_PARKED
        self._closed_idx = b + _READER_CLOSED
        self._writer_wake_name = self._handle.writer_wake_name
        self._rpos = self._wseen = q[self._read_idx]
        self._parts: list[bytes] | None = None
        q[b + _READER_PID] = os.getpid()

    def fileno(self) -> int:
        """The wake-up socket: readable once the writer published to this reader while parked."""
        return self._waker.fileno()

    def recv(self, timeout: float | None = None) -> bytes:
        """Returns the next message, waiting for it (spin, then park).

        Raises TimeoutError, anyio.EndOfStream (writer closed, all drained),
        anyio.BrokenResourceError (writer died, all drained), anyio.ClosedResourceError.
        """
        if self._closed:
            raise anyio.ClosedResourceError
        msg = self._poll()
        if msg is not None:
            return msg
        deadline = _deadline(timeout)
        q, rpos = self._q, self._rpos
        if self._spin_until(lambda: q[_WRITE_POS] != rpos or q[_WRITER_CLOSED], deadline):
            msg = self._poll()
            if msg is not None:
                return msg
        while True:
            q[self._parked_idx] = 1
            try:
                msg = self._poll_parked()
                if msg is not None:
                    return msg
                self._wait(deadline, "recv")
            finally:
                q[self._parked_idx] = 0
            self._waker.drain()

    def recv_nowait(self) -> bytes:
        """Returns the next message if one is complete, else raises anyio.WouldBlock
        (or EndOfStream / BrokenResourceError, as recv)."""
        if self._closed:
            raise anyio.ClosedResourceError
        msg = self._poll()
        if msg is None and self._check_writer():
            msg = self._poll()
        if msg is None:
            raise anyio.WouldBlock
        return msg

    async def receive(self) -> bytes:
        """recv for the event loop: parks on `anyio.wait_readable` of the wake-up socket (no
        thread). Cancellation never loses a message: messages are taken synchronously."""
        await anyio.lowlevel.checkpoint()
        q = self._q
        while True:
            try:
                return self.recv_nowait()
            except anyio.WouldBlock:
                pass
            q[self._parked_idx] = 1
            try:
                msg = self._poll_parked()
                if msg is not None:
                    return msg
                # NOTE: the pidfd is not in this wait, so writer death is seen within RECHECK_S.
                with anyio.move_on_after(RECHECK_S):
                    await anyio.wait_readable(self._waker.fileno())
            finally:
                q[self._parked_idx] = 0
            self._waker.drain()

    def _poll_parked(self) -> bytes | None:
        """With the parked flag stored: a message, or None when the caller may block."""
        while True:
            self._fence()  # the parked store before the write_pos load (Dekker)
            msg = self._poll()
            if msg is not None or not self._check_writer():
                return msg

    def _poll(self) -> bytes | None:
        """Consumes published frames until one message is complete; None when they run out."""
        q, mm, cap, base = self._q, self._mm, self._cap, self._base
        while True:
            rpos = self._rpos
            if rpos == self._wseen:
                wpos = q[_WRITE_POS]
                if wpos == rpos:
                    return None
                if _WEAK_ORDER:
                    self._fence()  # the counter load before the payload loads
                self._wseen = wpos
            off = rpos % cap
            header = q[(base + off) >> 3]
            n, flags = header & _LEN_MASK, header >> 32
            size = _HDR + ((n + 7) & -8)
            if size > self._wseen - rpos or flags > (_START | _END):
                raise anyio.BrokenResourceError(
                    f"ring {self._handle.name}: corrupt frame header {header:#x} at {rpos}"
                )
            start = off + _HDR
            if start == cap:
                start = 0
            end = start + n
            if end <= cap:
                payload = mm[base + start : base + end]
            else:
                payload = mm[base + start : base + cap] + mm[base : base + end - cap]
            # The copy above is complete before this store hands the bytes back (TSO).
            q[self._read_idx] = self._rpos = rpos + size
            self._fence()  # the read_pos store before the writer_parked load (Dekker)
            if q[_WRITER_PARKED]:
                self._sender.wake(self._writer_wake_name)
            if flags == _START | _END:
                self._parts = None  # drops a torn chunked message, if any
                return payload
            if flags & _START:
                self._parts = [payload]
            elif self._parts is not None:
                self._parts.append(payload)
            if flags & _END and self._parts is not None:
                parts, self._parts = self._parts, None
                return b"".join(parts)

    def _check_writer(self) -> bool:
        """For when no message is complete: True if bytes arrived meanwhile; raises EndOfStream
        or BrokenResourceError when the writer is gone and everything is drained."""
        q = self._q
        if q[_WRITER_CLOSED]:
            # writer_closed is stored after the last write_pos, so this load is final.
            if q[_WRITE_POS] != self._rpos:
                return True
            self._parts = None
            raise anyio.EndOfStream
        pid = q[_WRITER_PID]
        if pid:
            self._watch.update([pid])
            if self._watch.dead(pid):
                if q[_WRITE_POS] != self._rpos or q[_WRITER_CLOSED]:
                    return True
                raise anyio.BrokenResourceError(f"ring {self._handle.name}: writer {pid} died")
        return False

    def statistics(self) -> RingStatistics:
        return RingStatistics(self._cap, self._q[_WRITE_POS] - self._rpos, self._rpos)

    def close(self) -> None:
        """Detaches: a writer waiting on this reader then raises BrokenResourceError; the
        creator also unlinks the segment. Idempotent."""
        if self._closed:
            return
        q = self._q
        q[self._closed_idx] = 1
        self._fence()
        if q[_WRITER_PARKED]:
            self._sender.wake(self._writer_wake_name)
        self._release()


class RingOwner:
    """Owns a ring's segment without holding either end.

    The launcher creates the EngineCore <-> Worker rings this way: both ends live in children,
    but the segment must belong to the process that outlives them, so that it (or, if it is
    killed, its resource tracker) unlinks it.
    """

    def __init__(self, seg: ShmSegment) -> None:
        self._seg = seg
        self._handle = RingHandle(seg.name, seg.q[_CAPACITY], seg.q[_NUM_READERS])
        self._closed = False

    @classmethod
    def create(
        cls, *, capacity: int = 1 << 22, num_readers: int = 1, name_prefix: str = "vx"
    ) -> RingOwner:
        return cls(_create_segment(name_prefix, num_readers, capacity, 0))

    @property
    def handle(self) -> RingHandle:
        return self._handle

    def close(self) -> None:
        """Unlinks the segment (ends that are open keep their mapping). Idempotent."""
        if not self._closed:
            self._closed = True
            self._seg.close()
