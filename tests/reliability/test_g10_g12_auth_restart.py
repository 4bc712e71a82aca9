"""G10 auth and exposure, G12 restart hygiene.

G10: with `--api-key`, every route (the OpenAPI paths, the rest of the route table, unknown
paths) except the public allowlist answers 401 in the envelope, without a key and with a wrong
one, over every method; the right key works; neither key ever reaches the log; the server binds
127.0.0.1 by default; CORS is off unless configured; the shared-memory segments are owner-only;
and (statically) nothing in vx uses pickle or a pickling transport.

G12: start/SIGTERM and start/kill -9 cycles: every start succeeds (no stale-name collision),
and after each exit no process, no shared-memory segment and no listening port is left.
"""

from __future__ import annotations

import ast
import os
import pathlib
import secrets
import signal
import socket
import stat
import time

import httpx
import pytest

from tests.reliability.conftest import checked_figure, sized
from tests.reliability.harness import MODEL_NAME, Served, poll

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _public(method: str, path: str) -> bool:
    """The explicit public allowlist: the auth layer's paths (any method), plus the static
    pages served ahead of it on GET (chat and dashboard HTML, whose API calls carry the key)."""
    from vx.http.middleware import PUBLIC_PATHS

    if path in PUBLIC_PATHS:
        return True
    try:
        from vx.http.dashboard import UIMiddleware
    except ImportError:
        return False
    return method == "GET" and path in UIMiddleware.PAGES


EXTRA_PATHS = ["/", "/health", "/metrics", "/version", "/openapi.json", "/v1/models/tiny",
               "/no/such/route", "/v1", "/docs", "/static/x.js", "/dashboard"]  # fmt: skip


def _listening_addresses(port: int) -> list[str]:
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for line in f.readlines()[1:]:
                local, _, state = line.split()[1:4]
                addr, p = local.rsplit(":", 1)
                if int(p, 16) == port and state == "0A":  # LISTEN
                    out.append(addr)
    return out


def test_g10_auth_and_exposure(tiny_model: str, logs: str) -> None:
    key, wrong = "vx-" + secrets.token_hex(16), "vx-" + secrets.token_hex(16)
    server = Served(tiny_model, log_dir=logs, api_key=key)
    problems: list[str] = []
    tried = 0
    with server:
        good = {"authorization": f"Bearer {key}"}
        spec = httpx.get(server.url + "/openapi.json", headers=good, timeout=10).json()
        paths = sorted({p.replace("{model}", MODEL_NAME) for p in spec["paths"]} | set(EXTRA_PATHS))
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for path in paths:
                for method in ("GET", "POST", "PUT", "DELETE"):
                    for headers in ({}, {"authorization": f"Bearer {wrong}"},
                                    {"x-api-key": wrong}, {"authorization": wrong}):  # fmt: skip
                        r = client.request(method, path, headers=headers, json={})
                        tried += 1
                        if _public(method, path):
                            if r.status_code == 401:
                                problems.append(f"public {method} {path} answered 401")
                            continue
                        body = (
                            r.json()
                            if r.headers.get("content-type", "").startswith("application/json")
                            else {}
                        )
                        if r.status_code != 401 or "error" not in body:
                            problems.append(f"{method} {path} {headers}: {r.status_code}")
            ok = client.post("/v1/completions", headers=good,
                             json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})  # fmt: skip
            ok_xkey = client.get("/v1/models", headers={"x-api-key": key})
            cors = client.options("/v1/models", headers={
                "origin": "http://evil.example", "access-control-request-method": "GET"})  # fmt: skip
        listen = _listening_addresses(server.port)
        modes = {
            name: stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode)
            for name in server.leftover_shm()
        }
        code = server.stop()
        left_pids, left_shm = server.left_behind()  # after stop: nothing of the tree
        log = server.full_log()
    leaked = [k for k in (key, wrong) if k in log]
    cors_on = "access-control-allow-origin" in cors.headers
    line = (
        f"G10 auth and exposure: load {tried} requests over {len(paths)} paths x 4 methods x 4 "
        f"credentials | faults 0 | bad {tried} unauthenticated tried, {len(problems)} not 401 | "
        f"lost {len(leaked)} keys to the log (key accepted {ok.status_code}/"
        f"{ok_xkey.status_code}; bind {listen}; shm modes "
        f"{sorted({oct(m) for m in modes.values()})}; CORS {'on' if cors_on else 'off'}; exit "
        f"code {code}, {len(left_pids)} processes and {len(left_shm)} segments left)"
    )
    with checked_figure(line):
        assert ok.status_code == 200 and ok_xkey.status_code == 200
        assert not cors_on
        assert listen == ["0100007F"], listen  # 127.0.0.1, nothing on 0.0.0.0 or ::
        assert modes and all(m & 0o077 == 0 for m in modes.values()), modes
        assert not problems, problems
        assert not leaked
        assert code == 0 and not left_pids and not left_shm, (code, left_pids, left_shm)


