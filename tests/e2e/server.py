"""A real `vx serve` subprocess for end-to-end tests.

`VxServer` starts `python -m vx serve MODEL --port P ...`, waits for /health, and on exit sends
SIGTERM, checks the exit code and that no process or /dev/shm segment was left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("vx-")}


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


class VxServer:
    def __init__(self, model: str, *args: str, startup_timeout_s: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.args = args
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = f"/tmp/vx-e2e-{self.port}.log"
        self.exit_code: int | None = None
        self.pids: list[int] = []

    def __enter__(self) -> VxServer:
        self._shm_before = shm_names()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vx", "serve", self.model, "--port", str(self.port),
             "--num-threads", "1", *self.args],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vx serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    self.pids = [self.proc.pid, *child_pids(self.proc.pid)]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # polling an external process's start-up, not synchronising tests
        self.stop()
        raise TimeoutError(f"vx serve not healthy:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-5000:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        self.exit_code = self.proc.returncode
        return self.exit_code

    def __exit__(self, *exc: object) -> None:
        code = self.stop()
        self._log.close()
        if exc[0] is None:
            assert code == 0, self.log()
            deadline = time.monotonic() + 10
            alive = self.pids
            while alive and time.monotonic() < deadline:
                alive = [p for p in alive if _alive(p)]
                time.sleep(0.1)
            assert not alive, f"left behind: {alive}"
            # Segment names carry the creator's pid: only ours count (other runs may share /dev/shm).
            assert {n for n in shm_names() if n.startswith(f"vx-{self.proc.pid}-")} == set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours is not alive for this purpose.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
