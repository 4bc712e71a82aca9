"""G11 ring torture across processes: checksummed messages of random sizes (some larger than
the ring) to 2 readers with byte counters starting just below 2**32, then kill -9 of the writer
or of a reader at random points, each followed by the peer's check.

Pass: 0 corrupt, 0 lost, 0 duplicated messages; after every kill -9 the peer raises
BrokenResourceError within 1 s and everything it received before is intact and in order;
every segment and wake-up socket name is gone afterwards.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import struct
import sys
import time
import zlib

import anyio
import pytest

from tests.reliability.conftest import checked_figure, sized
from vx.ipc.ring import RingHandle, RingReader, RingWriter

pytestmark = [pytest.mark.timeout(900)]

PREFIX = "vxrt"
CTX = multiprocessing.get_context("spawn")
CAPACITY = 16 * 1024
START = (1 << 32) - 64 * 1024  # byte counters cross 2**32 early


def _payload(rng: random.Random, seq: int) -> bytes:
    r = rng.random()
    n = rng.randrange(0, 256) if r < 0.85 else rng.randrange(256, 3 * CAPACITY)
    body = struct.pack("<Q", seq) + rng.randbytes(n)
    return body + struct.pack("<I", zlib.crc32(body))


def _verify(data: bytes, expected_seq: int) -> str | None:
    if len(data) < 12:
        return "short"
    body, crc = data[:-4], struct.unpack("<I", data[-4:])[0]
    if zlib.crc32(body) != crc:
        return "corrupt"
    seq = struct.unpack("<Q", body[:8])[0]
    if seq != expected_seq:
        return "duplicate" if seq < expected_seq else "lost"
    return None


# -- children (module level for spawn) ---------------------------------------------------------


def writer_child(handle: RingHandle, seed: int, count: int) -> None:
    """Sends `count` messages (or until killed); exit 0 after closing."""
    w = RingWriter.attach(handle)
    rng = random.Random(seed)
    for seq in range(count):
        w.send(_payload(rng, seq), timeout=60)
    w.close()


def reader_child(handle: RingHandle, index: int) -> None:
    """Reads and verifies until the end of the stream; exit 0 only if all was exact."""
    r = RingReader.attach(handle, index)
    seq = 0
    try:
        while True:
            try:
                data = r.recv(timeout=60)
            except anyio.EndOfStream:
                return
            if problem := _verify(data, seq):
                sys.stderr.write(f"reader {index}: message {seq}: {problem}\n")
                sys.exit(1)
            seq += 1
    finally:
        r.close()


def _leftovers() -> list[str]:
    shm = [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX + "-")]
    with open("/proc/net/unix") as f:
        sockets = [ln for ln in f.read().splitlines() if f"@{PREFIX}-" in ln]
    return shm + sockets


def test_g11_ring_torture(size: str) -> None:
    count, kills = int(sized("G11", size)["messages"]), int(sized("G11", size)["kills"])
    before = _leftovers()
    rng = random.Random(11)
    # 1. An exact stream to 2 readers across processes.
    w = RingWriter.create(capacity=CAPACITY, num_readers=2, name_prefix=PREFIX,
                          initial_position=START)  # fmt: skip
    readers = [CTX.Process(target=reader_child, args=(w.handle, i)) for i in range(2)]
    for p in readers:
        p.start()
    t0 = time.monotonic()
    try:
        data_rng = random.Random(7)
        for seq in range(count):
            w.send(_payload(data_rng, seq), timeout=60)
        crossed = w.statistics().position > 1 << 32
        w.close()
        for p in readers:
            p.join(120)
        exact = [p.exitcode for p in readers] == [0, 0]
    finally:
        w.close()
        for p in readers:
            p.kill()
            p.join()
    stream_s = time.monotonic() - t0
    # 2. kill -9 at random points, alternating the victim.
    detect: list[float] = []
    bad: list[str] = []
    received = sent_before_kill = 0
    for k in range(kills):
        if k % 2 == 0:  # the writer dies; this process reads
            r = RingReader.create(capacity=CAPACITY, name_prefix=PREFIX, initial_position=START)
            proc = CTX.Process(target=writer_child, args=(r.handle, k, 10**9))
            proc.start()
            try:
                deadline, seq, killed = float("inf"), 0, None
                msg_rng_check = True
                while True:
                    if seq == 1:  # the writer is up: kill it at a random point from now
                        deadline = min(deadline, time.monotonic() + rng.uniform(0.0, 0.3))
                    if killed is None and time.monotonic() >= deadline:
                        os.kill(proc.pid, signal.SIGKILL)
                        killed = time.monotonic()
                    try:
                        data = r.recv(timeout=5)
                    except anyio.BrokenResourceError:
                        detect.append(time.monotonic() - (killed or time.monotonic()))
                        break
                    if problem := _verify(data, seq):
                        bad.append(f"kill {k}: message {seq}: {problem}")
                        msg_rng_check = False
                        break
                    seq += 1
                received += seq
                if killed is None and msg_rng_check:
                    bad.append(f"kill {k}: the stream broke before the kill")
            finally:
                proc.kill()
                proc.join()
                r.close()
        else:  # a reader dies; this process writes until it notices
            w = RingWriter.create(capacity=CAPACITY, name_prefix=PREFIX, initial_position=START)
            proc = CTX.Process(target=reader_child, args=(w.handle, 0))
            proc.start()
            try:
                deadline, data_rng, seq, killed = float("inf"), random.Random(k), 0, None
                while True:
                    if seq == 200:  # past the ring's capacity: the reader is reading
                        deadline = time.monotonic() + rng.uniform(0.0, 0.3)
                    if killed is None and time.monotonic() >= deadline:
                        os.kill(proc.pid, signal.SIGKILL)
                        killed = time.monotonic()
                    try:
                        w.send(_payload(data_rng, seq), timeout=5)
                    except anyio.BrokenResourceError:
                        detect.append(time.monotonic() - (killed or time.monotonic()))
                        break
                    except TimeoutError:
                        bad.append(f"kill {k}: writer blocked 5 s on a dead reader")
                        break
                    seq += 1
                sent_before_kill += seq
                if killed is None:
                    bad.append(f"kill {k}: the reader failed before the kill ({proc.exitcode})")
            finally:
                proc.kill()
                proc.join()
                w.close()
    leftovers = sorted(set(_leftovers()) - set(before))
    line = (
        f"G11 ring torture [{size}]: load {count} checksummed messages to 2 readers in "
        f"{stream_s:.1f} s (counters crossed 2**32: {crossed}) | faults {kills} kill -9 "
        f"({(kills + 1) // 2} writer, {kills // 2} reader), peer noticed in max "
        f"{1e3 * max(detect, default=0):.0f} ms | bad 0 | lost {len(bad)} (exact stream "
        f"{exact}; {received} messages verified before the writer kills, {sent_before_kill} "
        f"sent before the reader kills; leftovers {len(leftovers)})"
    )
    with checked_figure(line):
        assert exact and crossed
        assert not bad, bad
        assert len(detect) == kills and max(detect) < 1.0, detect
        assert not leftovers, leftovers
