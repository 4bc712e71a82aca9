"""The ApiServer's main: spawn the engine tree, supervise it, serve HTTP, order the shutdown.

Runs in: the front process (`vx serve`). Everything runs inside one anyio task group:
the EngineClient's ring readers, one watcher per child process sentinel, the signal handler and
hypercorn. `serve` returns the process's exit code (`vx.exit_code.ExitCode`) and raises nothing
it can name: every failure ends in one ERROR line and its own code.

Start-up order: resolve the model (MODEL_NOT_FOUND), load the TLS pair and OpenTelemetry when
asked for (BAD_CONFIG), bind the port (ADDRESS_IN_USE) before any child is spawned, spawn the children, wait for every EngineReady (a child that fails first:
STARTUP_FAILED, or the code its report carries, e.g. KV_CACHE_TOO_SMALL), then serve.

A clean death (ENGINE_DEAD): whatever is noticed first (a child's sentinel, an EngineDead report,
a broken ring) goes to the `_Supervisor`, which names one cause from every child's exit status
(a child killed by a signal is the root cause; else the engine's own report, e.g. a Worker stuck
past --step-timeout). The front logs it once, every open stream gets it in an error event then
`[DONE]`, /health answers 503 for `death_grace_s`, and hypercorn is stopped through its own
`shutdown_trigger`: nothing cancels it from outside its protocol, so the task group unwinds
without a traceback. Then the children are reaped (killed where they do not exit by themselves)
and every ring is unlinked.

Shutdown order on SIGTERM/SIGINT: /ready turns 503 and new requests get 503 (+ Retry-After),
in-flight requests get up to `drain_timeout_s` to finish, hypercorn stops, then every child is
stopped and reaped and every ring unlinked (`EngineProcesses.close`).
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import ssl
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import anyio

from vx.affinity import pin_host_process
from vx.config import EngineConfig
from vx.engine_procs import EngineProcesses, resolve_engine_config
from vx.errors import EngineDeadError, EngineStartupError
from vx.exit_code import ExitCode

if TYPE_CHECKING:
    from vx.http.tracing import RequestTracer

logger = logging.getLogger(__name__)

#: How long the engine may take to load before the start-up counts as failed.
STARTUP_TIMEOUT_S = 900.0
#: After an engine's report of a death, how long the supervisor waits for a child's exit status
#: before it names the cause from the report alone.
SETTLE_S = 0.3
#: How long a dead tree's children get to exit by themselves before they are killed.
DEAD_TREE_JOIN_S = 0.5
#: How long the last spans may take to leave at exit (a collector that does not answer).
TRACE_FLUSH_S = 2.0


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
    #: How long a dead engine's streams get to flush their error events (and /health answers
    #: 503, new requests 503 + Retry-After) before the front stops listening.
    death_grace_s: float = 0.5
    #: One access log line per HTTP request (--disable-access-log turns it off).
    access_log: bool = True
    #: Where to export one OpenTelemetry span per request (OTLP/HTTP); None: no tracing, and
    #: no OpenTelemetry module is imported.
    otlp_traces_endpoint: str | None = None
    #: Seconds a new grammar may take to compile before its request gets a 400.
    structured_outputs_timeout_s: float = 5.0
    #: How `tool_choice: auto` finds tool calls in the text (`vx.http.tool_calls.PARSERS`).
    tool_call_parser: str = "hermes"
    #: How reasoning is split from the answer (`vx.http.reasoning.PARSERS`); None: not split.
    reasoning_parser: str | None = None
    #: A Jinja chat template file to use instead of the tokenizer's.
    chat_template: str | None = None
    extra: dict[str, object] = field(default_factory=dict)


def describe_exit(proc: BaseProcess, exitcode: int | None) -> str:
    """`vx-worker0.0 (pid 123) was killed by SIGKILL`, or `... exited with code 1`."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"{proc.name} (pid {proc.pid}) was killed by {name}"
    return f"{proc.name} (pid {proc.pid}) exited with code {exitcode}"


