"""A clean death (issue 54): an engine process that dies or hangs, and a start-up that fails.

Death (kill -9 of the Worker, kill -9 of the EngineCore, SIGSTOP of the Worker past
`--step-timeout`) under live streams: the front logs exactly one ERROR line, naming the process,
its pid and the signal (or the hang), every stream ends with an error event carrying that same
cause and then `[DONE]`, the front exits with ENGINE_DEAD within 2 s (of the kill, or of the
step deadline), and the whole tree's log holds no "Traceback" and no "leaked" (the resource
tracker's warning); nothing is left behind.

Start-up failures (a bad model path, a port in use, a KV pool too small, a bad flag value) each
exit with their own code within 10 s, after one ERROR line and no traceback.

/ready: 503 while the model loads (while /health, liveness, already answers 200).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import anyio
import httpx
import pytest

from tests.reliability.conftest import checked_figure
from tests.reliability.harness import Served, descendants, free_port, poll, total
from tests.reliability.streams import client_for, start_streams
from vx.exit_code import ExitCode

pytestmark = [pytest.mark.e2e, pytest.mark.anyio, pytest.mark.timeout(300)]

STREAMS = 6
STEP_TIMEOUT_S = 2.0
#: The issue's bound on the front's exit after the death is known.
EXIT_WITHIN_S = 2.0


def front_errors(log: str, front_pid: int) -> list[str]:
    """The ERROR lines the front itself wrote (its role and pid tag every line)."""
    return [line for line in log.splitlines() if f"ERROR [api {front_pid}]" in line]


@pytest.mark.parametrize("fault", ["worker-kill9", "engine-kill9", "worker-sigstop"])
async def test_clean_death(tiny_model: str, logs: str, fault: str) -> None:
    stop = fault == "worker-sigstop"
    args = ("--step-timeout", str(STEP_TIMEOUT_S)) if stop else ()
    server = Served(tiny_model, args, log_dir=logs)
    with server:
        assert server.proc is not None
        front = server.proc.pid
        victim = server.engine_pid if fault == "engine-kill9" else server.worker_pids[0]
        async with client_for(server.url, STREAMS) as client, anyio.create_task_group() as tg:
            records = await start_streams(tg, client, STREAMS, max_tokens=4000)
            faulted = time.monotonic()
            os.kill(victim, signal.SIGSTOP if stop else signal.SIGKILL)
        code = server.wait_exit(30)
        exited = time.monotonic() - faulted
        gone = poll(lambda: not server.survivors(), 5)
        survivors, shm = server.survivors(), server.leftover_shm()
        log = server.full_log()
    errors = front_errors(log, front)
    cause = errors[0].split("engine died: ", 1)[-1] if len(errors) == 1 else None
    ended = sum(r.done and r.error is not None and cause is not None and cause in r.error
                for r in records)  # fmt: skip
    # From the kill, or from the step deadline for the hang (the EngineCore's own clock).
    budget = EXIT_WITHIN_S + (STEP_TIMEOUT_S if stop else 0.0)
    line = (
        f"clean death ({fault}): load {STREAMS} streams | faults 1: front ERROR lines "
        f"{len(errors)}, {ended}/{STREAMS} streams ended with that cause then [DONE], exit code "
        f"{code} after {exited:.2f} s (budget {budget:.0f} s), tracebacks "
        f"{log.count('Traceback')}, leaked {log.count('leaked')} | bad 0 | lost "
        f"{STREAMS - ended} (survivors {len(survivors)}, shm leftovers {len(shm)})"
    )
    with checked_figure(line):
        assert len(errors) == 1, errors
        assert f"pid {victim}" in errors[0], errors[0]
        if stop:
            assert "stuck" in errors[0] and "--step-timeout" in errors[0], errors[0]
        else:
            name = "vx-engine0" if fault == "engine-kill9" else "vx-worker0.0"
            assert f"{name} (pid {victim}) was killed by SIGKILL" in errors[0], errors[0]
        assert ended == STREAMS, [(r.error, r.done, r.transport_error) for r in records]
        assert code == ExitCode.ENGINE_DEAD, log[-4000:]
        assert exited < budget, log[-4000:]
        assert "Traceback" not in log and "leaked" not in log, log[-8000:]
        assert gone and not survivors and shm == set(), (survivors, shm)


def _run_failing(args: list[str], timeout_s: float = 60.0) -> tuple[int, float, str, int]:
    """Run `vx serve ARGS` to its exit: (code, seconds, log, the front's pid)."""
    cmd = [sys.executable, "-m", "vx", "serve", *args, "--num-threads", "1"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, time.monotonic() - start, out.decode(errors="replace"), proc.pid


@pytest.mark.parametrize(
    "failure", ["bad-path", "port-in-use", "kv-too-small", "bad-config", "bad-tls"]
)
def test_startup_failure(tiny_model: str, failure: str) -> None:
    expected = {
        "bad-path": ExitCode.MODEL_NOT_FOUND,
        "port-in-use": ExitCode.ADDRESS_IN_USE,
        "kv-too-small": ExitCode.KV_CACHE_TOO_SMALL,
        "bad-config": ExitCode.BAD_CONFIG,
        "bad-tls": ExitCode.BAD_CONFIG,
    }[failure]
    words = {
        "bad-path": "no such file or directory",
        "port-in-use": "cannot listen on",
        "kv-too-small": "KV cache",
        "bad-config": "invalid configuration",
        "bad-tls": "TLS certificate and key",
    }[failure]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1] if failure == "port-in-use" else free_port()
        model = "/nonexistent/vx-model" if failure == "bad-path" else tiny_model
        args = [model, "--port", str(port)]
        if failure == "kv-too-small":
            args += ["--kv-cache-memory", "1KiB"]
        if failure == "bad-config":
            args += ["--max-model-len", "100000"]  # past the model's 8,192 positions
        if failure == "bad-tls":
            args += ["--ssl-certfile", "/nonexistent/cert.pem", "--ssl-keyfile", "/nonexistent/k"]
        code, seconds, log, front = _run_failing(args)
    errors = front_errors(log, front)
    assert code == expected, log
    assert seconds < 10.0, log
    assert len(errors) == 1 and words in errors[0], log
    assert "Traceback" not in log and "leaked" not in log, log
    # Nothing of the tree is left (its children were reaped before the front exited).
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"vx-{front}-")]


