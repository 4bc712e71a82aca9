"""Where the host processes run (`vx.affinity`) and the Worker's thread binding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vx.affinity import host_cpus

ALLOWED = os.sched_getaffinity(0)


def test_auto_pins_cpu_runs_to_the_last_core_only() -> None:
    want = {max(ALLOWED)} if len(ALLOWED) >= 2 else None
    assert host_cpus("cpu", "auto") == want
    assert host_cpus("cuda", "auto") is None  # GPU runs are left alone


def test_explicit_lists_off_and_bad_specs() -> None:
    first = min(ALLOWED)
    assert host_cpus("cpu", "off") is None
    assert host_cpus("cpu", f"{first}") == {first}
    assert host_cpus("cuda", f"{first}-{first}") == {first}  # explicit: any device
    assert host_cpus("cpu", "100000") is None  # not an allowed core
    assert host_cpus("cpu", "x,y") is None


@pytest.mark.skipif(len(ALLOWED) < 2, reason="one core: nothing to bind apart")
def test_worker_binds_each_openmp_thread_to_its_own_core() -> None:
    """After `_bind_omp_threads` (as many threads as allowed cores) the main thread (OpenMP
    thread 0) runs on the lowest allowed core only, and the pool's next thread on the next;
    with fewer threads than cores nothing is bound."""
    code = (
        "import os, sys, torch; torch.set_num_threads(int(sys.argv[1]))\n"
        "from vx.gpu.cpu.library import load_cpu_kernels\n"
        "from vx.gpu.worker import _bind_omp_threads\n"
        "if load_cpu_kernels() is None: print('skip'); raise SystemExit\n"
        "_bind_omp_threads()\n"
        "tids = [int(t) for t in os.listdir('/proc/self/task')]\n"
        "def cores(t): return ','.join(map(str, sorted(os.sched_getaffinity(t))))\n"
        "print(cores(0), ' '.join(cores(t) for t in tids))\n"
    )

    def run(threads: int) -> str:
        return subprocess.run(
            [sys.executable, "-c", code, str(threads)],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout.strip()  # fmt: skip

    out = run(len(ALLOWED))
    if out == "skip":
        pytest.skip("no C kernels here")
    cpus = sorted(ALLOWED)
    main, *threads = out.split()
    assert main == str(cpus[0])
    assert str(cpus[1]) in threads  # the pool's second thread, on the second core alone
    assert run(1).split()[0] == ",".join(map(str, cpus))  # fewer threads than cores: free
