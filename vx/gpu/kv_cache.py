"""KV pool sizing and allocation of the per-layer paged K/V tensors.

Runs in: each Worker process.

Layout (the same on CPU and GPU): each layer owns one K and one V tensor of shape
``[num_kv_heads, num_blocks, block_size, head_dim]`` (head-major). A token's *slot* is
``block_id * block_size + offset``; viewing a cache as ``[num_kv_heads, num_blocks * block_size,
head_dim]`` makes the slot a plain index on dim 1. Head-major is chosen for the CPU path: a
gather of whole blocks along dim 1 (`index_select`) yields ``[num_kv_heads, B, ctx, head_dim]``
already contiguous, which is exactly the batch layout of one `matmul` over (kv head, request),
so no permute copy is needed after the gather. The Triton kernels take strides and do not care.

Sizing: bytes per block = 2 (K and V) x layers x kv_heads x head_dim x block_size x dtype size,
counting this tensor-parallel rank's kv heads only.

CPU kernels: a small C library over this layout (the KV write through a slot mapping, and the
decode attention `vx.gpu.attention.paged` uses: for bf16 an AVX512-BF16 kernel, with AMX for q.k
where the CPU has it, by default; `VX_CPU_ATTENTION_KERNEL=portable` picks the portable one;
source in `vx/gpu/cpu/csrc/decode_attention.c`), compiled once per machine with the system C compiler
into ``$VX_CACHE/kernels`` (default ``~/.cache/vx/kernels``) and loaded with ctypes; without a
compiler, or with ``VX_CPU_ATTENTION_KERNEL=0``, callers fall back to torch ops.
The C is in ``vx/gpu/cpu/csrc`` (`CSRC`): one translation unit, ``vx_kernels.c``, with the
exported functions declared in ``vx_kernels.h`` and bound from the table in `vx.gpu.cpu.abi`.
The library's name carries a digest of every .c and .h there, the flags and the CPU, so an edit
to any of them builds a new one. ``VX_CPU_SANITIZE=address`` builds it with AddressSanitizer
instead (its own name; for `make check-c`, which preloads the runtime).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import shutil
import subprocess
import tempfile

import torch

from vx import envs
from vx.config import BLOCK_SIZE
from vx.gpu.cpu.abi import bind_kernels
from vx.gpu.cpu.emulate import EMULATED_DEFINES, emulating, emulation_flags
from vx.gpu.cpu.pages import advise_huge

logger = logging.getLogger(__name__)

__all__ = [
    "KVCache",
    "KernelBuildError",
    "allocate_kv_caches",
    "block_bytes",
    "cpu_decode_kernel_available",
    "decode_kernel_fn",
    "fast_decode_attention",
    "first_compiler_error",
    "kernel_build_error",
    "load_cpu_kernels",
    "num_cpu_blocks",
    "num_gpu_blocks",
    "prefill_kernel_available",
    "set_cpu_decode_kernel",
    "set_fast_decode_attention",
]

#: One layer's (K, V), each [num_kv_heads, num_blocks, block_size, head_dim]. On CPU the
#: memory is block-major ([num_blocks, num_kv_heads, ...] transposed; ``VX_KV_LAYOUT=head``:
#: head-major, for A/B timing); every kernel takes the strides, rows of head_dim contiguous.
KVCache = tuple[torch.Tensor, torch.Tensor]


def block_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = BLOCK_SIZE,
) -> int:
    """Bytes one KV block takes across every layer (K and V), on one rank."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * block_size * itemsize


def num_cpu_blocks(kv_cache_memory_bytes: int, block_bytes: int) -> int:
    """CPU: as many whole blocks as the configured byte budget holds."""
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    return kv_cache_memory_bytes // block_bytes


