"""The reliability harness: a real `vx serve` process tree, its hygiene, and its metrics.

Runs in: the pytest process. `Served` starts `python -m vx serve <tiny model>` with extra flags
and environment, records every process of the tree (front, resource tracker, EngineCore,
workers) once it is healthy, and can stop it by signal. `Snapshot` captures what must come back
to baseline (open fds of the front, `vx-*` shared-memory segments created by the tree) and
`scrape` reads /metrics into a dict, from which `accounting` and `kv_state` derive the
"nothing lost" checks: received == rejected + finished + aborted, KV self-check ok, running ==
waiting == 0, free == total blocks.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "tiny"
#: Every goal's figure line this session (`tests.reliability.conftest.figure`). Kept here, in a
#: module imported under one name only: pytest loads the conftest as `reliability.conftest` while
#: the goal tests import it as `tests.reliability.conftest`, two modules with a list each.
FIGURES: list[str] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True for a running process (a zombie is not alive for this purpose)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shm_of(pids: set[int]) -> set[str]:
    """`vx-*` segments created by one of `pids` (names are `<prefix>-<creator pid>-<hex>`)."""
    out = set()
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == "vx" and parts[1].isdigit() and int(parts[1]) in pids:
            out.add(name)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def poll(cond: Callable[[], object], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll an external process's state (not a sleep for synchronisation): True once `cond()`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval_s)
    return bool(cond())


def parse_metrics(text: str) -> dict[str, float]:
    """`name{k="v",...}` (labels sorted, model_name dropped) -> value."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            key = s.name + (
                "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                if labels
                else ""
            )
            out[key] = s.value
    return out