async def test_ready_while_loading_then_serving(tiny_model: str, logs: str) -> None:
    """/health (liveness) is 200 from the moment HTTP is up, /ready 503 until the engine is
    ready; a request meanwhile gets 503 "loading"."""
    server = Served(tiny_model, log_dir=logs)
    seen: list[tuple[int, int]] = []
    cmd = [sys.executable, "-m", "vx", "serve", tiny_model, "--port", str(server.port),
           "--num-threads", "1", "--served-model-name", "tiny"]  # fmt: skip
    log = open(os.path.join(logs, f"loading-{server.port}.log"), "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    server.proc = proc
    loading_request = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            server.pids = list(dict.fromkeys([*server.pids, proc.pid, *descendants(proc.pid)]))
            try:
                health = httpx.get(server.url + "/health", timeout=2).status_code
                ready = httpx.get(server.url + "/ready", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.05)  # polling an external process's start-up
                continue
            seen.append((health, ready))
            if ready == 503 and loading_request is None:
                r = httpx.post(server.url + "/v1/completions",
                               json={"model": "tiny", "prompt": "x", "max_tokens": 1})  # fmt: skip
                loading_request = (r.status_code, r.json()["error"]["code"])
            if ready == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1] == (200, 200), seen
        assert (200, 503) in seen, seen  # alive, not ready: the model was loading
        assert loading_request in ((503, "loading"), None) and loading_request, loading_request
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        log.close()
        left = server.leftovers()
        server.kill_tree()
        server.unlink_shm()
    assert code == 0 and not left, left


def test_help_lists_exit_codes() -> None:
    out = subprocess.run([sys.executable, "-m", "vx", "serve", "--help"], capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    for code in ExitCode:
        assert re.search(rf"^\s+{code.value}\s+{re.escape(code.doc)}", out, re.M), out


def test_readme_documents_every_exit_code() -> None:
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", readme, re.M))
    assert sorted(map(int, rows)) == [c.value for c in ExitCode], rows


@pytest.mark.parametrize("stop", ["worker-kill9", "sigterm"])
async def test_a_client_that_stopped_reading_does_not_hold_the_exit(
    tiny_model: str, logs: str, stop: str
) -> None:
    """A client stops reading a large stream (10 MB: more than the sockets buffer) and never
    closes; then the Worker dies, or SIGTERM comes: the front still exits at once (it cuts that
    connection once its unsent bytes stop moving), with no traceback."""
    server = Served(tiny_model, ("--drain-timeout", "1"), log_dir=logs)
    with server:
        assert server.proc is not None
        front = server.proc.pid
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 900, "n": 16,
                           "logprobs": 20, "ignore_eos": True, "stream": True}).encode()  # fmt: skip
        stalled = socket.create_connection(("127.0.0.1", server.port))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        try:
            # The engine made all 14,400 tokens: the front holds megabytes it cannot send.
            made = poll(lambda: total(server.scrape(), "vx:generation_tokens_total") >= 14_400,
                        120, 0.2)  # fmt: skip
            assert made, server.log()
            async with client_for(server.url, 2) as client, anyio.create_task_group() as tg:
                records = await start_streams(tg, client, 2, max_tokens=8000)
                t0 = time.monotonic()
                if stop == "sigterm":
                    server.send_signal(signal.SIGTERM)
                else:
                    os.kill(server.worker_pids[0], signal.SIGKILL)
            code = server.wait_exit(30)
            exited = time.monotonic() - t0
        finally:
            stalled.close()
        log = server.full_log()
    expected = ExitCode.OK if stop == "sigterm" else ExitCode.ENGINE_DEAD
    # The drain budget (1 s) first, for SIGTERM.
    budget = EXIT_WITHIN_S + (1.0 if stop == "sigterm" else 0.0)
    assert code == expected, log[-4000:]
    assert exited < budget, (exited, log[-4000:])
    assert "cut 1 connection(s) whose client stopped reading" in log, log[-4000:]
    assert all(r.done and r.error is not None for r in records), records
    assert "Traceback" not in log and "leaked" not in log, log[-8000:]
    assert len(front_errors(log, front)) == (0 if stop == "sigterm" else 1), log[-4000:]