def num_gpu_blocks(
    total_bytes: int,
    utilization: float,
    weight_bytes: int,
    activation_peak_bytes: int,
    block_bytes: int,
) -> int:
    """GPU: blocks that fit in `utilization` of the device after weights and activations.

    Worked example (the seeds'): Llama 3.1 8B on an 80 GB H100 at 0.92, 8,030,261,248 bf16
    parameters (16.06 GB) and no activation peak: (73.6e9 - 16.06e9) / 2 MiB = 27,436 blocks,
    439K tokens, at most 107 sequences of 4,096 tokens.
    Returns 0 (never negative) when nothing is left for the cache; the caller reports that.
    """
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    budget = math.floor(total_bytes * utilization) - weight_bytes - activation_peak_bytes
    return max(budget, 0) // block_bytes


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    block_size: int = BLOCK_SIZE,
) -> list[KVCache]:
    """Zero-filled K and V tensors for every layer.

    NOTE: zero-filled, not `empty`: attention reads whole blocks and masks the slots past a
    request's length, and a NaN left in uninitialised memory would survive the mask
    (0 * NaN is NaN in the probabilities-times-V product).
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if torch.device(device).type == "cpu" and envs.VX_KV_LAYOUT == "block":
        # Block-major in memory: a block's K (or V) rows for every head are one run of
        # Hkv * BS * D values, so the decode attention, which takes a request's heads one
        # after another, reads its blocks in runs of 6 KB (SmolLM2) instead of 2 KB
        # In 2 MiB pages (`vx.gpu.cpu.pages.advise_huge`, before the zeros fault them in): a
        # decode step reads a few KB from each of thousands of scattered blocks, one TLB miss
        # apiece in 4 KiB pages (measured at 64 rows x 192 keys over a 4 GiB pool on the AMX
        # host; docs/performance.md).
        def zeros() -> torch.Tensor:
            t = torch.empty(
                (num_blocks, num_kv_heads, block_size, head_dim), dtype=dtype, device=device
            )
            advise_huge(t)
            return t.zero_().transpose(0, 1)
    else:
        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
    caches = [(zeros(), zeros()) for _ in range(num_layers)]
    logger.debug("allocated %d layers of KV %s %s on %s", num_layers, shape, dtype, device)
    return caches


# ───────────────────────────── CPU kernels over the cache ─────────────────────────────

#: The C sources: vx_kernels.h, the kernel files, and vx_kernels.c, which includes them
#: (one translation unit); emulate/ holds the emulated build's <immintrin.h>.
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu", "csrc")
#: The files the compiler is given (tests add a broken one to see the compiler's error).
_KERNEL_SOURCES = [os.path.join(CSRC, "vx_kernels.c")]
# -fassociative-math (and what it needs) lets the dot products and sums vectorise.
CFLAGS = [
    "-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
    "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra",
]  # fmt: skip
_CFLAGS = CFLAGS

_kernel_state: dict[str, object] = {}
_fast_state: dict[str, bool] = {}


def set_cpu_decode_kernel(enabled: bool | None) -> None:
    """Force the C decode kernel on (if it builds) or off; None: the environment decides."""
    _kernel_state.clear()
    if enabled is not None:
        _kernel_state["forced"] = enabled


def cpu_decode_kernel_available() -> bool:
    """Whether decodes on CPU use the C kernel (built and loaded on first call)."""
    return load_cpu_kernels() is not None


def set_fast_decode_attention(enabled: bool | None) -> None:
    """Use the AVX512-BF16 decode kernel for bf16 caches (True), the portable one (False), or
    what ``VX_CPU_ATTENTION_KERNEL`` says (None): the fast kernel unless it is ``portable``.
    Its results differ from the portable kernel's in fp32 summation order only (bf16 outputs
    within one ulp); the bf16 agreement with HF holds with either."""
    _fast_state.clear()
    if enabled is not None:
        _fast_state["fast"] = enabled


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


def fast_decode_attention() -> bool:
    fast = _fast_state.get("fast")
    if fast is None:
        return envs.VX_CPU_ATTENTION_KERNEL != "portable"
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


def load_cpu_kernels() -> ctypes.CDLL | None:
    if "lib" in _kernel_state:
        return _kernel_state["lib"]  # type: ignore[return-value]
    enabled = _kernel_state.get("forced")
    if enabled is None:
        enabled = envs.VX_CPU_ATTENTION_KERNEL != "0"
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


def kernel_build_error() -> str | None:
    """Why `load_cpu_kernels` has no library (the compiler's first error, a missing compiler
    or symbol), or None: it loaded, was turned off, or was not asked for yet."""
    return _kernel_state.get("error")  # type: ignore[return-value]


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
    cc = shutil.which(envs.CC) or shutil.which("gcc")
    if cc is None:
        _kernel_state["error"] = "no C compiler found (cc or gcc on PATH, or $CC)"
        logger.warning("no C compiler found; the CPU path uses torch's kernels")
        return None
    with open("/proc/cpuinfo", "rb") as f:  # -march=native: one build per CPU model
        cpu = b"".join(line for line in f if line.startswith((b"flags", b"model name")))
    # VX_CPU_EMULATE=1 (tests): the AVX-512 BF16 and AMX kernels in software on any x86 CPU
    emulate = emulating()
    if emulate:
        cpu += " ".join(EMULATED_DEFINES).encode()
    flags = _build_flags()
    key = hashlib.sha256(_kernel_source_digest() + " ".join(flags).encode() + cpu)
    cache = os.path.join(
        envs.VX_CACHE,
        "kernels",
    )
    name = "decode_attention-emulated" if emulate else "decode_attention"
    if flags != _CFLAGS:
        name += "-" + envs.VX_CPU_SANITIZE
    path = os.path.join(cache, f"{name}-{key.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            so = os.path.join(tmp, "decode_attention.so")
            extra = emulation_flags(CSRC) if emulate else []
            proc = subprocess.run(
                [cc, *flags, *extra, "-I", CSRC, "-o", so, *_KERNEL_SOURCES],
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
        logger.info("built the CPU decode attention kernel: %s", path)
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
    """`_CFLAGS`, or with ``VX_CPU_SANITIZE=address`` (or another of the compiler's
    ``-fsanitize=`` values; `make check-c`) a sanitized build of the same code: -O1 for the
    sanitizer's speed, frame pointers and debug lines for its reports. A process that loads
    it needs the sanitizer's runtime first (``LD_PRELOAD``, as `make check-c` sets it)."""
    sanitize = envs.VX_CPU_SANITIZE
    if not sanitize:
        return _CFLAGS
    return [f for f in _CFLAGS if not f.startswith("-O")] + [
        "-O1", "-g", f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"
    ]


def _kernel_source_digest() -> bytes:
    """A digest of every C file the library is built from (each .c and .h under `CSRC`, the
    emulated <immintrin.h> included, and any extra file in `_KERNEL_SOURCES`), by path and
    content: any edit to one makes a new library."""
    files = set(_KERNEL_SOURCES)
    for root, _, names in os.walk(CSRC):
        files.update(os.path.join(root, n) for n in names if n.endswith((".c", ".h")))
    h = hashlib.sha256()
    for f in sorted(files):
        with open(f, "rb") as fh:
            h.update(os.path.relpath(f, CSRC).encode() + b"\0" + fh.read() + b"\0")
    return h.digest()
