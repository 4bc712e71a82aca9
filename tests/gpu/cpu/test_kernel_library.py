"""The CPU kernel library builds here, with every kernel this CPU (or the emulated one) should
have; a kernel source the compiler rejects fails the suite with the compiler's first error.

Runs in: the test process (and, for the broken-source check, a child pytest).

Why: the Worker falls back to torch's kernels when the library does not build, which keeps a
server up but turns a typo in the C into a silent slowdown, and every kernel test would skip
("no AVX512-BF16 here") instead of failing. Here the expected kernels are read off the CPU's
own flags (/proc/cpuinfo), not off the library, so a library that lost one fails.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys

import pytest

from vx.gpu.cpu import library
from vx.gpu.cpu.emulate import emulating

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
    reason="the kernels are built for x86 CPUs with a C compiler",
)

#: The line `broken_kernel_source` adds to the source: the compiler must name it.
BROKEN_LINE = "int vx_broken_on_purpose = ;"


def use_broken_sources(into: str) -> None:
    """Points `vx.gpu.cpu.library`'s build at a copy of the C sources in `into` whose last
    kernel file (included last by vx_kernels.c) ends with `BROKEN_LINE`."""
    csrc = os.path.join(into, "csrc")
    shutil.copytree(library.CSRC, csrc)
    with open(os.path.join(csrc, "greedy_step.c"), "a") as f:
        f.write(BROKEN_LINE + "\n")
    library.CSRC = csrc
    library._KERNEL_SOURCES = [os.path.join(csrc, "vx_kernels.c")]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def expected_kernels() -> dict[str, int]:
    """{the library's `vx_has_*` query: its answer} for this CPU, or the emulated one."""
    flags = _cpu_flags()
    if emulating():  # an emulated Sapphire Rapids (vx.gpu.cpu.emulate)
        flags |= {"avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}
    avx512 = {"avx512f", "avx512bw"} <= flags
    bf16 = avx512 and "avx512_bf16" in flags
    amx = bf16 and {"amx_tile", "amx_bf16"} <= flags
    amx_on = amx and os.environ.get("VX_CPU_ATTENTION_AMX", "1") != "0"
    avx2 = "avx2" in flags and "fma" in flags and not avx512
    want = {
        "vx_has_fast_bf16": int(bf16),
        "vx_has_gemm_vnni": int(bf16),
        "vx_has_screen": int(bf16),
        "vx_has_gemv": int(avx512),
        "vx_has_gemm_amx_vnni": int(amx_on),
        "vx_has_avx2_attention": int(avx2),
        "vx_has_gemm_panels_avx2": int(avx2),
        # the fused step: 1 on AVX-512 kernels, 2 on AVX2's
        "vx_has_decode_step": 1 if avx512 else 2 if avx2 else 0,
    }
    if bf16 or avx2:  # the prefill attention: AMX's (1), AVX2's (2), AVX512-BF16's (3)
        want["vx_has_prefill_attention"] = 1 if amx_on else 3 if bf16 else 2
    if bf16:
        want["vx_fast_amx"] = int(amx_on)
    return want


@pytest.mark.timeout(600)
def test_library_builds_with_the_expected_kernels() -> None:
    if os.environ.get("VX_CPU_ATTENTION_KERNEL", "1") == "0":
        pytest.skip("VX_CPU_ATTENTION_KERNEL=0 turns the kernel library off")
    lib = library.load_cpu_kernels()
    assert lib is not None, f"the CPU kernel library did not build: {library.kernel_build_error()}"
    want = expected_kernels()
    got = {
        name: int(getattr(lib, name)(-1) if name == "vx_fast_amx" else getattr(lib, name)())
        for name in want
    }
    assert got == want, f"kernels this CPU should have (emulated: {emulating()})"


@pytest.fixture
def own_library(monkeypatch, tmp_path):
    """The kernel library's module state and cache folder to this test alone."""
    monkeypatch.setattr(library, "_kernel_state", {})
    monkeypatch.setattr(library, "_fast_state", {})
    monkeypatch.setenv("VX_CACHE", str(tmp_path))
    monkeypatch.delenv("VX_CPU_ATTENTION_KERNEL", raising=False)


@pytest.mark.timeout(120)
def test_a_rejected_source_is_reported_with_the_compilers_error(
    own_library, monkeypatch, caplog, tmp_path
) -> None:
    monkeypatch.setattr(library, "CSRC", library.CSRC)
    monkeypatch.setattr(library, "_KERNEL_SOURCES", library._KERNEL_SOURCES)
    use_broken_sources(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="vx.gpu.cpu.library"):
        assert library.load_cpu_kernels() is None
    error = library.kernel_build_error()
    assert error is not None and "error:" in error, error
    assert "expected expression" in error, error  # GCC's and Clang's words for `= ;`
    assert "greedy_step.c" in error, error  # the file and line, through vx_kernels.c
    # serving goes on on torch's kernels, with a warning that names the error
    assert any(error in r.getMessage() for r in caplog.records), caplog.text


def test_first_compiler_error() -> None:
    stderr = (
        "k.c: In function 'f':\n"
        "k.c:3:9: warning: unused variable 'x'\n"
        "k.c:4:21: error: expected expression before ';' token\n"
        "k.c:9:1: error: something later\n"
    )
    assert library.first_compiler_error(stderr) == "k.c:4:21: error: expected expression before ';' token"
    assert library.first_compiler_error("cc: fatal error: no input files\n").endswith("no input files")
    assert library.first_compiler_error("") == "(the compiler printed nothing)"


@pytest.mark.timeout(300)
def test_a_broken_kernel_source_fails_the_suite(tmp_path) -> None:
    """The suite's own check above, run with a syntax error patched into the source
    (`tests/gpu/cpu/broken_kernel_source.py`), fails and prints the compiler's message."""
    root = os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    env = dict(os.environ, VX_CACHE=str(tmp_path))
    env.pop("VX_CPU_ATTENTION_KERNEL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-p", "tests.gpu.cpu.broken_kernel_source",
         "tests/gpu/cpu/test_kernel_library.py::test_library_builds_with_the_expected_kernels"],
        cwd=root, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "1 failed" in out, out[-3000:]
    assert "the CPU kernel library did not build" in out and "error:" in out, out[-3000:]
    assert "vx_broken_on_purpose" in out or "expected expression" in out, out[-3000:]


#: One target per kind of CPU vx serves (docs/cpu-kernels.md): AVX2 only (Zen 3 and older),
#: AVX512-BF16 without AMX (Cooper Lake, as Zen 4 and 5), AMX (Sapphire Rapids).
ISA_TARGETS = ("haswell", "cooperlake", "sapphirerapids")


@pytest.mark.parametrize("march", ISA_TARGETS)
def test_the_sources_compile_without_warnings_for_every_isa(march: str) -> None:
    """The library is built with -march=native, so one machine compiles one ISA's kernels:
    each kind's must be free of warnings (and errors) with the library's flags, whichever kind
    runs the suite. A syntax pass: the checks -Wall -Wextra make before code generation."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    probe = subprocess.run(
        [cc, f"-march={march}", "-x", "c", "-fsyntax-only", "-"], input="", capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"{os.path.basename(cc)} does not know -march={march}")
    flags = [f for f in library._CFLAGS if not f.startswith("-march=")]
    proc = subprocess.run(
        [cc, *flags, f"-march={march}", "-fsyntax-only", "-I", library.CSRC,
         *library._KERNEL_SOURCES],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
