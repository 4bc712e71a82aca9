"""The device machine's own CPU, measured in the same call as the GPU check.

    python bench/host_cpu.py --results FILE [--repeats 5] [--budget-s 230]

`bench/gpu_check.sh` runs this as its `cpu` section. GPU hosts are often Xeons with AMX, the
kind of CPU the CPU goals were set on, and a device call may be the only place such a CPU is at
hand; this makes every device check bring back the CPU figures too, at ~1.5 minutes:

- `cpu`: the model name, the vector and matrix extensions vx's kernels pick by, and the two
  CPUs chosen;
- `bench/forward.py --random` (the Worker issue's benchmark: the ModelRunner against HF's
  forward at decode 1/16/64 and prefill 128/2,048; random SmolLM2-shaped weights, since the
  real ones are too large to travel), one row a case with the goal (vx / HF at most 0.5);
- `bench/step_profile.py --random` at its defaults (a served c = 64 step: 64 decodes and 4 x 128
  prompt tokens) and at one 2,048-token prompt: where those steps' time goes, op by op.

Every run has 2 threads pinned to two CPUs on two different physical cores (`two_cores`): the
goals are stated for a 2-core machine, and two hyperthreads of one core would share that core's
FMA ports and AMX unit, which halves what the GEMMs and the attention can do. The GPU is hidden
(`CUDA_VISIBLE_DEVICES=`) so both sides run on the CPU.

Invariant: a row per figure or a FAIL row saying why; this never raises past `main`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_check import record  # noqa: E402  (bench/ is not a package)

SYSFS_CPU = "/sys/devices/system/cpu"
# The extensions vx's CPU kernels choose by (vx/gpu/cpu/csrc/*.c), in /proc/cpuinfo's names.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def two_cores(sysfs: str = SYSFS_CPU, allowed: set[int] | None = None) -> list[int]:
    """Two logical CPUs of `allowed` (default: this process's affinity) on two different
    physical cores, CPU 0's core avoided where two others exist (CPU 0 takes the host's
    housekeeping, and its sibling shares that core).

    A core is (physical_package_id, core_id) from sysfs; a CPU whose topology cannot be read
    counts as its own core. Raises ValueError when fewer than two cores are allowed."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in cpus:
        topo = os.path.join(sysfs, f"cpu{cpu}", "topology")
        try:
            with open(os.path.join(topo, "physical_package_id")) as f:
                package = f.read().strip()
            with open(os.path.join(topo, "core_id")) as f:
                core = f.read().strip()
        except OSError:
            package, core = "?", f"cpu{cpu}"
        cores.setdefault((package, core), []).append(cpu)
    if len(cores) < 2:
        raise ValueError(f"fewer than two physical cores among CPUs {cpus}")
    ordered = sorted(cores.values(), key=lambda c: (0 in c, min(c)))
    return sorted(max(c) if 0 in c else min(c) for c in ordered[:2])


def cpu_summary(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """The first CPU's model name and which of ISA_FLAGS it has."""
    model, flags = "?", set()
    with open(cpuinfo) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return model, [f for f in ISA_FLAGS if f in flags]


def parse_step_profile(text: str) -> list[dict[str, str]]:
    """bench/step_profile.py's table as one dict a case (column name -> value)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("case "):
            names = line.split()
            rows = []
            for row in lines[i + 1 :]:
                if row.startswith("(") or not row.strip():
                    break
                rows.append(dict(zip(names, row.split(), strict=False)))
            return rows
    return []


def _run(cmd: list[str], cpus: list[int], timeout_s: float) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    pinned = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
    done = subprocess.run(pinned, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        tail = " ".join((done.stdout + done.stderr).strip().splitlines()[-3:])[-300:]
        raise RuntimeError(f"exit {done.returncode}: {tail}")
    return done.stdout


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--results", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=230.0, help="for all three runs")
    args = ap.parse_args()
    end = time.monotonic() + args.budget_s
    model, isa = cpu_summary()
    try:
        cpus = two_cores()
    except ValueError as e:
        record(args.results, "cpu", "two cores", str(e), "FAIL")
        return 0
    record(
        args.results,
        "cpu",
        "host CPU",
        f"{model}; {os.cpu_count()} logical CPUs; {' '.join(isa)}; pinned to CPUs {cpus}",
    )
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="vx-host-cpu-") as tmp:
        out = os.path.join(tmp, "forward.json")
        cmd = [py, os.path.join(HERE, "forward.py"), "--random", "--threads", "2",
               "--repeats", str(args.repeats), "--json", out]  # fmt: skip
        try:
            _run(cmd, cpus, max(10.0, end - time.monotonic()))
            with open(out) as f:
                rows = json.load(f)["rows"]
            for r in rows:
                record(
                    args.results,
                    "cpu",
                    f"forward.py {r['case']} (2 threads, random)",
                    f"vx {r['vx_ms']:.1f} / HF {r['hf_ms']:.1f} ms = {r['ratio']:.2f} "
                    f"({'within' if r['ratio'] <= 0.5 else 'over'} the 0.5 goal)",
                )
        except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
            record(args.results, "cpu", "forward.py", str(e)[:300], "FAIL")
    for label, extra in (
        ("served c=64 step", []),
        (
            "2,048-token prompt",
            ["--decodes", "0", "--prompts", "1", "--prompt-len", "2048", "--repeats", "3"],
        ),
    ):
        cmd = [py, os.path.join(HERE, "step_profile.py"), "--random", "--threads", "2", *extra]
        try:
            text = _run(cmd, cpus, max(10.0, end - time.monotonic()))
            for row in parse_step_profile(text):
                case = row.pop("case", "?")
                ops = ", ".join(f"{k} {v}" for k, v in row.items())
                record(
                    args.results,
                    "cpu",
                    f"step_profile.py {label}: {case} (ms)",
                    re.sub(r"\s+", " ", ops),
                )
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            record(args.results, "cpu", f"step_profile.py {label}", str(e)[:300], "FAIL")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