class _Supervisor:
    """Names the one cause of an engine tree's death from every sign of it.

    Signs: a child's exit (its sentinel, with the exit status) and an engine's report (its
    EngineDead, or a broken or closed ring, with the exit code it calls for). Invariant: `cause`
    is fixed once, by `wait_cause`; later signs change nothing.
    """

    def __init__(self) -> None:
        self._exits: list[tuple[BaseProcess, int | None]] = []
        self._report: tuple[str, int] | None = None
        self._changed = anyio.Event()
        self.cause: str | None = None
        self.report_exit_code = 0

    def child_exited(self, proc: BaseProcess, exitcode: int | None) -> None:
        self._exits.append((proc, exitcode))
        self._changed.set()

    def engine_failed(self, reason: str, exit_code: int) -> None:
        if self._report is None:
            self._report = (reason, exit_code)
            self.report_exit_code = exit_code
            self._changed.set()

    def _killed(self) -> tuple[BaseProcess, int | None] | None:
        return next(((p, c) for p, c in self._exits if c is not None and c < 0), None)

    async def wait_cause(self) -> str:
        """Wait for the first sign, then for a child's exit (up to SETTLE_S), and name the
        cause.

        NOTE: a child's exit is seen at once (its sentinel), while an engine notices a dead
        peer only through its ring (up to a second): a report with no exit yet comes from an
        engine that is about to exit, not from a killed child that is yet to be seen.
        """
        while not self._exits and self._report is None:
            await self._changed.wait()
            self._changed = anyio.Event()
        with anyio.move_on_after(SETTLE_S):
            while not self._exits:
                await self._changed.wait()
                self._changed = anyio.Event()
        killed = self._killed()
        if killed is not None:
            self.cause = describe_exit(*killed)
        elif self._report is not None:
            first = f" ({describe_exit(*self._exits[0])})" if self._exits else ""
            self.cause = self._report[0] + first
        else:
            self.cause = describe_exit(*self._exits[0])
        return self.cause


async def _watch_process(proc: BaseProcess, supervisor: _Supervisor) -> None:
    await anyio.wait_readable(proc.sentinel)
    # NOTE: the sentinel (a pipe) closes while the kernel still tears the process down, a
    # moment before it can be reaped: polled, the status is there within milliseconds (read at
    # once, it was None: "exited with code None").
    with anyio.move_on_after(1.0):
        while proc.exitcode is None:
            proc.join(0)
            if proc.exitcode is None:
                await anyio.sleep(0.002)
    supervisor.child_exited(proc, proc.exitcode)


async def serve(config: EngineConfig, settings: ServerSettings) -> int:
    """Run `vx serve` until a signal or a child's death; returns the process exit code."""
    from vx.http.serve import bind_socket

    t_start = time.monotonic()
    try:
        config = resolve_engine_config(config)
    except EngineStartupError as e:  # the model is not there
        logger.error("cannot start: %s", e)
        return e.exit_code
    except ValueError as e:
        logger.error("invalid configuration: %s", e)
        return ExitCode.BAD_CONFIG
    if settings.ssl_certfile or settings.ssl_keyfile:
        # Loaded once here, so a bad pair is one line and BAD_CONFIG, not hypercorn's error
        # after the model has loaded.
        try:
            if not (settings.ssl_certfile and settings.ssl_keyfile):
                raise ValueError("--ssl-certfile and --ssl-keyfile go together")
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                settings.ssl_certfile, settings.ssl_keyfile
            )
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            logger.error("invalid configuration: TLS certificate and key: %s", e)
            return ExitCode.BAD_CONFIG
    tracer = None
    if settings.otlp_traces_endpoint:
        try:
            from vx.http.tracing import RequestTracer  # only now: no cost without tracing
        except ImportError as e:
            logger.error(
                "invalid configuration: --otlp-traces-endpoint needs OpenTelemetry "
                "(pip install 'vx[tracing]'): %s", e,
            )
            return ExitCode.BAD_CONFIG
        tracer = RequestTracer(settings.otlp_traces_endpoint)
        logger.info("tracing: one span per request to %s", settings.otlp_traces_endpoint)
    try:
        sock = bind_socket(settings.host, settings.port)
    except EngineStartupError as e:
        logger.error("cannot start: %s", e)
        return e.exit_code
    procs = EngineProcesses(config)
    exit_code: int = ExitCode.INTERNAL_ERROR
    try:
        exit_code = await _serve_tree(config, settings, procs, sock, t_start, tracer)
    finally:
        sock.close()  # a no-op once hypercorn owns it (detached)
        # A dead tree's survivors are reaped at once (a stuck Worker never exits by itself).
        join_s = 5.0 if exit_code == ExitCode.OK else DEAD_TREE_JOIN_S
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(lambda: procs.close(timeout_s=join_s))
    logger.info("vx stopped (exit code %d)", exit_code)
    return exit_code


