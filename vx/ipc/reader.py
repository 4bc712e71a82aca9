"""The reading end of a `vx.ipc.ring` ring, and `RingView`: a message read in place.

Runs in: every process that receives over a ring (ApiServer, EngineCore, Workers).

Two ways to take a message:

- `recv` / `recv_nowait` / `receive` copy it out into a fresh `bytes` and give its ring space
  back at once;
- `recv_view` / `recv_view_nowait` / `receive_view` return a `RingView` whose `data` is a
  read-only memoryview of the ring's shared memory: no copy, no fresh allocation (whose page
  faults dominate large messages). The ring space stays reserved until the view is released
  (`with reader.recv_view() as data: ...`, or `view.release()`): until then the writer cannot
  reuse it, and a full ring blocks it. Messages that do not lie in one piece (chunked ones,
  larger than the ring, or the rare single frame that wraps around the end) are copied
  instead; their views hold no ring space.

Views may be released in any order; the reader's `read_pos` (which frees space for the writer)
advances to the start of the oldest view still held. Keep nothing that refers to `data`'s
memory (a slice, a numpy array, a `msgspec.Raw`) past `release()`: the writer will overwrite
those bytes. `release()` raises BufferError (and keeps the space) while something holds a
buffer export of `data` itself, but slices and some arrays do not count as exports.
"""

from __future__ import annotations

import collections
import os
from time import perf_counter

import anyio
import anyio.lowlevel

from vx.ipc import segment as rs
from vx.ipc.segment import END, HDR, LEN_MASK, PAD, START, RingHandle, RingStatistics, ShmSegment
from vx.ipc.wait import BUSY_SPIN_S, FENCE_IS_FULL, RECHECK_S, RingEnd

__all__ = ["RingReader", "RingView"]

_WEAK_ORDER = not FENCE_IS_FULL


