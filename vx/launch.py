"""The ApiServer's main: spawn the engine tree, supervise it, serve HTTP, order the shutdown.

Runs in: the front process (`vx serve`). Everything runs inside one anyio task group:
the EngineClient's ring readers, one watcher per child process sentinel, the signal handler and
hypercorn. A child that dies marks the engine dead (open streams end with an error event and
/health turns 503 at once), then the whole group is cancelled and the tree is torn down.

Shutdown order on SIGTERM/SIGINT: stop admitting (503 + Retry-After), let in-flight requests
finish for up to `drain_timeout_s`, stop hypercorn, then stop and reap every child and unlink
every ring (`EngineProcesses.close`).
"""

from __future__ import annotations

import gc
import logging
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import anyio

from vx.affinity import pin_host_process
from vx.config import EngineConfig
from vx.engine_procs import EngineProcesses, resolve_engine_config

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """The front's own settings (the engine's are in EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 32 * 1024 * 1024
    drain_timeout_s: float = 30.0
    #: Seconds a stream's write may stay blocked (client not reading) before it is aborted.
    stall_timeout_s: float = 60.0
    #: How long a dead engine's streams get to flush their error events before teardown.
    death_grace_s: float = 1.0
    #: Seconds a new grammar may take to compile before its request gets a 400.
    structured_outputs_timeout_s: float = 5.0
    #: How `tool_choice: auto` finds tool calls in the text (`vx.http.tool_calls.PARSERS`).
    tool_call_parser: str = "hermes"
    #: How reasoning is split from the answer (`vx.http.reasoning.PARSERS`); None: not split.
    reasoning_parser: str | None = None
    #: A Jinja chat template file to use instead of the tokenizer's.
    chat_template: str | None = None
    extra: dict[str, object] = field(default_factory=dict)


async def _watch_process(proc: BaseProcess, on_exit: anyio.Event, reasons: list[str]) -> None:
    await anyio.wait_readable(proc.sentinel)
    proc.join(0)
    reasons.append(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}")
    on_exit.set()


async def serve(config: EngineConfig, settings: ServerSettings) -> int:
    """Run `vx serve` until a signal or a child's death; returns the process exit code."""
    from vx.http.app import build_app
    from vx.http.engine_client import EngineClient
    from vx.http.serve import serve_http, startup_banner

    config = resolve_engine_config(config)
    procs = EngineProcesses(config)
    t_start = time.monotonic()
    exit_code = 0
    try:
        procs.start()
        pin_host_process(config.device)  # after the spawns: the Workers keep every core
        client = EngineClient(procs.engine_rings)
        child_exit = anyio.Event()
        http_stopped = anyio.Event()
        reasons: list[str] = []
        async with anyio.create_task_group() as tg:
            for proc in procs.processes:
                tg.start_soon(_watch_process, proc, child_exit, reasons)

            async def supervise() -> None:
                nonlocal exit_code
                await child_exit.wait()
                if http_stopped.is_set():
                    return
                reason = "; ".join(reasons)
                logger.error("engine process died: %s", reason)
                client.mark_dead(reason)
                exit_code = 1
                await anyio.sleep(settings.death_grace_s)
                tg.cancel_scope.cancel()

            tg.start_soon(supervise)
            with anyio.fail_after(900):
                await tg.start(client.run)
            app = build_app(
                client,
                served_model_name=config.model.served_model_name,
                tokenizer_path=config.model.path,
                api_keys=list(settings.api_keys),
                allowed_origins=list(settings.allowed_origins),
                max_body_bytes=settings.max_body_bytes,
                stall_timeout_s=settings.stall_timeout_s,
                structured_outputs_timeout_s=settings.structured_outputs_timeout_s,
                tool_call_parser=settings.tool_call_parser,
                reasoning_parser=settings.reasoning_parser,
                chat_template=settings.chat_template,
            )
            shutdown = anyio.Event()

            async def on_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        logger.info("received %s: draining", signal.Signals(signum).name)
                        client.draining = True
                        with anyio.move_on_after(settings.drain_timeout_s):
                            await client.wait_idle()
                        # Survivors get a terminal error event, not a cut connection.
                        if n := client.fail_all("The server is shutting down."):
                            logger.warning("drain budget spent: failed %d request(s)", n)
                        shutdown.set()
                        return

            tg.start_soon(on_signals)
            # Start-up objects (the tokenizer, the app, imported modules) never die: take them
            # out of the cyclic GC, so its full passes do not walk them while the event loop
            # should be noticing disconnects.
            gc.collect()
            gc.freeze()
            scheme = "https" if settings.ssl_certfile else "http"
            logger.info(
                "%s",
                startup_banner(
                    config, client.ready, f"{scheme}://{settings.host}:{settings.port}",
                    time.monotonic() - t_start,
                ),
            )
            await serve_http(
                app,
                host=settings.host,
                port=settings.port,
                ssl_certfile=settings.ssl_certfile,
                ssl_keyfile=settings.ssl_keyfile,
                shutdown_trigger=shutdown.wait,
            )
            http_stopped.set()
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(procs.close)
    logger.info("vx stopped")
    return exit_code
