"""Tests for vx.ipc.ring: framing, wrap-around, broadcast, peer death, cleanup, async, idle CPU.

Runs in: the pytest process, plus children started with multiprocessing's spawn context (their
entry points are module-level functions that get nothing but ring handles and plain numbers).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from vx.ipc import segment as rw
from vx.ipc.ring import RingHandle, RingOwner, RingReader, RingWriter
from vx.ipc.wait import sweep_stale_segments

PREFIX = "vxringtest"
CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _leftovers() -> list[str]:
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(PREFIX + "-"))


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test must leave /dev/shm and the abstract socket namespace as it found them."""
    yield
    assert _leftovers() == []


def _abstract_names() -> str:
    with open("/proc/net/unix") as f:
        return f.read()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    """Polls a condition (never a blind sleep); fails the test if it stays false."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def _messages(seed: int, count: int, capacity: int):
    """The deterministic message stream shared by a writer and its checking readers."""
    rng = random.Random(seed)
    for _ in range(count):
        r = rng.random()
        if r < 0.80:
            n = rng.randrange(0, 200)
        elif r < 0.97:
            n = rng.randrange(200, capacity // 2)
        elif r < 0.995:
            n = rng.randrange(capacity // 2, capacity - 8 + 1)
        else:
            n = rng.randrange(capacity - 7, 3 * capacity + 17)  # larger than the ring: chunked
        yield rng.randbytes(n)


# -- children (module level so that spawn can import them) -------------------------------------


def check_reader(handle: RingHandle, index: int, seed: int, count: int) -> None:
    """Receives the whole stream and compares every message; exit code 0 means all equal."""
    reader = RingReader.attach(handle, index)
    try:
        for i, expected in enumerate(_messages(seed, count, handle.capacity)):
            got = reader.recv(timeout=30)
            if got != expected:
                sys.stderr.write(f"reader {index}: message {i} differs ({len(got)} bytes)\n")
                sys.exit(1)
        try:
            reader.recv(timeout=30)
        except anyio.EndOfStream:
            return
        sys.stderr.write(f"reader {index}: a message after the end\n")
        sys.exit(2)
    finally:
        reader.close()


def idle_reader(handle: RingHandle) -> None:
    """Attaches and then never reads: holds the writer back until it is killed."""
    reader = RingReader.attach(handle)
    signal.pause()
    reader.close()


def blocking_reader(handle: RingHandle) -> None:
    """Blocks in recv until the writer closes."""
    reader = RingReader.attach(handle)
    try:
        reader.recv()
    except anyio.EndOfStream:
        pass
    finally:
        reader.close()


def hello_writer(handle: RingHandle, count: int) -> None:
    """Sends `count` numbered messages; with count == 1, then waits to be killed."""
    writer = RingWriter.attach(handle)
    for i in range(count):
        writer.send(b"hello %d" % i)
    if count == 1:
        signal.pause()
    writer.close()


def _spawn(target, *args):
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


# -- in-process behaviour ----------------------------------------------------------------------


def test_sizes_wraparound_and_empty_messages() -> None:
    with RingWriter.create(capacity=256, name_prefix=PREFIX) as w:
        with RingReader.attach(w.handle) as r:
            for n in [0, 1, 7, 8, 9, 100, 200, 240, 248, 0, 13] * 20:
                data = bytes(range(256))[:n]
                w.send_nowait(data)
                assert r.recv_nowait() == data
            with pytest.raises(anyio.WouldBlock):
                r.recv_nowait()
            w.send(memoryview(b"abc"))
            assert r.recv(timeout=1) == b"abc"


def test_send_takes_any_contiguous_buffer_and_rewinds_large_messages() -> None:
    """`send`'s fast path: bytearray and memoryviews of any format go out byte for byte; a
    non-contiguous view is refused and publishes nothing; large messages keep going back to
    offset 0 (after a PAD frame) whenever the reader has released the previous one."""
    import array

    from vx.ipc.ring import REWIND_MIN

    cap = 1 << 16
    with RingWriter.create(capacity=cap, name_prefix=PREFIX) as w:
        with RingReader.attach(w.handle) as r:
            doubles = array.array("d", range(10))
            grid = memoryview(bytes(range(24))).cast("B", (4, 6))
            for data in [bytearray(b"xyz"), memoryview(doubles), grid]:
                w.send(data)
                assert r.recv(timeout=1) == memoryview(data).tobytes()
            with pytest.raises(BufferError):
                w.send(memoryview(bytes(range(40)))[::2])
            assert w.statistics().num_bytes_pending == 0  # the refused message left no trace
            w.send(b"after")
            assert r.recv(timeout=1) == b"after"
            big = os.urandom(REWIND_MIN + 100)
            for i in range(20):
                w.send(big)
                # From the second on (the first starts where the small ones ended), each one
                # is rewound to offset 0: it ends one frame past a multiple of the capacity.
                assert i == 0 or w.statistics().position % cap == 8 + (len(big) + 7) // 8 * 8
                with r.recv_view(timeout=1) as view:
                    assert view == big


def test_counters_cross_2_pow_32() -> None:
    start = (1 << 32) - 1000
    with RingWriter.create(capacity=512, name_prefix=PREFIX, initial_position=start) as w:
        with RingReader.attach(w.handle) as r:
            rng = random.Random(7)
            for _ in range(200):
                data = rng.randbytes(rng.randrange(0, 200))
                w.send(data)
                assert r.recv() == data
            assert r.statistics().position > 1 << 32
            assert w.statistics().position == r.statistics().position


def test_full_ring_nowait_timeout_and_end_of_stream() -> None:
    w = RingWriter.create(capacity=128, name_prefix=PREFIX)
    r = RingReader.attach(w.handle)
    sent = []
    with pytest.raises(anyio.WouldBlock):
        for i in range(100):
            w.send_nowait(b"%02d" % i + b"x" * 30)
            sent.append(b"%02d" % i + b"x" * 30)
    assert len(sent) == 3  # 3 frames of 40 bytes in 128
    with pytest.raises(TimeoutError):
        w.send(b"y" * 30, timeout=0.01)
    with pytest.raises(ValueError):
        w.send_nowait(b"z" * 200)  # can never fit whole: send() chunks it
    assert [r.recv_nowait() for _ in sent] == sent
    w.send_nowait(b"last")
    w.close()
    with pytest.raises(anyio.ClosedResourceError):
        w.send(b"after close")
    assert r.recv(timeout=1) == b"last"  # drained before the end is reported
    with pytest.raises(anyio.EndOfStream):
        r.recv(timeout=1)
    with pytest.raises(anyio.EndOfStream):
        r.recv_nowait()
    r.close()


def test_torn_chunked_message_is_dropped() -> None:
    with RingWriter.create(capacity=256, name_prefix=PREFIX) as w:
        with RingReader.attach(w.handle) as r:
            with pytest.raises(TimeoutError):
                w.send(b"x" * 1000, timeout=0.01)  # fills the ring with its first chunks
            with pytest.raises(anyio.WouldBlock):
                r.recv_nowait()  # consumes the chunks, completes nothing
            w.send(b"next")
            assert r.recv_nowait() == b"next"


def test_reader_close_breaks_a_blocked_writer() -> None:
    w = RingWriter.create(capacity=128, num_readers=2, name_prefix=PREFIX)
    r0, r1 = RingReader.attach(w.handle, 0), RingReader.attach(w.handle, 1)
    w.send(b"a" * 100)
    assert r0.recv() == b"a" * 100
    r1.close()  # r1 never consumed it: the writer can never get that space back
    with pytest.raises(anyio.BrokenResourceError):
        w.send(b"b" * 100, timeout=5)
    r0.close()
    w.close()


def test_handle_is_serialisable_and_ends_are_exclusive() -> None:
    with RingReader.create(capacity=1024, name_prefix=PREFIX) as r:
        handle = msgspec.msgpack.decode(msgspec.msgpack.encode(r.handle), type=RingHandle)
        assert handle == r.handle
        with pytest.raises(ValueError):
            RingReader.attach(handle, 0)  # reader 0 is already open (in this process)
        with pytest.raises(ValueError):
            RingReader.attach(handle, 1)
        with RingWriter.attach(handle) as w:
            w.send(b"ping")
            assert r.recv() == b"ping"
            with pytest.raises(ValueError):
                RingWriter.attach(handle)


def test_names_are_gone_after_the_creator_closes() -> None:
    w = RingWriter.create(capacity=1024, num_readers=2, name_prefix=PREFIX)
    r = RingReader.attach(w.handle, 1)
    name = w.handle.name
    assert os.path.exists(f"/dev/shm/{name}")
    assert oct(os.stat(f"/dev/shm/{name}").st_mode & 0o777) == "0o600"
    assert f"@{name}.w" in _abstract_names() and f"@{name}.r1" in _abstract_names()
    w.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert f"@{name}.w" not in _abstract_names()
    r.close()
    assert f"@{name}." not in _abstract_names()


def test_owner_holds_no_end_and_unlinks() -> None:
    owner = RingOwner.create(capacity=1024, num_readers=2, name_prefix=PREFIX)
    name = owner.handle.name
    w = RingWriter.attach(owner.handle)  # the owner bound no wake-up name, so both ends are free
    readers = [RingReader.attach(owner.handle, i) for i in range(2)]
    owner.close()
    assert not os.path.exists(f"/dev/shm/{name}")  # open ends keep their mapping
    w.send(b"still works")
    assert [r.recv(timeout=1) for r in readers] == [b"still works"] * 2
    for end in [w, *readers]:
        end.close()
    assert f"@{name}." not in _abstract_names()


def test_sweep_removes_segments_of_dead_creators() -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    stale = f"/dev/shm/{PREFIX}-{proc.stdout.strip()}-0123456789ab"
    live = f"/dev/shm/{PREFIX}-{os.getpid()}-0123456789ab"
    for path in (stale, live):
        with open(path, "wb"):
            pass
    try:
        assert sweep_stale_segments(PREFIX) == [os.path.basename(stale)]
        assert os.path.exists(live)
    finally:
        os.unlink(live)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 300)), max_size=60))
def test_ring_matches_a_deque_model(ops) -> None:
    """send_nowait/recv_nowait against a deque: same messages, same order, same WouldBlock
    (the ring is full exactly when the framed bytes would exceed its capacity; a frame that
    would wrap goes to offset 0 after a PAD frame when that fits, which the model tracks)."""
    cap, start = 512, (1 << 32) - 256
    model: collections.deque[tuple[bytes, int]] = collections.deque()  # (message, end position)
    wpos = rpos = start
    with RingWriter.create(capacity=cap, name_prefix=PREFIX, initial_position=start) as w:
        with RingReader.attach(w.handle) as r:
            for i, (is_send, n) in enumerate(ops):
                if is_send:
                    if n > cap - 8:
                        continue
                    data = bytes([i % 256]) * n
                    size, off = 8 + (n + 7) // 8 * 8, wpos % cap
                    pad = cap - off if off + 8 < cap < off + size and size <= off else 0
                    if pad and wpos + pad + size - cap <= rpos:
                        wpos += pad
                    elif wpos + size - cap > rpos:
                        with pytest.raises(anyio.WouldBlock):
                            w.send_nowait(data)
                        continue
                    w.send_nowait(data)
                    wpos += size
                    model.append((data, wpos))
                    assert w.statistics().position == wpos
                elif model:
                    data, rpos = model.popleft()
                    assert r.recv_nowait() == data
                else:
                    with pytest.raises(anyio.WouldBlock):
                        r.recv_nowait()


# -- across processes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_readers", "count"), [(1, 100_000), pytest.param(4, 100_000, marks=pytest.mark.slow)]
)
def test_stream_to_spawned_readers_is_exact(num_readers: int, count: int) -> None:
    """Random sizes (some larger than the ring), counters crossing 2**32, 1 or 4 readers:
    every reader gets every message exactly once, in order, intact."""
    capacity, seed = 4096, 1234 + num_readers
    w = RingWriter.create(
        capacity=capacity,
        num_readers=num_readers,
        name_prefix=PREFIX,
        initial_position=(1 << 32) - 64 * 1024,
    )
    procs = [_spawn(check_reader, w.handle, i, seed, count) for i in range(num_readers)]
    try:
        for data in _messages(seed, count, capacity):
            w.send(data, timeout=30)
        assert w.statistics().position > 1 << 32
        w.close()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * num_readers
    finally:
        w.close()
        for p in procs:
            p.kill()
            p.join()


def test_writer_kill9_breaks_a_blocked_reader_within_1s() -> None:
    r = RingReader.create(capacity=4096, name_prefix=PREFIX)
    proc = _spawn(hello_writer, r.handle, 1)
    try:
        assert r.recv(timeout=30) == b"hello 0"
        killed_at: list[float] = []

        def kill_when_parked() -> None:
            _wait_for(lambda: r._q[r._parked_idx] != 0)
            killed_at.append(time.monotonic())
            os.kill(proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_parked)
        killer.start()
        with pytest.raises(anyio.BrokenResourceError):
            r.recv(timeout=10)
        assert time.monotonic() - killed_at[0] < 1.0
        killer.join()
    finally:
        proc.kill()
        proc.join()
        r.close()


def test_reader_kill9_breaks_a_writer_blocked_on_a_full_ring_within_1s() -> None:
    w = RingWriter.create(capacity=1024, name_prefix=PREFIX)
    proc = _spawn(idle_reader, w.handle)
    try:
        _wait_for(lambda: w._q[rw.READERS + rw.READER_PID] == proc.pid)  # written on attach
        killed_at: list[float] = []

        def kill_when_parked() -> None:
            _wait_for(lambda: w._q[rw.WRITER_PARKED] != 0)
            killed_at.append(time.monotonic())
            os.kill(proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_parked)
        killer.start()
        with pytest.raises(anyio.BrokenResourceError):
            for _ in range(100):
                w.send(b"x" * 100, timeout=10)
        assert time.monotonic() - killed_at[0] < 1.0
        killer.join()
    finally:
        proc.kill()
        proc.join()
        w.close()


_CREATOR = """
import sys
from vx.ipc.ring import RingReader, RingWriter
w = RingWriter.create(capacity=4096, name_prefix=sys.argv[1])
r = RingReader.create(capacity=4096, name_prefix=sys.argv[1])
print(w.handle.name, r.handle.name, flush=True)
sys.stdin.read()
"""


def test_creator_kill9_segments_are_unlinked_by_its_resource_tracker() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CREATOR, PREFIX],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # the tracker warns about the "leaked" segments it removes
        text=True,
    )
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 2 and all(os.path.exists(f"/dev/shm/{n}") for n in names)
        proc.kill()
        proc.wait()
        _wait_for(lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in names))
        assert all(f"@{n}." not in _abstract_names() for n in names)
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.anyio
async def test_async_receive_from_a_spawned_writer() -> None:
    r = RingReader.create(capacity=4096, name_prefix=PREFIX)
    proc = _spawn(hello_writer, r.handle, 50)
    try:
        got = []
        with anyio.fail_after(30):
            while True:
                try:
                    got.append(await r.receive())
                except anyio.EndOfStream:
                    break
        assert got == [b"hello %d" % i for i in range(50)]
    finally:
        proc.join(10)
        r.close()


@pytest.mark.anyio
async def test_async_receive_notices_a_killed_writer_within_1s() -> None:
    r = RingReader.create(capacity=4096, name_prefix=PREFIX)
    proc = _spawn(hello_writer, r.handle, 1)
    try:
        with anyio.fail_after(30):
            assert await r.receive() == b"hello 0"
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(anyio.BrokenResourceError), anyio.fail_after(5):
            await r.receive()
        assert time.monotonic() - killed_at < 1.0
    finally:
        proc.kill()
        proc.join()
        r.close()


@pytest.mark.anyio
async def test_async_receive_parks_wakes_and_cancels() -> None:
    with RingWriter.create(capacity=4096, name_prefix=PREFIX) as w:
        with RingReader.attach(w.handle) as r:
            with anyio.move_on_after(0.02):
                await r.receive()
            assert r._q[r._parked_idx] == 0  # a cancelled wait leaves no parked flag behind
            got: list[bytes] = []

            async def receiver() -> None:
                got.append(await r.receive())

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(receiver)
                    while r._q[r._parked_idx] == 0:
                        await anyio.sleep(0.001)
                    w.send(b"wake")  # the parked receiver must be woken through its socket
            assert got == [b"wake"]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_parked_reader_uses_no_cpu() -> None:
    w = RingWriter.create(capacity=4096, name_prefix=PREFIX)
    proc = _spawn(blocking_reader, w.handle)
    try:
        _wait_for(lambda: w._q[rw.READERS + rw.READER_PARKED] != 0)
        before = _cpu_seconds(proc.pid)
        time.sleep(0.5)  # the measurement window, not synchronisation
        assert _cpu_seconds(proc.pid) - before < 0.05
        w.close()
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        proc.kill()
        proc.join()
        w.close()
