"""The AVX-512 BF16 and AMX kernels, run on whatever x86 CPU the tests run on.

Most of vx's CPU users on servers run these kernels, and a machine without them would otherwise
skip every test of them. Here the kernel tests run again in a child pytest with the library
built for an emulated Sapphire Rapids (`VX_CPU_EMULATE=1`, `vx.gpu.cpu_emulate`), once with
AMX and once without it (the paths of Zen 4 and 5), where this CPU cannot run that path
itself. The child's tests are the same files as the native run's; they compare with torch
references and with HF, so an emulated pass says the kernels' logic holds on that ISA.

Runs in: the test process, which starts the child pytest.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest

from vx.gpu.kv_cache import load_cpu_kernels

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
    reason="x86 targets with a C compiler",
)

#: The kernel tests: the attention kernels, the GEMMs, the fused steps and model parity.
KERNEL_TESTS = [
    "tests/gpu/test_fast_attention.py",
    "tests/gpu/test_prefill_attention.py",
    "tests/gpu/test_vnni_gemm.py",
    "tests/gpu/test_greedy_step.py",
    "tests/gpu/test_cpu_decode.py",
    "tests/gpu/test_cpu_ops.py",
    "tests/gpu/test_model_parity.py",
]


def _native() -> tuple[bool, bool]:
    """(AVX512-BF16 kernels, AMX) in this CPU's own library."""
    lib = load_cpu_kernels()
    if lib is None:
        return False, False
    fast = bool(lib.vx_has_fast_bf16())
    return fast, fast and bool(lib.vx_fast_amx(-1))


def _run_child(amx: bool, emulate: bool) -> None:
    pytest.importorskip("simde_py", reason="SIMDe's headers (simde-py, in the dev extra)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, VX_CPU_ATTENTION_AMX="1" if amx else "0")
    env["VX_CPU_EMULATE"] = "1" if emulate else "0"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "-m", "not stress and not gpu", *KERNEL_TESTS],
        cwd=root, env=env, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail, tail


@pytest.mark.timeout(900)
def test_kernels_on_emulated_amx() -> None:
    if _native()[1]:
        pytest.skip("this CPU has AMX: the native run covers these paths")
    _run_child(amx=True, emulate=True)


@pytest.mark.timeout(900)
def test_kernels_on_avx512_bf16_without_amx() -> None:
    fast, amx = _native()
    if fast and not amx:
        pytest.skip("this CPU is AVX512-BF16 without AMX: the native run covers these paths")
    # on an AMX CPU the same library runs with AMX off; elsewhere, emulated
    _run_child(amx=False, emulate=not fast)
