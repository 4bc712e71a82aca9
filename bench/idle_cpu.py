"""Idle CPU of a whole `vx serve` process tree (goal: under 2% of one core over 10 s).

Usage:
    python bench/idle_cpu.py [MODEL] [--seconds 10]

Starts `vx serve`, waits for /ready, sends one request (so every process has done real work
and parked), then sums utime + stime of the front, the EngineCore and the Workers from
/proc over the window and reports it as a percentage of one core.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return [pid] + [p for k in kids for p in tree(k)]


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except FileNotFoundError:
            pass
    return total / TICK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "vx", "serve", args.model, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 8}, timeout=60)
        time.sleep(1.0)  # let every process park
        pids = tree(proc.pid)
        c0, t0 = cpu_seconds(pids), time.monotonic()
        time.sleep(args.seconds)
        c1, t1 = cpu_seconds(pids), time.monotonic()
        pct = 100.0 * (c1 - c0) / (t1 - t0)
        print(f"idle CPU of {len(pids)} processes over {t1 - t0:.1f} s: {pct:.2f}% of one core "
              f"(goal < 2%)")
        return 0 if pct < 2.0 else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    raise SystemExit(main())
