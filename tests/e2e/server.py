"""A real `vx serve` subprocess for end-to-end tests.

`VxServer` starts `python -m vx serve MODEL --port P ...`, waits for /ready, and on exit sends
SIGTERM, checks the exit code and that no process or /dev/shm segment of its tree was left
behind: leftovers fail the test loudly (named in an AssertionError, or in a note on the test's
own exception) before they are SIGKILLed and unlinked.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import NoReturn

import httpx

from tests.reliability.harness import alive, descendants, shm_of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VxServer:
    def __init__(
        self,
        model: str,
        *args: str,
        startup_timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """`env`: variables set for this server's tree only, over the test's environment."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        self.args = args
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = f"/tmp/vx-e2e-{self.port}.log"
        #: the log, once a passing server's exit has removed its file
        self._kept: str | None = None
        self.exit_code: int | None = None
        self.pids: list[int] = []
        self.env = {**os.environ, **env} if env else None

    def __enter__(self) -> VxServer:
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vx", "serve", self.model, "--port", str(self.port),
             "--num-threads", "1", *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            # the tree so far (an exited front's children are no longer its descendants)
            tree = [*self.pids, self.proc.pid, *descendants(self.proc.pid)]
            self.pids = list(dict.fromkeys(tree))
            if self.proc.poll() is not None:
                self._close(RuntimeError(f"vx serve exited with {self.proc.returncode}"))
            try:
                if httpx.get(self.url + "/ready", timeout=1).status_code == 200:
                    self.pids = [self.proc.pid, *descendants(self.proc.pid)]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # polling an external process's start-up, not synchronising tests
        self._close(TimeoutError("vx serve not healthy"))

    def _close(self, error: Exception) -> NoReturn:
        """A failed start: stop and clean up the tree, then raise `error` with the log."""
        try:
            self.stop(timeout_s=30)
        except subprocess.TimeoutExpired:
            pass
        left = self.left_behind(timeout_s=5)
        self._clean_up()
        raise type(error)(f"{error} ({left or 'nothing left behind'}):\n{self.log()}")

    def log(self) -> str:
        return self.full_log()[-5000:]

    def full_log(self) -> str:
        if self._kept is not None:
            return self._kept
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

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

    def left_behind(self, timeout_s: float = 10.0) -> str:
        """'' once no process and no `vx-*` segment of the tree (segment names carry their
        creator's pid: only ours count) is left within `timeout_s`, else what is left."""
        tree = set(self.pids)

        def left() -> tuple[list[int], set[str]]:
            return [p for p in self.pids if alive(p)], shm_of(tree)

        deadline = time.monotonic() + timeout_s
        while any(left()) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the exiting tree's processes
        pids, shm = left()
        if not pids and not shm:
            return ""
        return f"left behind: processes {pids}, /dev/shm segments {sorted(shm)}"

    def _clean_up(self) -> None:
        """After `left_behind` named them: SIGKILL the tree's survivors, unlink its segments."""
        for pid in self.pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in shm_of(set(self.pids)):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        if not self._log.closed:
            self._log.close()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        code: int | None = None
        try:
            code = self.stop()
        finally:
            left = self.left_behind()
            self._clean_up()
        if exc is not None:  # the test failed already: name the leftovers beside its error
            if left:
                exc.add_note(f"vx serve tree {left}")
            return
        problems = [f"exit code {code}"] if code != 0 else []
        problems += [f"vx serve tree {left}"] if left else []
        assert not problems, "; ".join(problems) + f"\n{self.log()}"
        # A passing server's log file goes (a failed test keeps it); a test may still read
        # the log after the server's exit, from memory.
        self._kept = self.full_log()
        os.unlink(self.log_path)