FORBIDDEN_MODULES = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "_pickle"}
FORBIDDEN_ATTRS = {"recv_pyobj", "send_pyobj", "Queue", "SimpleQueue", "JoinableQueue", "Pipe",
                   "Manager", "loads_pickle"}  # fmt: skip


def test_g10_no_pickle_anywhere_in_vx() -> None:
    """Static: no pickling module is imported and no pickling transport (multiprocessing
    queues, pipes, managers; zmq's *_pyobj) is touched anywhere in vx."""
    root = pathlib.Path(__file__).resolve().parents[2] / "vx"
    offenders = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
                if node.module.startswith("multiprocessing"):
                    names += [a.name for a in node.names if a.name in FORBIDDEN_ATTRS]
            elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS:
                # the standard library's `queue.Queue` is a thread queue: nothing is pickled
                threads = isinstance(node.value, ast.Name) and node.value.id == "queue"
                names = [] if threads else [node.attr]
            bad = [n for n in names if n in FORBIDDEN_MODULES or n in FORBIDDEN_ATTRS]
            if bad:
                offenders.append(f"{path.relative_to(root.parent)}:{node.lineno}: {bad}")
    assert not offenders, offenders


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_g12_restart_hygiene(tiny_model: str, logs: str, size: str) -> None:
    n_term, n_kill = int(sized("G12", size)["term"]), int(sized("G12", size)["kill"])
    starts: list[float] = []
    problems: list[str] = []
    for cycle in range(n_term + n_kill):
        kill = cycle >= n_term
        t0 = time.monotonic()
        server = Served(tiny_model, log_dir=logs)
        with server:
            starts.append(time.monotonic() - t0)
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": MODEL_NAME, "prompt": "cycle", "max_tokens": 4})  # fmt: skip
            if r.status_code != 200:
                problems.append(f"cycle {cycle}: request {r.status_code}")
            code = server.stop(signal.SIGKILL if kill else signal.SIGTERM)
            if not kill and code != 0:
                problems.append(f"cycle {cycle}: SIGTERM exit code {code}")
            if not poll(lambda s=server: not s.survivors(), 30):
                problems.append(f"cycle {cycle}: survivors {server.survivors()}")
            if not poll(lambda s=server: not s.leftover_shm(), 10):
                problems.append(f"cycle {cycle}: shm {server.leftover_shm()}")
            if not poll(lambda s=server: _port_free(s.port), 10):
                problems.append(f"cycle {cycle}: port {server.port} still bound")
    line = (
        f"G12 restart hygiene [{size}]: load {n_term + n_kill} starts (median "
        f"{sorted(starts)[len(starts) // 2]:.1f} s) | faults {n_term} SIGTERM + {n_kill} kill -9 "
        f"| bad 0 | lost {len(problems)} (leftovers: processes, shm, ports, failed requests "
        f"or exit codes)"
    )
    with checked_figure(line):
        assert not problems, problems
