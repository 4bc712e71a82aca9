"""Shared-memory rings: the byte pipes between vx's processes.

Runs in: every process (ApiServer, EngineCore, Workers); each process holds one end of a ring.

A ring has one writer and `num_readers` readers; every reader sees every message, in order
(1 reader: a pipe; N: the EngineCore -> Workers broadcast). The writer never overwrites bytes
some reader has not consumed. Messages are opaque bytes (`vx.codec`); one larger than the ring
is cut into chunks that the reader joins again.

Segment (`/dev/shm/<prefix>-<creator pid>-<random>`, mode 0600) of native u64 slots; each
party's hot fields have their own 64-byte line::

    line 0        magic | version | capacity | num_readers | data_offset        (constant)
    line 1        write_pos | writer_pid | writer_parked | writer_closed        (writer writes)
    line 2 + i    read_pos | reader_pid | reader_parked | reader_closed         (reader i writes)
    data_offset   `capacity` bytes of frames, addressed by position % capacity

`write_pos`/`read_pos` are monotonically increasing 64-bit byte counters (2**64 bytes take
centuries at 1 GB/s); [min(read_pos), write_pos) is published and unconsumed. A frame is a u64
header (`length | flags << 32`) and the payload padded to 8 bytes; frames are 8-aligned, so a
header never straddles the end of the data area (a payload may: two copies). A message is one
START|END frame, or START, middles, END. If `send` times out mid-message, the reader drops the
torn part at the next START (or end of stream): messages arrive whole or not at all.

Memory ordering: the writer copies the payload, then stores `write_pos`; the reader loads
`write_pos`, copies the payload, then stores its `read_pos`; the writer loads `read_pos` before
it overwrites. Each access is its own C call (an `mmap` slice copy, or one aligned 8-byte
`memcpy` for a u64 item: no torn counters), so the compiler cannot reorder them, and x86-TSO
keeps store/store, load/load and load/store order: with one writer, a published counter implies
published bytes. Weakly ordered CPUs (ARM, POWER) need barriers there: the ring then fences
after the payload and after the counter load (`_WEAK_ORDER`); x86 skips those calls.

Waiting: an empty reader spins for `spin_s` (~50 µs, `sched_yield` between polls), then parks:
it stores a fresh park episode number in `reader_parked`, fences, re-checks `write_pos` and
`writer_closed`, and only then blocks in `poll` on its wake-up socket and the writer's pidfd.
The writer stores `write_pos`, fences, and wakes a reader whose flag holds an episode not yet
woken (one datagram per park). Both fences are needed: x86 lets a load pass an earlier store
(Dekker's handshake). A writer facing a full ring parks the same way (`writer_parked`). Idle
rings cost no CPU, busy ones no syscalls; OS waits still wake every `RECHECK_S` to check
liveness (which also bounds the cost of a lost wake-up).

Peer death: each end stores its pid on opening. A waiting reader watches the writer's pidfd:
gone without `close()` -> anyio.BrokenResourceError (after draining what it published); after
`close()` -> anyio.EndOfStream. A blocked writer raises anyio.BrokenResourceError when a reader
died or closed. The creator owns and unlinks the segment (resource-tracker rules:
`vx.ring_wait.ShmSegment`; the header's slot numbers are there too).

A ring end is not thread-safe: use each from one thread (or one task) at a time.
"""

from __future__ import annotations

import os
from time import perf_counter
from typing import NamedTuple

import anyio
import anyio.lowlevel
import msgspec

from vx import ring_wait as rw
from vx.ring_wait import FENCE_IS_FULL, RECHECK_S, SPIN_S, RingEnd, ShmSegment

__all__ = [
    "RECHECK_S",
    "SPIN_S",
    "RingHandle",
    "RingOwner",
    "RingReader",
    "RingStatistics",
    "RingWriter",
]

_HDR = 8
_START, _END = 1, 2
_LEN_MASK = 0xFFFFFFFF
_WEAK_ORDER = not FENCE_IS_FULL


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


def _layout(seg: ShmSegment) -> tuple[RingHandle, int, int]:
    cap, num_readers, base = seg.q[rw.CAPACITY], seg.q[rw.NUM_READERS], seg.q[rw.DATA_OFFSET]
    return RingHandle(seg.name, cap, num_readers), cap, base


