"""Shared-memory rings: the byte pipes between vx's processes.

Runs in: every process (ApiServer, EngineCore, Workers); each process holds one end of a ring.

A ring has one writer and `num_readers` readers; every reader sees every message, in order
(1 reader: a pipe; N: the EngineCore -> Workers broadcast). The writer never overwrites bytes
some reader has not consumed. Messages are opaque bytes (`vx.ipc.codec`); one larger than the ring
is cut into chunks that the reader joins again.

The segment's byte layout, its ownership and `RingHandle` are in `vx.ipc.segment`; waiting
and liveness in `vx.ipc.wait`; the reader (and zero-copy `RingView`s) in `vx.ipc.reader`.

`write_pos`/`read_pos` are monotonically increasing 64-bit byte counters (far too wide to
wrap in practice); [min(read_pos), write_pos) is published and unconsumed. A frame is a u64
header (`length | flags << 32`) and the payload padded to 8 bytes; frames are 8-aligned, so a
header never straddles the end of the data area (a payload may: the reader then copies both
pieces). A message is one START|END frame, or START, middles, END. A single frame that would
wrap, or one of at least `REWIND_MIN` bytes, goes to offset 0 instead, after a PAD frame that
fills the end, whenever that space is already free: so a message up to capacity/2 lies in one
piece unless the ring is backed up (readers view it in place), and large messages keep reusing
the same cache-hot bytes instead of sweeping the whole ring.
If `send` times out mid-message, the reader drops the torn part at the next START (or end of
stream): messages arrive whole or not at all.

Memory ordering: the writer copies the payload, then stores `write_pos`; the reader loads
`write_pos`, copies the payload (or its user reads a view, then releases it), then stores its
`read_pos`; the writer loads `read_pos` before it overwrites. Each access is its own C call (an `mmap` slice copy, or one aligned 8-byte
`memcpy` for a u64 item: no torn counters), so the compiler cannot reorder them, and x86-TSO
keeps store/store, load/load and load/store order: with one writer, a published counter implies
published bytes. Weakly ordered CPUs (ARM, POWER) need barriers there: the ring then fences
after the payload, after the counter load and before `read_pos` stores (`_WEAK_ORDER`); x86
skips those calls.

Waiting: an empty reader spins for `spin_s` (`SPIN_S`, `sched_yield` between polls), then parks:
it stores a fresh park episode number in `reader_parked`, fences, re-checks `write_pos` and
`writer_closed`, and only then blocks in `poll` on its wake-up socket and the writer's pidfd.
The writer stores `write_pos`, fences, and wakes a reader whose flag holds an episode not yet
woken (one datagram per park). Both fences are needed: x86 lets a load pass an earlier store
(Dekker's handshake). A writer facing a full ring parks the same way (`writer_parked`). While the
writer copies a large frame in, it raises `writer_busy`, a hint that keeps a spinning reader
spinning (up to `BUSY_SPIN_S`) instead of parking just before the frame lands. Idle
rings cost no CPU, busy ones no syscalls; OS waits still wake every `RECHECK_S` to check
liveness (which also bounds the cost of a lost wake-up).

Peer death: each end stores its pid on opening. A waiting reader watches the writer's pidfd:
gone without `close()` -> anyio.BrokenResourceError (after draining what it published); after
`close()` -> anyio.EndOfStream. A blocked writer raises anyio.BrokenResourceError when a reader
died or closed. The creator owns and unlinks the segment (resource-tracker rules:
`vx.ipc.segment.ShmSegment`).

A ring end is not thread-safe: use each from one thread (or one task) at a time.
"""

from __future__ import annotations

import os
from time import perf_counter
from typing import TypeAlias

import anyio

from vx.ipc import segment as rs
from vx.ipc.reader import RingReader, RingView
from vx.ipc.segment import END, HDR, PAD, START, RingHandle, RingOwner, RingStatistics, ShmSegment
from vx.ipc.wait import FENCE_IS_FULL, RECHECK_S, SPIN_S, RingEnd

