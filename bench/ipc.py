"""IPC round-trip latency and one-way throughput: vx's ring vs ZMQ, mp.Queue and mp.Pipe.

Runs in: a benchmark process that spawns one echo child per transport (multiprocessing spawn).
Every transport is measured in the same run, interleaved per repeat, because this machine's
speed drifts. Hold the shared lock: `flock /tmp/vx-bench.lock .venv/bin/python bench/ipc.py`.

Round trip: the parent sends `size` bytes, the child sends the same bytes back; median and p99.
Throughput: the parent streams messages one way, the child acknowledges the last one.
pyzmq is optional (it is not a vx dependency): without it the ZMQ rows are skipped.

Receiving APIs, on both sides of each pair: "vx ring" reads in place (`RingReader.recv_view`:
the echo child sends straight from the view, then releases it; the parent releases its view as a
decoder would after reading it), "vx ring copy" uses `recv` (a fresh bytes); "zmq frame" uses
`copy=False` frames (the child echoes the frame itself), "zmq copy" plain `recv`; mp.Pipe
`recv_bytes`, mp.Queue `get`. Senders always start from `bytes`, as an encoder produces them.
The ratio column divides by the faster of the two ZMQ rows at that size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

from vx.ipc.ring import RingHandle, RingReader, RingWriter

try:
    import zmq
except ImportError:  # pragma: no cover - depends on the environment
    zmq = None

SIZES = [64, 1 << 10, 16 << 10, 256 << 10, 1 << 20]
_STREAM = b"S"  # control message: the next message is a count of messages to stream
_ACK = b"A"


def _serve(recv, send) -> None:
    """The child's loop: echo, or swallow a stream and acknowledge it; ends on b"Q".

    `recv` may return any buffer (compared by value); `send` gets it back to echo.
    """
    while True:
        msg = recv()
        if msg == b"Q":
            return
        if msg == _STREAM:
            count = int(bytes(recv()))
            for _ in range(count):
                recv()
            send(_ACK)
        else:
            send(msg)


def ring_child(ping: RingHandle, pong: RingHandle, copy: bool) -> None:
    """Zero-copy echo: a message goes back straight from the ping ring's memory (one copy,
    into the pong ring), and its view is released right after."""
    reader, writer = RingReader.attach(ping), RingWriter.attach(pong)
    try:
        if copy:
            _serve(reader.recv, writer.send)
            return
        while True:
            with reader.recv_view() as msg:
                if msg != b"Q" and msg != _STREAM:
                    writer.send(msg)
                    continue
                stop = msg == b"Q"
            # Released before waiting on: a held view's space would stall the stream.
            if stop:
                return
            count = int(reader.recv())
            for _ in range(count):
                reader.recv_view().release()
            writer.send(_ACK)
    finally:
        reader.close()
        writer.close()


def zmq_child(endpoint: str, copy: bool) -> None:
    """With copy=False, echoes the received frame itself (zmq's zero-copy path)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(endpoint)

    class _Frame:  # compares by value, sends as the frame
        def __init__(self, frame) -> None:
            self.frame = frame

        def __eq__(self, other: object) -> bool:
            return self.frame.buffer == other

        def __bytes__(self) -> bytes:
            return self.frame.bytes

    def send(msg) -> None:
        sock.send(msg.frame if isinstance(msg, _Frame) else msg, copy=False)

    try:
        if copy:
            _serve(sock.recv, sock.send)
        else:
            _serve(lambda: _Frame(sock.recv(copy=False)), send)
    finally:
        sock.close(linger=0)
        ctx.term()


def queue_child(q_in, q_out) -> None:
    _serve(q_in.get, q_out.put)


def pipe_child(conn) -> None:
    _serve(conn.recv_bytes, conn.send_bytes)


class _Transport:
    """The parent's side of one transport plus its echo child; `receive` takes one reply the
    fast way and drops it, `recv` returns one as bytes."""

    def __init__(self, name, send, recv, receive, proc, cleanup) -> None:
        self.name, self.send, self.recv, self.receive = name, send, recv, receive
        self._proc, self._cleanup = proc, cleanup

    def close(self) -> None:
        self.send(b"Q")
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._cleanup()


def _start(ctx, target, args):
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def open_ring(ctx, copy: bool) -> _Transport:
    # 4 MiB default rings; 1 MiB messages fit without chunking, as in vx.
    ping = RingWriter.create(name_prefix="vxbench")
    pong = RingReader.create(name_prefix="vxbench")
    proc = _start(ctx, ring_child, (ping.handle, pong.handle, copy))

    def cleanup() -> None:
        ping.close()
        pong.close()

    receive = pong.recv if copy else lambda: pong.recv_view().release()
    name = "vx ring copy" if copy else "vx ring"
    return _Transport(name, ping.send, pong.recv, receive, proc, cleanup)


def open_zmq(ctx, tmpdir: str, copy: bool) -> _Transport:
    zctx = zmq.Context()
    sock = zctx.socket(zmq.PAIR)
    endpoint = f"ipc://{tmpdir}/bench.sock"
    sock.bind(endpoint)
    proc = _start(ctx, zmq_child, (endpoint, copy))

    def cleanup() -> None:
        sock.close(linger=0)
        zctx.term()

    receive = sock.recv if copy else lambda: sock.recv(copy=False)
    name = "zmq copy" if copy else "zmq frame"
    return _Transport(name, sock.send, sock.recv, receive, proc, cleanup)


def open_queue(ctx) -> _Transport:
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = _start(ctx, queue_child, (q_in, q_out))
    return _Transport("mp.Queue", q_in.put, q_out.get, q_out.get, proc, lambda: None)


def open_pipe(ctx) -> _Transport:
    parent, child = ctx.Pipe()
    proc = _start(ctx, pipe_child, (child,))
    recv = parent.recv_bytes
    return _Transport("mp.Pipe", parent.send_bytes, recv, recv, proc, parent.close)


def round_trips(t: _Transport, size: int, budget_s: float) -> list[float]:
    msg = os.urandom(size)
    for _ in range(20):  # warm-up: caches, page faults, the child's first spin
        t.send(msg)
        t.receive()
    samples: list[float] = []
    end = time.perf_counter() + budget_s
    while len(samples) < 20000 and (len(samples) < 50 or time.perf_counter() < end):
        t0 = time.perf_counter()
        t.send(msg)
        t.receive()
        samples.append(time.perf_counter() - t0)
    return samples


def throughput(t: _Transport, size: int, budget_s: float) -> float:
    """Bytes per second, streaming `count` messages one way."""
    msg = os.urandom(size)
    count = max(20, min(20000, int(budget_s * 2e9 / 50 / max(size, 4096))))
    t0 = time.perf_counter()
    t.send(_STREAM)
    t.send(str(count).encode())
    for _ in range(count):
        t.send(msg)
    assert t.recv() == _ACK
    return count * size / (time.perf_counter() - t0)


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.4, help="seconds per measurement")
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES)
    parser.add_argument(
        "--transports", nargs="*", default=None, help="subset of: ring zmq pipe queue"
    )
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    names = ["vx ring", "vx ring copy", "zmq frame", "zmq copy", "mp.Pipe", "mp.Queue"]
    if args.transports:
        names = [n for n in names if any(t in n.lower() for t in args.transports)]
    if zmq is None:
        print("pyzmq is not installed: skipping the ZMQ rows (pip install pyzmq)")
        names = [n for n in names if not n.startswith("zmq")]
    zmq_names = [n for n in names if n.startswith("zmq")]
    # results[name][size] = list over repeats of (median_s, p99_s, bytes_per_s)
    results: dict[str, dict[int, list[tuple[float, float, float]]]] = {
        n: {s: [] for s in args.sizes} for n in names
    }
    with tempfile.TemporaryDirectory(prefix="vxbench-") as tmpdir:
        for _ in range(args.repeats):
            for name in names:
                t = {
                    "vx ring": lambda: open_ring(ctx, False),
                    "vx ring copy": lambda: open_ring(ctx, True),
                    "zmq frame": lambda: open_zmq(ctx, tmpdir, False),
                    "zmq copy": lambda: open_zmq(ctx, tmpdir, True),
                    "mp.Pipe": lambda: open_pipe(ctx),
                    "mp.Queue": lambda: open_queue(ctx),
                }[name]()
                try:
                    for size in args.sizes:
                        rt = round_trips(t, size, args.budget)
                        p99 = statistics.quantiles(rt, n=100)[98]
                        bw = throughput(t, size, args.budget)
                        results[name][size].append((statistics.median(rt), p99, bw))
                finally:
                    t.close()

    def med(name: str, size: int, k: int) -> float:
        return statistics.median(r[k] for r in results[name][size])

    print(f"\nIPC between two spawned processes, median of {args.repeats} repeats")
    print("round trip µs (median / p99), one-way throughput MB/s, ratio = RT median / best ZMQ's")
    header = f"{'transport':<12} {'size':>8} {'RT med':>9} {'RT p99':>9} {'MB/s':>9} {'vs zmq':>7}"
    print(header)
    print("-" * len(header))
    for name in names:
        for size in args.sizes:
            rt, p99, bw = med(name, size, 0), med(name, size, 1), med(name, size, 2)
            best_zmq = min((med(z, size, 0) for z in zmq_names), default=None)
            ratio = f"{rt / best_zmq:.2f}" if best_zmq else "-"
            print(
                f"{name:<12} {_fmt_size(size):>8} {rt * 1e6:>9.1f} {p99 * 1e6:>9.1f} "
                f"{bw / 1e6:>9.0f} {ratio:>7}"
            )


if __name__ == "__main__":
    main()