class RingWriter(RingEnd):
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
        return cls(ShmSegment.create_ring(name_prefix, num_readers, capacity, initial_position))

    @classmethod
    def attach(cls, handle: RingHandle) -> RingWriter:
        """Opens the writer end of a ring that its reader created."""
        return cls(ShmSegment.attach_ring(handle.name, handle.capacity, handle.num_readers))

    def __init__(self, seg: ShmSegment) -> None:
        super().__init__(seg, seg.name + ".w")
        self._handle, self._cap, self._base = _layout(seg)
        q, n = self._q, self._handle.num_readers
        if q[rw.WRITER_CLOSED]:
            self._release()
            raise ValueError("the writer of this ring has already closed")
        self._read_idx = [rw.READERS + 8 * i + rw.READ_POS for i in range(n)]
        self._wake_targets = [
            (rw.READERS + 8 * i + rw.READER_PARKED, f"{seg.name}.r{i}") for i in range(n)
        ]
        self._woken = [0] * n  # the park episode each reader was last woken for
        self._wpos = q[rw.WRITE_POS]
        self._min_read = min(q[i] for i in self._read_idx)
        self._max_frame = self._cap - _HDR
        # Chunks of half the ring let the reader drain one while the writer fills the next.
        self._chunk = (self._cap // 2 - _HDR) & -8
        q[rw.WRITER_PID] = os.getpid()

    def send(self, data: bytes | memoryview, timeout: float | None = None) -> None:
        """Publishes one message, blocking while the ring is full.

        Raises TimeoutError (then no part of the message is delivered), anyio.BrokenResourceError
        when a reader died or closed while the writer waits, anyio.ClosedResourceError after close.
        """
        self._send(data, None if timeout is None else perf_counter() + timeout, False)

    def send_nowait(self, data: bytes | memoryview) -> None:
        """Publishes one message if it fits now, else raises anyio.WouldBlock.

        A message that never fits whole (over capacity - 8 bytes) raises ValueError: use send.
        """
        self._send(data, None, True)

    def _send(self, data: bytes | memoryview, deadline: float | None, nowait: bool) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if type(data) is not bytes:
            data = memoryview(data).cast("B")
        n, cap = len(data), self._cap
        if n > self._max_frame:
            if nowait:
                raise ValueError(f"a {n}-byte message never fits the ring at once: use send()")
            data = memoryview(data)  # chunks are slices: views, not copies
        done, flags = 0, _START
        while True:
            k = n - done
            if k <= self._max_frame:
                flags |= _END
            else:
                k = self._chunk
            size = _HDR + ((k + 7) & -8)
            pos = self._wpos
            if pos + size - self._min_read > cap and self._refresh() < pos + size - cap:
                if nowait:
                    raise anyio.WouldBlock
                self._wait_space(pos + size - cap, deadline)
            self._publish(pos, data if k == n else data[done : done + k], k, flags, pos + size)
            done += k
            if done == n:
                return
            flags = 0

    def _publish(
        self, pos: int, data: bytes | memoryview, n: int, flags: int, next_pos: int
    ) -> None:
        """Writes one frame at `pos`, then publishes it and wakes parked readers."""
        q, cap, base, mm = self._q, self._cap, self._base, self._mm
        off = pos % cap
        q[(base + off) >> 3] = n | (flags << 32)
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
        if _WEAK_ORDER:
            self._fence()  # the payload stores before the counter store
        q[rw.WRITE_POS] = self._wpos = next_pos
        self._fence_release()  # the counter store before the parked-flag loads (Dekker)
        self._fence_acquire()
        i = 0
        for parked_idx, wake_name in self._wake_targets:
            episode = q[parked_idx]
            if episode and episode != self._woken[i]:  # one wake-up per park is enough
                self._woken[i] = episode
                self._sender.wake(wake_name)
            i += 1

    def _refresh(self) -> int:
        q = self._q
        self._min_read = min_read = min([q[i] for i in self._read_idx])
        return min_read

    def _wait_space(self, target: int, deadline: float | None) -> None:
        """Waits until every reader's read_pos >= target: spins, then parks."""
        if self._spin(lambda: self._refresh() >= target, deadline):
            return
        q = self._q
        while True:
            self._episode += 1
            q[rw.WRITER_PARKED] = self._episode
            try:
                self._fence()  # the parked store before the read_pos loads (Dekker)
                if self._refresh() >= target:
                    return
                self._check_readers()
                woken = self._watch.wait(deadline, RECHECK_S)
            finally:
                q[rw.WRITER_PARKED] = 0
            if woken:
                self._waker.consume()

    def _check_readers(self) -> None:
        """While blocked: raises BrokenResourceError if any reader closed or died (a reader
        that will never read again holds the writer back sooner or later)."""
        q, watch = self._q, self._watch
        check = watch.should_check()
        for i in range(self._handle.num_readers):
            pid = q[rw.READERS + 8 * i + rw.READER_PID]
            if q[rw.READERS + 8 * i + rw.READER_CLOSED]:
                raise anyio.BrokenResourceError(f"ring {self._handle.name}: reader {i} closed")
            if pid:
                watch.update([pid])  # puts its pidfd in the wait
                if check and watch.dead(pid):
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
        q[rw.WRITER_CLOSED] = 1
        self._fence()
        for parked_idx, wake_name in self._wake_targets:
            if q[parked_idx]:
                self._sender.wake(wake_name)
        self._release()


class RingReader(RingEnd):
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
        return cls(ShmSegment.create_ring(name_prefix, 1, capacity, initial_position), 0)

    @classmethod
    def attach(cls, handle: RingHandle, reader_index: int = 0) -> RingReader:
        """Opens reader `reader_index` (0 <= reader_index < num_readers) of an existing ring."""
        if not 0 <= reader_index < handle.num_readers:
            raise ValueError(f"reader_index {reader_index} not in [0, {handle.num_readers})")
        return cls(
            ShmSegment.attach_ring(handle.name, handle.capacity, handle.num_readers), reader_index
        )

    def __init__(self, seg: ShmSegment, reader_index: int) -> None:
        super().__init__(seg, f"{seg.name}.r{reader_index}")
        self._handle, self._cap, self._base = _layout(seg)
        b, q = rw.READERS + 8 * reader_index, self._q
        if q[b + rw.READER_CLOSED]:
            self._release()
            raise ValueError(f"reader {reader_index} of this ring has already closed")
        self._read_idx, self._parked_idx = b + rw.READ_POS, b + rw.READER_PARKED
        self._closed_idx = b + rw.READER_CLOSED
        self._writer_wake_name = seg.name + ".w"
        self._rpos = self._wseen = q[self._read_idx]
        self._parts: list[bytes] | None = None
        self._woken = 0  # the writer's park episode this reader last woke it for
        q[b + rw.READER_PID] = os.getpid()

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
        deadline = None if timeout is None else perf_counter() + timeout
        q, rpos = self._q, self._rpos
        if self._spin(lambda: q[rw.WRITE_POS] != rpos or q[rw.WRITER_CLOSED], deadline):
            msg = self._poll()
            if msg is not None:
                return msg
        while (msg := self._park()) is None:
            woken = False
            try:
                woken = self._watch.wait(deadline, RECHECK_S)
            finally:
                self._unpark(woken)
        return msg

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
        if self._closed:
            raise anyio.ClosedResourceError
        msg = self._poll()
        while msg is None and (msg := self._park()) is None:
            woken = False
            try:
                # NOTE: the pidfd is not in this wait, so writer death is seen within RECHECK_S.
                with anyio.move_on_after(RECHECK_S):
                    await anyio.wait_readable(self._waker.fileno())
                    woken = True
            finally:
                self._unpark(woken)
        return msg

    def _park(self) -> bytes | None:
        """Stores a fresh park episode and polls again: a message (then unparked), or None
        (still parked: the caller blocks, then calls `_unpark`)."""
        self._episode += 1
        self._q[self._parked_idx] = self._episode
        try:
            while True:
                self._fence()  # the parked store before the write_pos load (Dekker)
                msg = self._poll()
                if msg is not None or not self._check_writer():
                    break
        except BaseException:
            self._q[self._parked_idx] = 0
            raise
        if msg is not None:
            self._q[self._parked_idx] = 0
        return msg

    def _unpark(self, woken: bool) -> None:
        self._q[self._parked_idx] = 0
        if woken:
            self._waker.consume()
        else:
            self._watch.suspect()  # a timeout or the pidfd: check the writer's liveness next

    def _poll(self) -> bytes | None:
        """Consumes published frames until one message is complete; None when they run out."""
        q, mm, cap, base = self._q, self._mm, self._cap, self._base
        while True:
            rpos = self._rpos
            if rpos == self._wseen:
                wpos = q[rw.WRITE_POS]
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
                raise anyio.BrokenResourceError(f"ring {self._handle.name}: corrupt frame {rpos}")
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
            self._fence_release()  # the read_pos store before the writer_parked load (Dekker)
            self._fence_acquire()
            episode = q[rw.WRITER_PARKED]
            if episode and episode != self._woken:  # one wake-up per park is enough
                self._woken = episode
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
        if q[rw.WRITER_CLOSED]:
            # writer_closed is stored after the last write_pos, so this load is final.
            if q[rw.WRITE_POS] != self._rpos:
                return True
            self._parts = None
            raise anyio.EndOfStream
        pid = q[rw.WRITER_PID]
        if pid:
            self._watch.update([pid])  # puts its pidfd in the wait
            if self._watch.should_check() and self._watch.dead(pid):
                if q[rw.WRITE_POS] != self._rpos or q[rw.WRITER_CLOSED]:
                    return True
                raise anyio.BrokenResourceError(f"ring {self._handle.name}: writer {pid} died")
        return False

    def statistics(self) -> RingStatistics:
        return RingStatistics(self._cap, self._q[rw.WRITE_POS] - self._rpos, self._rpos)

    def close(self) -> None:
        """Detaches: a writer waiting on this reader then raises BrokenResourceError; the
        creator also unlinks the segment. Idempotent."""
        if self._closed:
            return
        q = self._q
        q[self._closed_idx] = 1
        self._fence()
        if q[rw.WRITER_PARKED]:
            self._sender.wake(self._writer_wake_name)
        self._release()


class RingOwner:
    """Owns a ring's segment without holding either end.

    The launcher creates the EngineCore <-> Worker rings this way: both ends live in children,
    but the segment must belong to the process that outlives them, so that it (or, if it is
    killed, its resource tracker) unlinks it.
    """

    def __init__(self, seg: ShmSegment) -> None:
        self._seg, self._closed = seg, False
        self.handle: RingHandle = _layout(seg)[0]

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
