"""serve_http: hypercorn inside the launcher's anyio task group, and the start-up banner.

Runs in: the ApiServer process. Hypercorn speaks HTTP/1.1, h2c (both prior knowledge and the
`Upgrade: h2c` dance) and, with a certificate and key, HTTP/2 over TLS negotiated by ALPN.
It installs no signal handlers, because the launcher passes `shutdown_trigger` (the launcher
owns signals and draining).

Readiness: the listening socket is bound first (by the launcher, `bind_socket`, before it spawns
the engine, so a port in use fails at once; or here; either way port 0 works and the real port
is known), handed to hypercorn as `fd://N`, and `task_status.started(port)` fires from inside
hypercorn's shutdown-trigger task, which hypercorn starts only after every listener is up.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

import vx
from vx.errors import AddressInUseError

if TYPE_CHECKING:
    from vx.config import EngineConfig
    from vx.messages import EngineReady

logger = logging.getLogger(__name__)


def _patch_h2_backpressure() -> None:
    """Make hypercorn's HTTP/2 send block while the peer's flow-control window is closed.

    NOTE: in hypercorn 0.18, `StreamBuffer.pop(0)` (what the sender calls when the stream's
    window is 0) sets the "paused" event because it popped fewer than LOW_WATER bytes, which
    releases the app's blocked `send` at once. So over HTTP/2 a client that stops reading never
    blocks the app and hypercorn buffers its output without bound (found by
    tests/http/test_http_disconnect.py's stall test). Releasing the writer only once the buffer
    itself is below LOW_WATER restores backpressure; idempotent, and skipped if hypercorn
    changes shape.
    """
    from hypercorn.protocol import h2 as hyper_h2

    buffer_cls = getattr(hyper_h2, "StreamBuffer", None)
    low_water = getattr(hyper_h2, "BUFFER_LOW_WATER", None)
    if buffer_cls is None or low_water is None or getattr(buffer_cls, "_vx_patched", False):
        return

    async def pop(self: Any, max_length: int) -> bytes:
        length = min(len(self.buffer), max_length)
        data = bytes(self.buffer[:length])
        del self.buffer[:length]
        if len(self.buffer) < low_water:
            await self._paused.set()
        if len(self.buffer) == 0:
            await self._is_empty.set()
        return data

    buffer_cls.pop = pop
    buffer_cls._vx_patched = True


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port).

    The launcher binds before it spawns the engine, so a port in use fails in a moment, not
    after the model has loaded.

    Raises:
        AddressInUseError: the address is taken, or may not be bound by this process.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise AddressInUseError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except BaseException:
        sock.close()
        raise
    return sock


#: Once hypercorn stops, how long a connection's blocked write may wait before it is cut.
STALLED_AT_STOP_S = 0.5


def abort_stalled_connections(
    port: int, seen: dict[int, int], *, everyone: bool = False
) -> tuple[dict[int, int], int]:
    """Abort every connection to our `port` whose unsent bytes are as many as in `seen` (its
    client stopped reading; with `everyone`, every one that holds unsent bytes); returns the
    unsent bytes of those left (the next call's `seen`, by transport id) and how many were cut.
    Called only while the server stops.

    NOTE: asyncio has no public list of a loop's transports; the selector loop keeps them in
    `_transports` (fd -> transport, CPython 3.7 on). Without it (another loop) nothing is cut
    and a stalled client delays the exit as before. An aborted transport fails the pending
    write with ConnectionResetError, which hypercorn and the SSE response treat as a client
    that left.
    """
    loop = asyncio.get_running_loop()
    transports = getattr(loop, "_transports", None)
    now: dict[int, int] = {}
    n = 0
    for transport in list(transports.values()) if transports else ():
        if transport is None or transport.is_closing():
            continue
        sock = transport.get_extra_info("socket")
        try:
            if sock is None or sock.getsockname()[1] != port:
                continue
        except OSError:
            continue
        unsent = transport.get_write_buffer_size()
        if unsent > 0 and (everyone or seen.get(id(transport)) == unsent):
            transport.abort()
            n += 1
        elif unsent > 0:
            now[id(transport)] = unsent
    return now, n


def hypercorn_config(
    *, fd: int, ssl_certfile: str | None, ssl_keyfile: str | None, graceful_timeout_s: float
) -> Config:
    config = Config()
    config.bind = [f"fd://{fd}"]
    config.accesslog = None  # vx writes its own (vx/http/access_log.py)
    # A Logger, not "-": hypercorn then adds no handler of its own, and its lines take the
    # process's format (text or JSON) like every other.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = graceful_timeout_s
    config.backlog = 2048
    # h11 refuses a header block over this by closing the connection (a reset for a client
    # still sending): keep it well above MAX_HEADER_BYTES so vx answers 431 in the envelope.
    config.h11_max_incomplete_size = 1024 * 1024
    if ssl_certfile or ssl_keyfile:
        if not (ssl_certfile and ssl_keyfile):
            raise ValueError("TLS needs both ssl_certfile and ssl_keyfile")
        config.certfile = ssl_certfile
        config.keyfile = ssl_keyfile
        config.alpn_protocols = ["h2", "http/1.1"]
    return config


async def serve_http(
    app: Any,
    *,
    host: str,
    port: int,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    graceful_timeout_s: float = 5.0,
    sock: socket.socket | None = None,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port (or on `sock`, already bound) until `shutdown_trigger()`
    returns; `sock` then belongs to this call.

    `task_status.started(port)` reports the bound port (useful with port 0) once hypercorn
    accepts connections. Returns after hypercorn's graceful shutdown.
    """
    _patch_h2_backpressure()
    if sock is None:
        sock = bind_socket(host, port)
    bound_port = int(sock.getsockname()[1])
    config = hypercorn_config(
        fd=sock.fileno(),
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        graceful_timeout_s=graceful_timeout_s,
    )
    handed_over = False
    listening = anyio.Event()
    stopping = anyio.Event()

    async def trigger() -> None:
        nonlocal handed_over
        # hypercorn now owns the descriptor through its own socket object.
        sock.detach()
        handed_over = True
        listening.set()
        await shutdown_trigger()
        stopping.set()

    async def reap_stalled() -> None:
        # While hypercorn stops, a client that stopped reading would hold it (and the exit):
        # its connection's last write never drains, and hypercorn awaits it even after its
        # graceful timeout. The responses have had their last word by now (the drain budget or
        # a death's grace is over), so such connections are cut.
        await stopping.wait()
        seen: dict[int, int] = {}
        deadline = time.monotonic() + graceful_timeout_s - STALLED_AT_STOP_S
        while True:
            # A connection is cut when its unsent bytes did not move for a whole interval (a
            # slow reader still drains and is left alone), or anyway near hypercorn's deadline.
            seen, n = abort_stalled_connections(
                bound_port, seen, everyone=time.monotonic() >= deadline
            )
            if n:
                logger.warning("shutdown: cut %d connection(s) whose client stopped reading", n)
            await anyio.sleep(STALLED_AT_STOP_S)

    try:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                try:
                    await hypercorn_serve(app, config, shutdown_trigger=trigger)
                finally:
                    listening.set()
                    tg.cancel_scope.cancel()  # the reaper's work ends with hypercorn's

            tg.start_soon(run)
            tg.start_soon(reap_stalled)
            # NOTE: started() must come from this task, not from hypercorn's trigger task.
            await listening.wait()
            if handed_over:
                scheme = "https" if ssl_certfile else "http"
                logger.info("listening on %s://%s:%d", scheme, host, bound_port)
                task_status.started(bound_port)
    finally:
        if not handed_over:
            sock.close()


def startup_banner(
    config: EngineConfig, ready: list[EngineReady], url: str, elapsed_s: float
) -> str:
    """The lines the ApiServer logs once it serves: model, limits, engines, KV pool, routes."""
    m, s, p = config.model, config.scheduler, config.parallel
    lines = [
        f"vx {vx.__version__} serving {m.served_model_name or m.model!r} at {url} "
        f"(ready in {elapsed_s:.1f} s)",
        f"  model {m.model} from {m.path or '?'}; device {config.device}, dtype {m.dtype}, "
        f"tp {p.tensor_parallel_size}, dp {p.data_parallel_size}",
    ]
    for r in ready:
        lines.append(
            f"  engine {r.engine_index}: pid {r.engine_pid}, workers {r.worker_pids}; "
            f"KV {r.num_blocks} blocks x {r.block_size} tokens "
            f"({r.kv_cache_bytes / 2**30:.2f} GiB); max_model_len {r.max_model_len}, "
            f"max_num_seqs {r.max_num_seqs}, max_num_batched_tokens {r.max_num_batched_tokens}, "
            f"async scheduling {'on' if r.async_scheduling else 'off'}, "
            f"batch invariant {'on' if r.batch_invariant else 'off'}"
        )
    if not ready:
        lines.append(
            f"  max_num_seqs {s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens}"
        )
    lines.append(
        "  routes: POST /v1/completions /v1/chat/completions /tokenize /detokenize; "
        "GET /v1/models /health /version /metrics /openapi.json; "
        "in a browser: / (chat), /dashboard (live engine, fed by /v1/engine/events)"
    )
    return "\n".join(lines)
