"""Tests for zero-copy receive (`RingReader.recv_view` and friends, `RingView`), PAD frames, and
`RingWriter.send` from any buffer.

Runs in: the pytest process, plus spawned children (module-level entry points that get nothing
but ring handles and plain numbers).
"""

from __future__ import annotations

import array
import logging
import mmap
import multiprocessing
import os
import random
import threading

import anyio
import msgspec
import pytest

from vx.ipc import segment as rs
from vx.ipc.ring import BUSY_MIN, REWIND_MIN, RingHandle, RingReader, RingView, RingWriter

PREFIX = "vxringviewtest"
CTX = multiprocessing.get_context("spawn")


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave /dev/shm as it found it."""
    yield
    assert sorted(e for e in os.listdir("/dev/shm") if e.startswith(PREFIX + "-")) == []


def _in_place(view: RingView) -> bool:
    """Whether the view reads the ring's shared memory (not a copy)."""
    return isinstance(view.data.obj, mmap.mmap)


def _pending(w: RingWriter) -> int:
    return w.statistics().num_bytes_pending


def _stream(seed: int, count: int, capacity: int):
    rng = random.Random(seed)
    for i in range(count):
        r = rng.random()
        if r < 0.7:
            n = rng.randrange(0, 300)
        elif r < 0.97:
            n = rng.randrange(300, capacity // 2)
        else:
            n = rng.randrange(capacity // 2, 2 * capacity)  # wraps or is chunked
        yield i.to_bytes(4, "little") + rng.randbytes(n)


def view_reader(handle: RingHandle, index: int, seed: int, count: int, hold: int) -> None:
    """Receives the stream as views, holding up to `hold` at once and releasing them in a
    shuffled order; exit code 0 means every message was exact. It never blocks while holding
    views (the writer may be waiting for their space): it takes more only if they are there."""
    rng = random.Random(seed + index)
    held: list[tuple[RingView, bytes]] = []

    def release_all() -> None:
        rng.shuffle(held)
        while held:
            view, expected = held.pop()
            if view.data != expected:
                raise SystemExit(1)
            view.release()

    with RingReader.attach(handle, index) as r:
        for expected in _stream(seed, count, handle.capacity):
            while True:
                try:
                    view = r.recv_view_nowait() if held else r.recv_view(timeout=30)
                    break
                except anyio.WouldBlock:
                    release_all()
            held.append((view, expected))
            if len(held) > rng.randrange(hold + 1):
                release_all()
        release_all()
        try:
            r.recv_view(timeout=30)
        except anyio.EndOfStream:
            return
        raise SystemExit(2)


# -- in-process --------------------------------------------------------------------------------


def test_a_view_reads_in_place_and_holds_its_space_until_released() -> None:
    with RingWriter.create(capacity=256, name_prefix=PREFIX) as w, RingReader.attach(w.handle) as r:
        w.send(b"a" * 100)
        w.send(b"b" * 100)
        view = r.recv_view()
        assert _in_place(view) and view.data == b"a" * 100 and len(view) == 100
        assert view.data.readonly
        with pytest.raises(TypeError):
            view.data[0] = 0  # readers of a broadcast share these bytes
        assert _pending(w) == 2 * 112  # the first message's space is still held
        with pytest.raises(anyio.WouldBlock):
            w.send_nowait(b"c" * 100)  # the writer cannot reuse it yet
        with r.recv_view() as data:  # copying receive and views mix
            assert data == b"b" * 100
        assert _pending(w) == 2 * 112
        view.release()
        view.release()  # idempotent
        assert _pending(w) == 0
        with pytest.raises(ValueError):
            view.data.tobytes()  # a released view can no longer be read
        w.send_nowait(b"c" * 100)
        assert r.recv() == b"c" * 100


def test_views_released_out_of_order_free_space_from_the_oldest() -> None:
    with (
        RingWriter.create(capacity=1024, name_prefix=PREFIX) as w,
        RingReader.attach(w.handle) as r,
    ):
        for i in range(4):
            w.send(bytes([i]) * 40)
        a, b, c = r.recv_view(), r.recv_view(), r.recv_view()
        d = r.recv()  # a copy taken while views are held
        assert (a.data, b.data, c.data, d) == tuple(bytes([i]) * 40 for i in range(4))
        c.release()
        b.release()
        assert _pending(w) == 4 * 48  # read_pos waits at a's start
        a.release()
        assert _pending(w) == 0  # past c and the copied message after it
        w.send(b"z")
        with r.recv_view() as data:
            assert data == b"z"


def test_messages_up_to_half_the_ring_are_in_place_at_every_offset() -> None:
    """PAD frames move a frame that would wrap to offset 0: every size <= capacity/2, sent
    after every possible offset, is read in place and exact."""
    cap = 512
    with RingWriter.create(capacity=cap, name_prefix=PREFIX, initial_position=(1 << 32) - 256) as w:
        with RingReader.attach(w.handle) as r:
            for lead in range(0, cap, 8):
                for n in (1, 100, cap // 2 - 8):
                    if lead:
                        w.send(b"L" * (lead - 8))
                        assert r.recv() == b"L" * (lead - 8)
                    msg = os.urandom(n)
                    w.send(msg)
                    with r.recv_view() as data:
                        assert data == msg and isinstance(data.obj, mmap.mmap)
                    assert _pending(w) == 0


def test_a_frame_that_must_wrap_is_copied() -> None:
    """When the PAD frame would not fit now, the frame wraps instead (the writer never waits
    longer because of padding) and the reader's view is a copy that holds no space."""
    cap = 512
    with RingWriter.create(capacity=cap, name_prefix=PREFIX) as w, RingReader.attach(w.handle) as r:
        w.send(b"a" * 152)  # [0, 160)
        w.send(b"b" * 248)  # [160, 416)
        assert r.recv() == b"a" * 152
        held = r.recv_view()  # read_pos stays at 160
        msg = os.urandom(200)  # 208 bytes at 416 wrap to [0, 112); padded, [0, 208): not free
        w.send_nowait(msg)
        view = r.recv_view()
        assert not _in_place(view) and view.data == msg
        view.release()
        assert _pending(w) == 256 + 208  # the copy held nothing; b's view holds it all
        held.release()
        assert _pending(w) == 0
        w.send(msg)  # now the ring is empty again at an offset where padding fits
        with r.recv_view() as data:
            assert data == msg and isinstance(data.obj, mmap.mmap)


def test_messages_larger_than_the_ring_are_joined_copies() -> None:
    cap = 256
    with RingWriter.create(capacity=cap, name_prefix=PREFIX) as w, RingReader.attach(w.handle) as r:
        big = os.urandom(3 * cap + 5)
        sender = threading.Thread(target=w.send, args=(big,), kwargs={"timeout": 10})
        sender.start()
        view = r.recv_view(timeout=10)
        sender.join()
        assert not _in_place(view) and view.data == big
        assert _pending(w) == 0
        view.release()


def test_broadcast_a_view_held_by_one_reader_holds_the_writer() -> None:
    with RingWriter.create(capacity=256, num_readers=2, name_prefix=PREFIX) as w:
        with RingReader.attach(w.handle, 0) as r0, RingReader.attach(w.handle, 1) as r1:
            w.send(b"m" * 120)
            held = r0.recv_view()
            with r1.recv_view() as data:
                assert data == held.data == b"m" * 120
            with pytest.raises(anyio.WouldBlock):
                w.send_nowait(b"n" * 200)  # reader 1 is done, reader 0 still reads in place
            held.release()
            w.send_nowait(b"n" * 200)
            assert r0.recv_view_nowait().data == r1.recv() == b"n" * 200


def test_nowait_and_end_of_stream() -> None:
    with RingWriter.create(capacity=256, name_prefix=PREFIX) as w, RingReader.attach(w.handle) as r:
        with pytest.raises(anyio.WouldBlock):
            r.recv_view_nowait()
        with pytest.raises(TimeoutError):
            r.recv_view(timeout=0.01)
        w.send(b"last")
        w.close()
        with r.recv_view_nowait() as data:
            assert data == b"last"
        with pytest.raises(anyio.EndOfStream):
            r.recv_view_nowait()


def test_close_with_views_held_unlinks_and_invalidates_them(caplog) -> None:
    w = RingWriter.create(capacity=256, name_prefix=PREFIX)
    r = RingReader.attach(w.handle)
    w.send(b"one")
    w.send(b"two")
    view, other = r.recv_view(), r.recv_view()
    kept = other.data[1:]  # a slice kept against the rules: the mapping must outlive it
    w.close()  # the creator unlinks the name now
    with caplog.at_level(logging.WARNING, logger="vx.ipc.segment"):
        r.close()
    assert "still referenced" in caplog.text
    assert kept == b"wo"  # still mapped: no crash
    with pytest.raises(ValueError):
        view.data.tobytes()
    view.release()  # harmless after close
    other.release()
    del kept


def test_msgspec_decodes_straight_from_a_view() -> None:
    class Msg(msgspec.Struct):
        token_ids: list[int]
        text: str

    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Msg)
    with (
        RingWriter.create(capacity=4096, name_prefix=PREFIX) as w,
        RingReader.attach(w.handle) as r,
    ):
        msg = Msg(list(range(100)), "héllo")
        w.send(encoder.encode(msg))
        with r.recv_view() as data:
            assert decoder.decode(data) == msg
        assert _pending(w) == 0


def test_send_accepts_any_buffer_including_another_rings_view() -> None:
    with (
        RingWriter.create(capacity=4096, name_prefix=PREFIX) as w1,
        RingReader.attach(w1.handle) as r1,
    ):
        with RingWriter.create(capacity=4096, name_prefix=PREFIX) as w2:
            with RingReader.attach(w2.handle) as r2:
                ints = array.array("I", range(10))
                for data in (bytearray(b"ba"), memoryview(b"mv"), ints):
                    w1.send(data)
                    with r1.recv_view() as view:
                        w2.send(view)  # one copy, ring to ring
                assert r2.recv() == b"ba"
                assert r2.recv() == b"mv"
                assert r2.recv() == ints.tobytes()


@pytest.mark.anyio
async def test_async_receive_view() -> None:
    with RingWriter.create(capacity=256, name_prefix=PREFIX) as w, RingReader.attach(w.handle) as r:
        async with anyio.create_task_group() as tg:

            async def later() -> None:
                await anyio.sleep(0)
                w.send(b"async")

            tg.start_soon(later)
            with anyio.fail_after(5):
                view = await r.receive_view()
        with view as data:
            assert data == b"async"


# -- across processes --------------------------------------------------------------------------


@pytest.mark.parametrize("num_readers", [1, 2])
def test_stream_to_spawned_view_readers_is_exact(num_readers: int) -> None:
    """Random sizes (some wrapping or chunked), views held several at a time and released out
    of order, counters crossing 2**32: every reader gets every message exactly."""
    cap, count, seed = 4096, 5000, 7
    with RingWriter.create(
        capacity=cap, num_readers=num_readers, name_prefix=PREFIX, initial_position=(1 << 32) - 8192
    ) as w:
        procs = [
            CTX.Process(target=view_reader, args=(w.handle, i, seed, count, 3), daemon=True)
            for i in range(num_readers)
        ]
        for p in procs:
            p.start()
        for msg in _stream(seed, count, cap):
            w.send(msg, timeout=30)
        w.close()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * num_readers


def test_large_messages_go_back_to_offset_0_when_it_is_free() -> None:
    """From REWIND_MIN bytes on, a message starts at offset 0 whenever that space is already
    consumed (cache-hot reuse), and never waits for it."""
    cap = 64 << 10
    n = REWIND_MIN
    size = 8 + n
    with RingWriter.create(capacity=cap, name_prefix=PREFIX) as w, RingReader.attach(w.handle) as r:
        w.send(b"s" * (12 << 10))  # from offset 0: nowhere to go back to
        assert r.recv() == b"s" * (12 << 10)
        w.send(b"t" * 8)  # a small message never rewinds
        assert r.recv() == b"t" * 8
        assert w.statistics().position == (12 << 10) + 8 + 16
        msg = os.urandom(n)
        for lap in range(1, 4):
            w.send(msg)
            assert w.statistics().position == lap * cap + size  # after a PAD to the end
            with r.recv_view() as data:
                assert data == msg and isinstance(data.obj, mmap.mmap)
        w.send(msg)  # [0, size) is free: rewinds again
        held = r.recv_view()
        w.send(msg)  # [0, size) is held: goes on after it instead of waiting
        assert w.statistics().position == 4 * cap + 2 * size
        held.release()
        with r.recv_view() as data:
            assert data == msg


def test_writer_busy_is_a_hint_cleared_after_each_large_frame() -> None:
    """writer_busy is raised only around large copies and is 0 once a frame is published (a
    reader that sees 0 sees the frame), so readers never spin on a stale hint."""
    with RingWriter.create(capacity=1 << 20, name_prefix=PREFIX) as w:
        with RingReader.attach(w.handle) as r:
            for n in (10, BUSY_MIN, 300 << 10):
                w.send(b"b" * n)
                assert w._q[rs.WRITER_BUSY] == 0
                with r.recv_view(timeout=1) as data:
                    assert len(data) == n