def total(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def accounting(metrics: dict[str, float]) -> dict[str, float]:
    return {
        "received": total(metrics, "vx:requests_received_total"),
        "rejected": total(metrics, "vx:requests_rejected_total"),
        "finished": total(metrics, "vx:request_success_total"),
        "aborted": total(metrics, "vx:request_aborted_total"),
    }


def balanced(acc: dict[str, float]) -> bool:
    return acc["received"] == acc["rejected"] + acc["finished"] + acc["aborted"]


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


@dataclass
class Snapshot:
    fds: int
    shm: set[str]


@dataclass
class Served:
    """One `vx serve` tree. Use as a context manager; `stop()` may be called earlier."""

    model: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    log_dir: str = "/tmp"
    startup_timeout_s: float = 240.0

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(self.log_dir, f"vx-serve-{self.port}.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids: list[int] = []
        self.engine_pid = 0
        self.worker_pids: list[int] = []

    # ── lifecycle ──
    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> Served:
        # No --dtype: the default (auto; bf16 for the bf16 tiny model, `tests.models.SERVED`),
        # so the fused CPU step and the LM head's C argmax serve, as they serve a user.
        cmd = [sys.executable, "-m", "vx", "serve", self.model, "--port", str(self.port),
               "--num-threads", "1", "--served-model-name", MODEL_NAME, *self.args]  # fmt: skip
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = {**os.environ, **self.env}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            # the tree so far, for a failed start's cleanup (an exited front's children are
            # no longer its descendants)
            tree = [*self.pids, self.proc.pid, *descendants(self.proc.pid)]
            self.pids = list(dict.fromkeys(tree))
            if self.proc.poll() is not None:
                self._failed_start(RuntimeError(f"vx serve exited with {self.proc.returncode}"))
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # polling an external process's start-up
        else:
            self._failed_start(TimeoutError("vx serve not healthy"))
        version = httpx.get(self.url + "/version", headers=self.headers, timeout=5).json()
        self.engine_pid = version["engine_pids"][0]
        self.worker_pids = list(version["worker_pids"])
        self.pids = [self.proc.pid, *descendants(self.proc.pid)]
        assert self.engine_pid in self.pids and set(self.worker_pids) <= set(self.pids)
        return self

    def _failed_start(self, error: Exception) -> None:
        """Raise `error` with the log and whatever of the tree was left, once cleaned up."""
        self.kill_tree()
        left = self.leftovers(timeout_s=5)
        self.unlink_shm()
        raise type(error)(f"{error} ({left or 'nothing left behind'}):\n{self.log()}")

    def __enter__(self) -> Served:
        return self.start()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        """Stop the tree if the test left it running (SIGTERM, as a user would), then fail
        loudly if any process or `vx-*` segment of it is left: the leftovers are named in an
        AssertionError (or, when the test already failed, in a note on its exception) before
        they are SIGKILLed and unlinked, so a test never passes over a leak."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop(timeout_s=30)
            leftovers = self.leftovers()
        finally:
            self.kill_tree()
            self.unlink_shm()
        if leftovers:
            if exc is not None:
                exc.add_note(f"vx serve tree {leftovers}")
                return
            raise AssertionError(f"vx serve tree {leftovers}\n{self.log()}")

    def log(self, tail: int = 6000) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-tail:]

    def full_log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit(timeout_s)

    def survivors(self) -> list[int]:
        return [p for p in self.pids if alive(p)]

    def leftover_shm(self) -> set[str]:
        return shm_of(set(self.pids))

    def left_behind(self, timeout_s: float = 10.0) -> tuple[list[int], set[str]]:
        """(live pids, `vx-*` segments) of the tree once it has exited: polled for up to
        `timeout_s` until both are empty (children and the resource tracker exit, and the
        segments go, a moment after the front)."""
        if self.pids:
            poll(lambda: not self.survivors() and not self.leftover_shm(), timeout_s)
        return self.survivors(), self.leftover_shm() if self.pids else set()

    def leftovers(self, timeout_s: float = 10.0) -> str:
        """'' where `left_behind` finds nothing, else what is left (pids with their command
        lines, segment names)."""
        pids, shm = self.left_behind(timeout_s)
        if not pids and not shm:
            return ""
        procs = {p: _cmdline(p) for p in pids}
        return f"left behind: processes {procs}, /dev/shm segments {sorted(shm)}"

    def unlink_shm(self) -> None:
        """Cleanup after `leftovers` named them: unlink the tree's remaining segments."""
        for name in self.leftover_shm() if self.pids else ():
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass

    def kill_tree(self) -> None:
        """Cleanup: SIGKILL whatever of the tree still lives (ours only). Silent: callers that
        must not leave anything (`__exit__`) check `leftovers` first."""
        for pid in self.survivors():
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        if hasattr(self, "_log"):
            self._log.close()

    # ── observation ──
    def snapshot(self) -> Snapshot:
        assert self.proc is not None
        return Snapshot(num_fds(self.proc.pid), self.leftover_shm())

    def scrape(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10)
        r.raise_for_status()
        return parse_metrics(r.text)

    def health(self, timeout_s: float = 2.0) -> int:
        try:
            return httpx.get(self.url + "/health", timeout=timeout_s).status_code
        except httpx.HTTPError:
            return 0

    def abort_times(self) -> dict[int, float]:
        """client port -> wall-clock time of the front's abort, from the disconnect log lines."""
        out: dict[int, float] = {}
        for m in _ABORT_LINE.finditer(self.full_log()):
            out[int(m.group(1))] = float(m.group(2))
        return out


_ABORT_LINE = re.compile(r"client [\d.]+:(\d+) left \S+: aborted at ([\d.]+)")


def kv_state(metrics: dict[str, float]) -> dict[str, float]:
    return {
        "self_check_ok": total(metrics, "vx:kv_self_check_ok"),
        "running": total(metrics, "vx:num_requests_running"),
        "waiting": total(metrics, "vx:num_requests_waiting"),
        "usage": total(metrics, "vx:kv_cache_usage_perc"),
        "free": total(metrics, "vx:kv_num_free_blocks"),
        "blocks": total(metrics, "vx:kv_num_blocks"),
    }


def settled(server: Served, timeout_s: float = 15.0) -> tuple[dict[str, float], dict[str, float]]:
    """Wait until the server is idle and balanced; returns (accounting, kv state).

    Idle means: the equation holds, nothing runs or waits, the KV pool is all free and the
    self-check (run by the scrape itself at idle) passed.
    """
    state: dict[str, tuple[dict[str, float], dict[str, float]]] = {}

    def ok() -> bool:
        m = server.scrape()
        acc, kv = accounting(m), kv_state(m)
        state["last"] = (acc, kv)
        return (
            balanced(acc)
            and kv["running"] == 0
            and kv["waiting"] == 0
            and kv["usage"] == 0
            and kv["free"] == kv["blocks"]
            and kv["self_check_ok"] == 1
        )

    good = poll(ok, timeout_s, 0.05)
    acc, kv = state["last"]
    assert good, f"not settled: accounting {acc}, kv {kv}\n{server.log()}"
    return acc, kv
