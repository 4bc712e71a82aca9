"""vx's CPU kernel library: its build from the C sources, its load, and which of its attention
kernels this process runs.

Runs in: each Worker process (and the tests and bench scripts that call the kernels directly).

The C is in ``vx/gpu/cpu/csrc`` (`CSRC`): one translation unit, ``vx_kernels.c``, with the
exported functions declared in ``vx_kernels.h`` and bound from the table in `vx.gpu.cpu.abi`.
`load_cpu_kernels` compiles it once per machine with the system C compiler (``$CC``, else
``cc`` or ``gcc``) at ``-march=native`` into ``$VX_CACHE/kernels`` (default
``~/.cache/vx/kernels``) and loads it with ctypes. ``VX_CPU_SANITIZE=address`` builds it with
AddressSanitizer instead (its own name; for `make check-c`, which preloads the runtime);
``VX_CPU_EMULATE=1`` builds it for an emulated Sapphire Rapids (`vx.gpu.cpu.emulate`).

``VX_CPU_ATTENTION_KERNEL`` decides, once per process: ``0``, no library (every caller takes
its torch path); ``portable``, the library with the portable decode attention kernel and SDPA
for prefill chunks; anything else, the fastest attention kernels the CPU has (AVX512-BF16,
with AMX for q.k where the CPU has it, or AVX2).

Invariants:

- the library's file name carries a digest of every .c and .h under `CSRC` (and any file in
  `_KERNEL_SOURCES`), the flags and the CPU's model and flags, so an edit to any of them, or
  another CPU sharing the cache folder, builds a new one; a build publishes its file with one
  atomic rename, so concurrent builders never load a half-written library;
- `CSRC` and `_KERNEL_SOURCES` are read from this module when a build starts, so a test that
  points them at a copy of the sources (tests/gpu/cpu/test_kernel_library.py) builds that copy;
- `load_cpu_kernels` builds and loads at most once per process (until `set_cpu_decode_kernel`
  resets it): every later call returns the same library, or the same None, and
  `kernel_build_error` says why it is None (the compiler's first error, a missing compiler or
  symbol);
- whether the fast attention kernels run is decided once, from the same read of
  ``VX_CPU_ATTENTION_KERNEL`` as the load (or on the first ask, if that comes first), and kept:
  the attention asks every layer of every step, and a process takes one path for its life
  (`set_fast_decode_attention` overrides it, or with None decides it again, for tests).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

from vx import envs
from vx.gpu.cpu.abi import bind_kernels
from vx.gpu.cpu.emulate import EMULATED_DEFINES, emulating, emulation_flags

logger = logging.getLogger(__name__)

__all__ = [
    "CFLAGS",
    "CSRC",
    "KernelBuildError",
    "cpu_decode_kernel_available",
    "decode_kernel_fn",
    "fast_decode_attention",
    "first_compiler_error",
    "kernel_build_error",
    "load_cpu_kernels",
    "prefill_kernel_available",
    "set_cpu_decode_kernel",
    "set_fast_decode_attention",
    "set_work_stealing",
]

#: The C sources: vx_kernels.h, the kernel files, and vx_kernels.c, which includes them
#: (one translation unit); emulate/ holds the emulated build's <immintrin.h>.
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
#: The files the compiler is given (tests add a broken one to see the compiler's error).
_KERNEL_SOURCES = [os.path.join(CSRC, "vx_kernels.c")]
# -fassociative-math (and what it needs) lets the dot products and sums vectorise.
CFLAGS = [
    "-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
    "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra",
]  # fmt: skip
#: The flags a build uses (tests put another -march here to build for an older CPU).
_CFLAGS = CFLAGS

#: "forced": `set_cpu_decode_kernel`'s choice; "lib": the loaded library (None: none), once
#: asked; "error": why it is None.
_kernel_state: dict[str, object] = {}
#: "fast": whether the fast attention kernels run, once decided.
_fast_state: dict[str, bool] = {}


# ───────────────────────────── load ─────────────────────────────


def load_cpu_kernels() -> ctypes.CDLL | None:
    """The kernel library, built and loaded on the first call; None where it is turned off
    (``VX_CPU_ATTENTION_KERNEL=0``, `set_cpu_decode_kernel(False)`) or did not build (then a
    warning says why, and `kernel_build_error` keeps it)."""
    if "lib" in _kernel_state:
        return _kernel_state["lib"]  # type: ignore[return-value]
    setting = envs.VX_CPU_ATTENTION_KERNEL  # one read decides the library and its kernels
    _fast_state.setdefault("fast", setting != "portable")
    enabled = _kernel_state.get("forced")
    if enabled is None:
        enabled = setting != "0"
    lib = None
    if enabled:
        try:
            lib = _build_kernels()
        except (OSError, subprocess.SubprocessError, RuntimeError, AttributeError) as e:
            # AttributeError: a symbol the binding names is not in the library
            _kernel_state["error"] = str(e)
            logger.warning("the CPU kernel library is unavailable; using the torch path: %s", e)
    _kernel_state["lib"] = lib
    return lib


def set_cpu_decode_kernel(enabled: bool | None) -> None:
    """Force the kernel library on (if it builds) or off; None: the environment decides. The
    next `load_cpu_kernels` decides anew."""
    _kernel_state.clear()
    if enabled is not None:
        _kernel_state["forced"] = enabled


def cpu_decode_kernel_available() -> bool:
    """Whether decodes on CPU use the C kernel (built and loaded on first call)."""
    return load_cpu_kernels() is not None


def kernel_build_error() -> str | None:
    """Why `load_cpu_kernels` has no library (the compiler's first error, a missing compiler
    or symbol), or None: it loaded, was turned off, or was not asked for yet."""
    return _kernel_state.get("error")  # type: ignore[return-value]


def set_work_stealing(mode: int) -> None:
    """How the C kernels' parallel loops share items between threads (`vx_ws` in
    `vx/gpu/cpu/csrc/parallel.c`): 1, the default, each thread its own static range, then the
    others' leftovers; 0, own ranges only (as ``schedule(static)``: for A/B timing); k > 1,
    k ranges per thread, most of them taken by stealing (tests). Results are the same in every
    mode. Process-wide; a no-op without the kernels. ``VX_CPU_WORK_STEALING=0`` starts a
    process in mode 0 (to time a served run without stealing)."""
    lib = load_cpu_kernels()
    if lib is not None:
        lib.vx_set_work_stealing(int(mode))


# ───────────────────────────── which attention kernels run ─────────────────────────────


def set_fast_decode_attention(enabled: bool | None) -> None:
    """Use the AVX512-BF16 decode kernel for bf16 caches (True), the portable one (False), or
    what ``VX_CPU_ATTENTION_KERNEL`` says (None: decided again on the next ask): the fast
    kernel unless it is ``portable``. Its results differ from the portable kernel's in fp32
    summation order only (bf16 outputs within one ulp); the bf16 agreement with HF holds with
    either."""
    _fast_state.clear()
    if enabled is not None:
        _fast_state["fast"] = enabled


def fast_decode_attention() -> bool:
    """Whether the fast attention kernels run: `set_fast_decode_attention`'s choice, else
    what ``VX_CPU_ATTENTION_KERNEL`` said when the library loaded (or at this first ask, if it
    comes before the load)."""
    fast = _fast_state.get("fast")
    if fast is None:
        fast = _fast_state["fast"] = envs.VX_CPU_ATTENTION_KERNEL != "portable"
    return fast


def prefill_kernel_available() -> bool:
    """Whether bf16 prefill chunks on CPU use the C kernel (with AMX, on AVX512-BF16 without it,
    or the AVX2 one on AVX2 CPUs without AVX-512); ``VX_CPU_ATTENTION_KERNEL=portable`` keeps
    torch's SDPA for them."""
    lib = load_cpu_kernels()
    return lib is not None and fast_decode_attention() and bool(lib.vx_has_prefill_attention())