__all__ = [
    "RECHECK_S",
    "SPIN_S",
    "RingHandle",
    "RingOwner",
    "RingReader",
    "RingStatistics",
    "RingView",
    "RingWriter",
]

_WEAK_ORDER = not FENCE_IS_FULL

#: Messages from this size on go back to offset 0 whenever that space is free (see `_send`).
REWIND_MIN = 8 << 10

#: Frames from this size on raise `writer_busy` while they are copied in.
BUSY_MIN = 64 << 10

#: What `send` accepts: anything with a contiguous buffer (collections.abc.Buffer is 3.12+).
Buffer: TypeAlias = bytes | bytearray | memoryview


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
        q, n = self._q, self._handle.num_readers
        if q[rs.WRITER_CLOSED]:
            self._release()
            raise ValueError("the writer of this ring has already closed")
        self._read_idx = [rs.READERS + 8 * i + rs.READ_POS for i in range(n)]
        self._wake_targets = [
            (rs.READERS + 8 * i + rs.READER_PARKED, f"{seg.name}.r{i}") for i in range(n)
        ]
        self._woken = [0] * n  # the park episode each reader was last woken for
        self._wpos = q[rs.WRITE_POS]
        self._min_read = min(q[i] for i in self._read_idx)
        self._max_frame = self._cap - HDR
        # Chunks of half the ring let the reader drain one while the writer fills the next.
        self._chunk = (self._cap // 2 - HDR) & -8
        q[rs.WRITER_PID] = os.getpid()

    def send(self, data: Buffer, timeout: float | None = None) -> None:
        """Publishes one message (any contiguous buffer: bytes, bytearray, a memoryview such as
        a received `RingView.data`), copied once into the ring; blocks while the ring is full.

        Raises TimeoutError (then no part of the message is delivered), anyio.BrokenResourceError
        when a reader died or closed while the writer waits, anyio.ClosedResourceError after close.
        """
        if not self._send_now(data):
            self._send(data, None if timeout is None else perf_counter() + timeout, False)

    def send_nowait(self, data: Buffer) -> None:
        """Publishes one message if it fits now, else raises anyio.WouldBlock.

        A message that never fits whole (over capacity - 8 bytes) raises ValueError: use send.
        """
        if not self._send_now(data):
            self._send(data, None, True)

    def _send_now(self, data: Buffer) -> bool:
        """The fast path of `send`: True if `data` went out as one frame, into space already
        free, placed exactly as `_send` would place it; False leaves everything to `_send`
        (chunks, waiting, a frame that wraps around without rewinding, errors)."""
        t = type(data)
        n = len(data) if t is bytes or t is bytearray else data.nbytes if t is memoryview else -1
        if 0 <= n <= self._max_frame and not self._closed:
            pos, cap = self._wpos, self._cap
            off = pos % cap
            size = HDR + ((n + 7) & -8)
            if size < REWIND_MIN and off + size <= cap:  # stays where it is
                target = pos + size - cap
                if target <= self._min_read or self._refresh() >= target:
                    self._publish(pos, data, n, START | END, pos + size)
                    return True
            elif 0 < off and size <= off and (size >= REWIND_MIN or off + HDR < cap):
                # Rewinds to offset 0 after a PAD frame (see `_send`), if that fits now.
                target = pos - off + size
                if target <= self._min_read or self._refresh() >= target:
                    self._q[(self._base + off) >> 3] = (cap - off - HDR) | (PAD << 32)
                    pos += cap - off
                    self._publish(pos, data, n, START | END, pos + size)
                    return True
        return False

    def _send(self, data: Buffer, deadline: float | None, nowait: bool) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if type(data) is not bytes:
            data = memoryview(data).cast("B")
        n, cap = len(data), self._cap
        if n > self._max_frame:
            if nowait:
                raise ValueError(f"a {n}-byte message never fits the ring at once: use send()")
            data = memoryview(data)  # chunks are slices: views, not copies
        done, flags = 0, START
        while True:
            k = n - done
            if k <= self._max_frame:
                flags |= END
            else:
                k = self._chunk
            size = HDR + ((k + 7) & -8)
            pos = self._wpos
            while True:
                need = pos + size - cap  # every reader's read_pos must reach this
                if flags == START | END and (off := pos % cap):
                    # At offset 0 after a PAD frame, if that fits now: a frame that would wrap
                    # then lies in one piece (readers view it in place), and large messages
                    # keep reusing the same, cache-hot, bytes. Never waits longer for it.
                    wraps = off + HDR < cap < off + size
                    pad = cap - off if (wraps or size >= REWIND_MIN) and size <= off else 0
                    if pad and self._fits(need + pad):
                        break
                pad = 0
                if self._fits(need):
                    break
                if nowait:
                    raise anyio.WouldBlock
                self._wait_space(need, deadline)
            if pad:
                # Published together with the frame after it (by the same write_pos store).
                self._q[(self._base + off) >> 3] = (pad - HDR) | (PAD << 32)
                pos += pad
            self._publish(pos, data if k == n else data[done : done + k], k, flags, pos + size)
            done += k
            if done == n:
                return
            flags = 0

    def _publish(self, pos: int, data: Buffer, n: int, flags: int, next_pos: int) -> None:
        """Writes one frame at `pos`, then publishes it and wakes parked readers."""
        q = self._q
        busy = n >= BUSY_MIN
        if busy:
            q[rs.WRITER_BUSY] = 1  # a hint only: spinning readers keep spinning
        try:
            self._copy_frame(pos, data, n, flags, next_pos)
        finally:
            if busy:
                q[rs.WRITER_BUSY] = 0  # after write_pos: a reader that sees 0 sees the frame
        self._wake_parked()

    def _wake_parked(self) -> None:
        """After a `write_pos` store: wakes each reader parked in an episode not yet woken."""
        self._fence_release()  # the counter store before the parked-flag loads (Dekker)
        self._fence_acquire()
        q, i = self._q, 0
        for parked_idx, wake_name in self._wake_targets:
            episode = q[parked_idx]
            if episode and episode != self._woken[i]:  # one wake-up per park is enough
                self._woken[i] = episode
                self._sender.wake(wake_name)
            i += 1

    def _copy_frame(self, pos: int, data: Buffer, n: int, flags: int, next_pos: int) -> None:
        """The header, the payload, then `write_pos`."""
        q, cap, base, mm = self._q, self._cap, self._base, self._mm
        off = pos % cap
        q[(base + off) >> 3] = n | (flags << 32)
        start = off + HDR
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
        q[rs.WRITE_POS] = self._wpos = next_pos

    def _fits(self, target: int) -> bool:
        return target <= self._min_read or self._refresh() >= target

    def _refresh(self) -> int:
        q, idx = self._q, self._read_idx
        self._min_read = min_read = q[idx[0]] if len(idx) == 1 else min([q[i] for i in idx])
        return min_read

    def _wait_space(self, target: int, deadline: float | None) -> None:
        """Waits until every reader's read_pos >= target: spins, then parks."""
        if self._spin(lambda: self._refresh() >= target, deadline):
            return
        q = self._q
        while True:
            self._episode += 1
            q[rs.WRITER_PARKED] = self._episode
            try:
                self._fence()  # the parked store before the read_pos loads (Dekker)
                if self._refresh() >= target:
                    return
                self._check_readers()
                woken = self._watch.wait(deadline, RECHECK_S)
            finally:
                q[rs.WRITER_PARKED] = 0
            if woken:
                self._waker.consume()

    def _check_readers(self) -> None:
        """While blocked: raises BrokenResourceError if any reader closed or died (a reader
        that will never read again holds the writer back sooner or later)."""
        q, watch = self._q, self._watch
        check = watch.should_check()
        for i in range(self._handle.num_readers):
            pid = q[rs.READERS + 8 * i + rs.READER_PID]
            if q[rs.READERS + 8 * i + rs.READER_CLOSED]:
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
        q[rs.WRITER_CLOSED] = 1
        self._fence()
        for parked_idx, wake_name in self._wake_targets:
            if q[parked_idx]:
                self._sender.wake(wake_name)
        self._release()