class RingView:
    """One received message: `data` (read-only) is valid until `release()`.

    Invariant: while `_reader` is set, the reader's published `read_pos` is at or before
    `_start`, so the writer never overwrites the bytes under `data`. `_reader` is None for a
    released view and for a copied message (which holds no ring space).
    """

    __slots__ = ("_reader", "_start", "data")

    def __init__(self, data: memoryview, reader: RingReader | None, start: int) -> None:
        self.data = data
        self._reader = reader
        self._start = start

    def __len__(self) -> int:
        return self.data.nbytes

    def release(self) -> None:
        """Gives the ring space back (BufferError if something still exports `data`).
        Idempotent."""
        self.data.release()  # first: raises BufferError if something still exports it
        reader, self._reader = self._reader, None
        if reader is not None:
            reader._release_view(self)

    def __enter__(self) -> memoryview:
        return self.data

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class RingReader(RingEnd):
    """One reader of a ring.

    Invariants: only this object stores its `read_pos`, and `self._published` equals it;
    `self._rpos` is the next frame to parse; `read_pos` is the `_start` of the oldest view in
    `self._held`, else `self._rpos` (or, just after a PAD frame, that frame's start); `self._wseen` is a `write_pos` value already loaded, so
    [rpos, wseen) is readable without touching the writer's line; `self._parts` holds the
    chunks of a message in progress.
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
        b, q = rs.READERS + 8 * reader_index, self._q
        if q[b + rs.READER_CLOSED]:
            self._release()
            raise ValueError(f"reader {reader_index} of this ring has already closed")
        self._read_idx, self._parked_idx = b + rs.READ_POS, b + rs.READER_PARKED
        self._closed_idx = b + rs.READER_CLOSED
        self._writer_wake_name = seg.name + ".w"
        self._rpos = self._wseen = self._published = q[self._read_idx]
        self._parts: list[bytes] | None = None
        self._held: collections.deque[RingView] = collections.deque()
        self._woken = 0  # the writer's park episode this reader last woke it for
        q[b + rs.READER_PID] = os.getpid()

    def fileno(self) -> int:
        """The wake-up socket: readable once the writer published to this reader while parked."""
        return self._waker.fileno()

    def recv(self, timeout: float | None = None) -> bytes:
        """Returns the next message, waiting for it (spin, then park).

        Raises TimeoutError, anyio.EndOfStream (writer closed, all drained),
        anyio.BrokenResourceError (writer died, all drained), anyio.ClosedResourceError.
        """
        return self._recv(timeout, False)  # type: ignore[return-value]

    def recv_view(self, timeout: float | None = None) -> RingView:
        """recv, but the message is read in place (see the module docstring): release it."""
        return self._recv(timeout, True)  # type: ignore[return-value]

    def recv_nowait(self) -> bytes:
        """Returns the next message if one is complete, else raises anyio.WouldBlock
        (or EndOfStream / BrokenResourceError, as recv)."""
        return self._recv_nowait(False)  # type: ignore[return-value]

    def recv_view_nowait(self) -> RingView:
        """recv_nowait, read in place (see `recv_view`)."""
        return self._recv_nowait(True)  # type: ignore[return-value]

    async def receive(self) -> bytes:
        """recv for the event loop: parks on `anyio.wait_readable` of the wake-up socket (no
        thread). Cancellation never loses a message: messages are taken synchronously."""
        return await self._receive(False)  # type: ignore[return-value]

    async def receive_view(self) -> RingView:
        """receive, read in place (see `recv_view`)."""
        return await self._receive(True)  # type: ignore[return-value]

    def _recv(self, timeout: float | None, view: bool) -> bytes | RingView:
        if self._closed:
            raise anyio.ClosedResourceError
        msg = self._poll(view)
        if msg is not None:
            return msg
        deadline = None if timeout is None else perf_counter() + timeout
        q, rpos = self._q, self._rpos

        def ready() -> bool:
            return q[rs.WRITE_POS] != rpos or bool(q[rs.WRITER_CLOSED])

        if self._spin(ready, deadline) or (
            q[rs.WRITER_BUSY]  # the writer is copying a large frame in: worth waiting for
            and self._spin(lambda: ready() or not q[rs.WRITER_BUSY], deadline, BUSY_SPIN_S)
        ):
            msg = self._poll(view)
            if msg is not None:
                return msg
        while (msg := self._park(view)) is None:
            woken = False
            try:
                woken = self._watch.wait(deadline, RECHECK_S)
            finally:
                self._unpark(woken)
        return msg

    def _recv_nowait(self, view: bool) -> bytes | RingView:
        if self._closed:
            raise anyio.ClosedResourceError
        msg = self._poll(view)
        if msg is None and self._check_writer():
            msg = self._poll(view)
        if msg is None:
            raise anyio.WouldBlock
        return msg

    async def _receive(self, view: bool) -> bytes | RingView:
        await anyio.lowlevel.checkpoint()
        if self._closed:
            raise anyio.ClosedResourceError
        msg = self._poll(view)
        while msg is None and (msg := self._park(view)) is None:
            woken = False
            try:
                # NOTE: the pidfd is not in this wait, so writer death is seen within RECHECK_S.
                with anyio.move_on_after(RECHECK_S):
                    await anyio.wait_readable(self._waker.fileno())
                    woken = True
            finally:
                self._unpark(woken)
        return msg

    def _park(self, view: bool) -> bytes | RingView | None:
        """Stores a fresh park episode and polls again: a message (then unparked), or None
        (still parked: the caller blocks, then calls `_unpark`)."""
        self._episode += 1
        self._q[self._parked_idx] = self._episode
        try:
            while True:
                self._fence()  # the parked store before the write_pos load (Dekker)
                msg = self._poll(view)
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

    def _poll(self, view: bool) -> bytes | RingView | None:
        """Consumes published frames until one message is complete; None when they run out.
        With `view`, a message in one contiguous piece is returned in place (and held)."""
        q, buf, cap, base = self._q, self._buf, self._cap, self._base
        while True:
            rpos = self._rpos
            if rpos == self._wseen:
                wpos = q[rs.WRITE_POS]
                if wpos == rpos:
                    return None
                if _WEAK_ORDER:
                    self._fence()  # the counter load before the payload loads
                self._wseen = wpos
            off = rpos % cap
            header = q[(base + off) >> 3]
            n, flags = header & LEN_MASK, header >> 32
            size = HDR + ((n + 7) & -8)
            if size > self._wseen - rpos or flags > PAD:
                raise anyio.BrokenResourceError(f"ring {self._handle.name}: corrupt frame {rpos}")
            self._rpos = rpos + size
            if flags == PAD:  # filler up to the end of the data area
                continue  # published with the frame after it: that one stores read_pos
            start = off + HDR
            if start == cap:
                start = 0
            end = start + n
            if end <= cap:
                if view and flags == START | END:
                    self._parts = None  # drops a torn chunked message, if any
                    if not self._held and rpos != self._published:
                        self._store_read_pos(rpos)  # gives back a PAD frame just skipped
                    held = RingView(buf[base + start : base + end], self, rpos)
                    self._held.append(held)
                    return held
                payload = self._mm[base + start : base + end]
            else:  # wraps around the end of the data area: one copy of both pieces
                payload = b"".join((buf[base + start : base + cap], buf[base : base + end - cap]))
            # The copy above is complete before this hands the bytes back.
            self._consumed()
            if flags == START | END:
                self._parts = None
                return RingView(memoryview(payload), None, rpos) if view else payload
            if flags & START:
                self._parts = [payload]
            elif self._parts is not None:
                self._parts.append(payload)
            if flags & END and self._parts is not None:
                parts, self._parts = self._parts, None
                msg = b"".join(parts)
                return RingView(memoryview(msg), None, rpos) if view else msg

    def _consumed(self) -> None:
        """Publishes `_rpos` as `read_pos`, unless a view holds an earlier position."""
        if not self._held:
            self._store_read_pos(self._rpos)

    def _release_view(self, view: RingView) -> None:
        held = self._held
        if self._closed or not held or held[0] is not view:
            return  # released out of order: read_pos waits for the older views
        held.popleft()
        while held and held[0]._reader is None:
            held.popleft()
        self._store_read_pos(held[0]._start if held else self._rpos)

    def _store_read_pos(self, pos: int) -> None:
        """Gives [old read_pos, pos) back to the writer and wakes it if it is parked."""
        q = self._q
        if _WEAK_ORDER:
            self._fence()  # the payload loads (the copy, or the view's user) before the store
        q[self._read_idx] = self._published = pos
        self._fence_release()  # the read_pos store before the writer_parked load (Dekker)
        self._fence_acquire()
        episode = q[rs.WRITER_PARKED]
        if episode and episode != self._woken:  # one wake-up per park is enough
            self._woken = episode
            self._sender.wake(self._writer_wake_name)

    def _check_writer(self) -> bool:
        """For when no message is complete: True if bytes arrived meanwhile; raises EndOfStream
        or BrokenResourceError when the writer is gone and everything is drained."""
        q = self._q
        if q[rs.WRITER_CLOSED]:
            # writer_closed is stored after the last write_pos, so this load is final.
            if q[rs.WRITE_POS] != self._rpos:
                return True
            self._parts = None
            raise anyio.EndOfStream
        pid = q[rs.WRITER_PID]
        if pid:
            self._watch.update([pid])  # puts its pidfd in the wait
            if self._watch.should_check() and self._watch.dead(pid):
                if q[rs.WRITE_POS] != self._rpos or q[rs.WRITER_CLOSED]:
                    return True
                raise anyio.BrokenResourceError(f"ring {self._handle.name}: writer {pid} died")
        return False

    def statistics(self) -> RingStatistics:
        return RingStatistics(self._cap, self._q[rs.WRITE_POS] - self._rpos, self._rpos)

    def close(self) -> None:
        """Detaches: a writer waiting on this reader then raises BrokenResourceError; the
        creator also unlinks the segment. Views still held become invalid. Idempotent."""
        if self._closed:
            return
        for view in self._held:
            view._reader = None
            try:
                view.data.release()
            except BufferError:
                pass  # still exported: `ShmSegment.close` then leaves the mapping to the GC
        self._held.clear()
        q = self._q
        q[self._closed_idx] = 1
        self._fence()
        if q[rs.WRITER_PARKED]:
            self._sender.wake(self._writer_wake_name)
        self._release()