def decode_kernel_fn(dtype: torch.dtype, *, fast: bool = False):
    """The C decode kernel for `dtype` (None: none); `fast` picks the AVX512-BF16 one for bf16
    where it was built, else the AVX2 one where that was (each returns -2 for a shape it does
    not handle)."""
    lib = load_cpu_kernels()
    if lib is None:
        return None
    if fast and dtype == torch.bfloat16:
        if lib.vx_has_fast_bf16():
            return lib.vx_decode_attention_bf16_fast
        if lib.vx_has_avx2_attention():
            return lib.vx_decode_attention_bf16_avx2
    return {
        torch.float32: lib.vx_decode_attention_f32,
        torch.bfloat16: lib.vx_decode_attention_bf16,
    }.get(dtype)


# ───────────────────────────── build ─────────────────────────────


class KernelBuildError(RuntimeError):
    """The C compiler rejected the kernel source; the message leads with its first error."""


def first_compiler_error(stderr: str) -> str:
    """The first line of `stderr` that reports an error (GCC's and Clang's
    ``file:line:col: error: ...``, or the driver's ``cc: error: ...``), else its first line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln:
            return ln
    return lines[0] if lines else "(the compiler printed nothing)"


def _build_kernels() -> ctypes.CDLL | None:
    """Builds the library (unless this machine's build of these sources and flags is already in
    the cache folder), loads and binds it, and applies the process-wide switches."""
    cc = shutil.which(envs.CC) or shutil.which("gcc")
    if cc is None:
        _kernel_state["error"] = "no C compiler found (cc or gcc on PATH, or $CC)"
        logger.warning("no C compiler found; the CPU path uses torch's kernels")
        return None
    # Read at build time, not bound at import: tests point these at a copy of the sources.
    csrc, sources = CSRC, _KERNEL_SOURCES
    with open("/proc/cpuinfo", "rb") as f:  # -march=native: one build per CPU model
        cpu = b"".join(line for line in f if line.startswith((b"flags", b"model name")))
    # VX_CPU_EMULATE=1 (tests): the AVX-512 BF16 and AMX kernels in software on any x86 CPU
    emulate = emulating()
    if emulate:
        cpu += " ".join(EMULATED_DEFINES).encode()
    flags = _build_flags()
    key = hashlib.sha256(_kernel_source_digest(csrc, sources) + " ".join(flags).encode() + cpu)
    # VX_CPU_MARCH: another target's build, in its own folder beside this CPU's
    march = envs.VX_CPU_MARCH
    cache = os.path.join(envs.VX_CACHE, f"kernels-{march}" if march else "kernels")
    name = "decode_attention-emulated" if emulate else "decode_attention"
    if envs.VX_CPU_SANITIZE:
        name += "-" + envs.VX_CPU_SANITIZE
    path = os.path.join(cache, f"{name}-{key.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            so = os.path.join(tmp, "decode_attention.so")
            extra = emulation_flags(csrc) if emulate else []
            proc = subprocess.run(
                [cc, *flags, *extra, "-I", csrc, "-o", so, *sources],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            if proc.returncode != 0:
                raise KernelBuildError(
                    f"{os.path.basename(cc)} exited with {proc.returncode}: "
                    f"{first_compiler_error(proc.stderr)}"
                )
            if proc.stderr.strip():  # the sources build with -Wall -Wextra and say nothing
                logger.warning("the CPU kernel library built with warnings:\n%s", proc.stderr)
            os.replace(so, path)  # atomic: concurrent builders each publish a whole file
        logger.info("built the CPU kernel library: %s", path)
    lib = ctypes.CDLL(path)
    bind_kernels(lib)
    if lib.vx_has_fast_bf16():
        # AMX tiles for q.k in the fast kernel where the CPU has them (VX_CPU_ATTENTION_AMX=0: off)
        if envs.VX_CPU_ATTENTION_AMX and lib.vx_fast_amx(1):
            logger.info("the fast CPU decode attention kernel uses AMX for q.k")
    if not envs.VX_CPU_WORK_STEALING:  # served A/B timing
        lib.vx_set_work_stealing(0)
    return lib


def _build_flags() -> list[str]:
    """`_CFLAGS` (``-march=native`` replaced by ``VX_CPU_MARCH`` where it is set), or with
    ``VX_CPU_SANITIZE=address`` (or another of the compiler's
    ``-fsanitize=`` values; `make check-c`) a sanitized build of the same code: -O1 for the
    sanitizer's speed, frame pointers and debug lines for its reports. A process that loads
    it needs the sanitizer's runtime first (``LD_PRELOAD``, as `make check-c` sets it)."""
    sanitize, march = envs.VX_CPU_SANITIZE, envs.VX_CPU_MARCH
    flags = (
        [f"-march={march}" if f == "-march=native" else f for f in _CFLAGS] if march else _CFLAGS
    )
    if not sanitize:
        return flags
    return [f for f in flags if not f.startswith("-O")] + [
        "-O1", "-g", f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"
    ]


def _kernel_source_digest(csrc: str, sources: list[str]) -> bytes:
    """A digest of every C file the library is built from (each .c and .h under `csrc`, the
    emulated <immintrin.h> included, and any extra file in `sources`), by path and content:
    any edit to one makes a new library."""
    files = set(sources)
    for root, _, names in os.walk(csrc):
        files.update(os.path.join(root, n) for n in names if n.endswith((".c", ".h")))
    h = hashlib.sha256()
    for f in sorted(files):
        with open(f, "rb") as fh:
            h.update(os.path.relpath(f, csrc).encode() + b"\0" + fh.read() + b"\0")
    return h.digest()
