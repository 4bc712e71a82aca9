"""The AVX-512 BF16 and AMX kernels, run on whatever x86 CPU the tests run on.

Most of vx's CPU users on servers run these kernels, and a machine without them would otherwise
skip every test of them. Here the kernel tests run again in a child pytest with the library
built for an emulated Sapphire Rapids (`VX_CPU_EMULATE=1`, `vx.gpu.cpu.emulate`), once with
AMX and once without it (the paths of Zen 4 and 5). The child's tests are the same files as
the native run's; they compare with torch references and with HF, so an emulated pass says the
kernels' logic holds on that ISA.

Both emulated runs happen on every host, its own ISA included: under the emulation the layers
route by the emulated CPU alone (no fp32 copies, no oneDNN copies), so a green run here says
they pass on every kind of machine, not only on this one (an AVX2 host once failed where AMX
hosts passed). On an AMX host the AMX-off paths also run natively.

Runs in: the test process, which starts the child pytest.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from xml.etree import ElementTree

import pytest

from vx.gpu.cpu.library import load_cpu_kernels

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
    reason="x86 targets with a C compiler",
)

#: The kernel tests: the library's own check first (it built, with every kernel the emulated
#: CPU has), then the attention kernels, the GEMMs, the fused steps, the experts and model parity.
LIBRARY_TEST = "tests/gpu/cpu/test_kernel_library.py::test_library_builds_with_the_expected_kernels"
KERNEL_TESTS = [
    LIBRARY_TEST,
    "tests/gpu/attention/test_fast_attention.py",
    "tests/gpu/attention/test_prefill_attention.py",
    "tests/gpu/attention/test_window_kernels.py",
    "tests/gpu/cpu/test_vnni_gemm.py",
    "tests/gpu/sample/test_greedy_step.py",
    "tests/gpu/cpu/test_fused_step.py",
    "tests/gpu/cpu/test_ops.py",
    "tests/gpu/layers/test_fused_moe.py",
    "tests/gpu/test_model_parity.py",
]


def _native() -> tuple[bool, bool]:
    """(AVX512-BF16 kernels, AMX) in this CPU's own library."""
    lib = load_cpu_kernels()
    if lib is None:
        return False, False
    fast = bool(lib.vx_has_fast_bf16())
    return fast, fast and bool(lib.vx_fast_amx(-1))


def _run_child(amx: bool, emulate: bool, tmp_path) -> None:
    """The kernel tests in a child pytest on that ISA; fails unless the library check ran and
    passed there (a child whose library did not build would skip the kernel tests)."""
    pytest.importorskip("simde_py", reason="SIMDe's headers (simde-py, in the dev extra)")
    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    env = dict(os.environ, VX_CPU_ATTENTION_AMX="1" if amx else "0")
    env["VX_CPU_EMULATE"] = "1" if emulate else "0"
    env.pop("VX_CPU_ATTENTION_KERNEL", None)
    report = tmp_path / "child.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "-m", "not stress and not gpu", f"--junitxml={report}", *KERNEL_TESTS],
        cwd=root, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    # {test: passed}: a case with a skipped, failure or error element did not pass
    cases = {
        f"{c.get('classname')}::{c.get('name')}": not any(
            e.tag in ("skipped", "failure", "error") for e in c
        )
        for c in ElementTree.parse(report).iter("testcase")
    }
    library = "tests.gpu.cpu.test_kernel_library::test_library_builds_with_the_expected_kernels"
    assert cases.get(library), f"the library check did not pass in the child: {tail}"
    passed = sum(cases.values())
    assert passed > len(cases) // 2, f"{passed} of {len(cases)} kernel tests passed: {tail}"


@pytest.mark.timeout(1560)
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "avx512_bf16"])
def test_kernels_on_the_emulated_cpu(amx: bool, tmp_path) -> None:
    _run_child(amx=amx, emulate=True, tmp_path=tmp_path)


@pytest.mark.timeout(1560)
def test_kernels_with_amx_off(tmp_path) -> None:
    """On an AMX CPU the same library with AMX off: the AVX512-BF16 paths, natively."""
    if not _native()[1]:
        pytest.skip("no AMX here: the native run and the emulated ones cover this CPU's paths")
    _run_child(amx=False, emulate=False, tmp_path=tmp_path)