async def _serve_tree(
    config: EngineConfig,
    settings: ServerSettings,
    procs: EngineProcesses,
    sock: socket.socket,
    t_start: float,
    tracer: RequestTracer | None,
) -> int:
    """Spawn the tree and serve HTTP from the start (/health 200, /ready 503 while loading)
    until a signal, a death, or a failed start; returns the exit code."""
    from vx.http.app import build_app
    from vx.http.engine_client import EngineClient
    from vx.http.serve import serve_http, startup_banner

    port = sock.getsockname()[1]  # the real one, with --port 0
    try:
        procs.start()
    except EngineStartupError as e:  # the remote data-parallel ranks' port is taken
        logger.error("cannot start: %s", e)
        return e.exit_code
    pin_host_process(config.device)  # after the spawns: the Workers keep every core
    client = EngineClient(procs.engine_rings)
    supervisor = _Supervisor()
    client.on_failure = supervisor.engine_failed
    shutdown = anyio.Event()
    exit_code = ExitCode.OK

    async with anyio.create_task_group() as tg:
        for proc in procs.processes:
            tg.start_soon(_watch_process, proc, supervisor)

        async def supervise() -> None:
            nonlocal exit_code
            cause = await supervisor.wait_cause()
            if client.is_ready:
                exit_code = ExitCode.ENGINE_DEAD
                logger.error("engine died: %s", cause)
            else:
                exit_code = ExitCode(supervisor.report_exit_code or ExitCode.STARTUP_FAILED)
                logger.error("engine failed to start: %s", cause)
            client.mark_dead(cause)
            # /health answers 503 and the streams flush their error events meanwhile.
            await anyio.sleep(settings.death_grace_s)
            shutdown.set()

        async def run_client() -> None:
            try:
                await client.run()
            except EngineDeadError:
                pass  # dead before ready: the supervisor names the cause

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

        async def wait_ready() -> None:
            nonlocal exit_code
            with anyio.move_on_after(STARTUP_TIMEOUT_S):
                if await client.wait_ready():
                    # Start-up objects (the tokenizer, the app, imported modules) never die:
                    # out of the cyclic GC, its full passes do not walk them while the event
                    # loop should be noticing disconnects.
                    gc.collect()
                    gc.freeze()
                    logger.info(
                        "%s",
                        startup_banner(
                            config, client.ready, f"{scheme}://{settings.host}:{port}",
                            time.monotonic() - t_start,
                        ),
                    )
                return
            logger.error("engine failed to start: not ready after %.0f s", STARTUP_TIMEOUT_S)
            exit_code = ExitCode.STARTUP_FAILED
            client.mark_dead("not ready in time")
            shutdown.set()

        tg.start_soon(supervise)
        tg.start_soon(run_client)
        tg.start_soon(on_signals)
        scheme = "https" if settings.ssl_certfile else "http"
        # The tokenizer loads here, while the children load the model.
        try:
            app = build_app(
                client,
                served_model_name=config.model.served_model_name,
                tokenizer_path=config.model.path,
                api_keys=list(settings.api_keys),
                allowed_origins=list(settings.allowed_origins),
                max_body_bytes=settings.max_body_bytes,
                stall_timeout_s=settings.stall_timeout_s,
                access_log=settings.access_log,
                tracer=tracer,
                structured_outputs_timeout_s=settings.structured_outputs_timeout_s,
                tool_call_parser=settings.tool_call_parser,
                reasoning_parser=settings.reasoning_parser,
                chat_template=settings.chat_template,
            )
        except Exception as e:  # the model's files hold no tokenizer it can load
            logger.error("engine failed to start: no tokenizer in %s: %s", config.model.path, e)
            tg.cancel_scope.cancel()
            return ExitCode.STARTUP_FAILED
        tg.start_soon(wait_ready)
        await serve_http(
            app,
            host=settings.host,
            port=settings.port,
            ssl_certfile=settings.ssl_certfile,
            ssl_keyfile=settings.ssl_keyfile,
            shutdown_trigger=shutdown.wait,
            sock=sock,
        )
        # hypercorn has returned: what is left in the group is ours (watchers, readers,
        # the supervisor, the signal receiver), and every one of them is cancellable.
        tg.cancel_scope.cancel()
    if tracer is not None:
        # Export the last spans, but a collector that does not answer must not hold the exit.
        with anyio.move_on_after(TRACE_FLUSH_S, shield=True):
            await anyio.to_thread.run_sync(tracer.shutdown, abandon_on_cancel=True)
    return exit_code
