"""The CPU kernel library built for an emulated Sapphire Rapids, for tests on any x86 CPU.

Runs in: the Worker process, only when ``VX_CPU_EMULATE=1`` (a test knob, never a serving
mode: the emulated kernels run far slower than the portable ones).

Why: the AVX-512 BF16 and AMX kernels are the ones most of vx's CPU users on Intel servers
run, and a test machine without them (an AVX2 runner, say) cannot execute them, so without
this they would ship untested there.
`vx.gpu.cpu.library` then compiles the same kernel source with `__AVX512F__`, `__AVX512BF16__`,
`__AMX_TILE__` and their kin defined, and with ``vx/gpu/cpu/csrc/emulate/immintrin.h`` in place of
the compiler's `<immintrin.h>`: SIMDe (`simde_py`, a dev dependency) supplies the AVX-512
intrinsics in portable C, and the few it lacks (bf16 conversions, scatter, masked gather and store) and
the AMX tile instructions are defined there, lane by lane, after Intel's pseudocode. Every
kernel then takes the path it takes on such a CPU: with ``VX_CPU_ATTENTION_AMX=0`` the paths
of AVX-512 BF16 without AMX (Zen 4 and 5), otherwise AMX's.

Invariants: the header shadows ``<immintrin.h>`` through the include path only, so no source
of the kernels changes for it; SIMDe never includes the real header (``SIMDE_NO_NATIVE``);
tile state is per thread, as on the hardware (each OpenMP thread configures its own).
"""

from __future__ import annotations

import os

from vx import envs

#: The target macros an AMX CPU's -march=native defines, which select the kernels' paths.
EMULATED_DEFINES = [
    "-DSIMDE_NO_NATIVE", "-D__AVX512F__", "-D__AVX512BW__", "-D__AVX512VL__", "-D__AVX512DQ__",
    "-D__AVX512CD__", "-D__AVX512BF16__", "-D__AVX512VNNI__", "-D__AMX_TILE__", "-D__AMX_BF16__",
    "-D__AMX_INT8__",
]  # fmt: skip


def emulating() -> bool:
    """Whether this process builds and routes for the emulated Sapphire Rapids
    (``VX_CPU_EMULATE=1``). Then the layers route by the emulated CPU, not this one: they take
    its bf16 arithmetic as given (no fp32 copies, `vx.gpu.cpu.widen`) and make no oneDNN copies
    (`vx.gpu.layers.quantization.cpu_prepack_enabled`), which an AVX2 host's oneDNN could not run.
    So the emulated tests take the same paths on every host."""
    return envs.VX_CPU_EMULATE


def emulation_flags(csrc: str) -> list[str]:
    """The compiler flags of the emulated build of the sources in `csrc` (its ``emulate/``
    folder shadows ``<immintrin.h>``; SIMDe's headers come in as system headers, so a warning
    of theirs is not the kernels'). Raises RuntimeError, naming the fix, without SIMDe."""
    try:
        import simde_py
    except ImportError as e:
        raise RuntimeError(
            "VX_CPU_EMULATE=1 needs SIMDe's headers: pip install 'simde-py' (in vx's dev extra)"
        ) from e
    return [
        *EMULATED_DEFINES, "-I", os.path.join(csrc, "emulate"), "-isystem", simde_py.get_include()
    ]
