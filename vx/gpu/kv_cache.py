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
decode attention `vx.gpu.attention` uses: for bf16 an AVX512-BF16 kernel, with AMX for q.k
where the CPU has it, by default; `VX_CPU_ATTENTION_KERNEL=portable` picks the portable one;
source in `vx.gpu.cpu_kernel_source`), compiled once per machine with the system C compiler
into ``$VX_CACHE/kernels`` (default ``~/.cache/vx/kernels``) and loaded with ctypes; without a
compiler, or with ``VX_CPU_ATTENTION_KERNEL=0``, callers fall back to torch ops.
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

from vx.config import BLOCK_SIZE
from vx.gpu.cpu_attention_avx2_source import ATTENTION_AVX2_SOURCE
from vx.gpu.cpu_compact_source import COMPACT_AVX2_SOURCE
from vx.gpu.cpu_decode_source import DECODE_STEP_SOURCE
from vx.gpu.cpu_eltwise_source import ELTWISE_SOURCE
from vx.gpu.cpu_emulate import (
    EMULATED_DEFINES,
    EMULATED_IMMINTRIN,
    emulating,
    emulation_flags,
)
from vx.gpu.cpu_gemm_amx_vnni_source import GEMM_AMX_VNNI_SOURCE
from vx.gpu.cpu_gemm_avx2_source import GEMM_AVX2_SOURCE
from vx.gpu.cpu_gemm_vnni_source import GEMM_VNNI_SOURCE
from vx.gpu.cpu_gemv_avx2_source import GEMV_AVX2_SOURCE
from vx.gpu.cpu_gemv_source import GEMV_KERNEL_SOURCE
from vx.gpu.cpu_greedy_source import GREEDY_STEP_SOURCE
from vx.gpu.cpu_kernel_source import CFLAGS, DECODE_KERNEL_SOURCE
from vx.gpu.cpu_pages import advise_huge
from vx.gpu.cpu_parallel_source import PARALLEL_SOURCE
from vx.gpu.cpu_prefill_avx2_source import PREFILL_AVX2_SOURCE
from vx.gpu.cpu_prefill_avx512_source import PREFILL_AVX512_SOURCE
from vx.gpu.cpu_prefill_source import PREFILL_ATTENTION_SOURCE, PREFILL_DISPATCH_SOURCE
from vx.gpu.cpu_screen_source import SCREEN_SOURCE
from vx.gpu.cpu_split_source import SPLIT_STEP_SOURCE

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
    if torch.device(device).type == "cpu" and os.environ.get("VX_KV_LAYOUT", "block") == "block":
        # Block-major in memory: a block's K (or V) rows for every head are one run of
        # Hkv * BS * D values, so the decode attention, which takes a request's heads one
        # after another, reads its blocks in runs of 6 KB (SmolLM2) instead of 2 KB
        # In 2 MiB pages (`vx.gpu.cpu_pages.advise_huge`, before the zeros fault them in): a
        # decode step reads a few KB from each of thousands of scattered blocks, one TLB miss
        # apiece in 4 KiB pages (64 rows x 192 keys over a 4 GiB pool, AMX host: the decode
        # attention 15.2-15.3 against 17.4-17.7 ms a step).
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

_DECODE_KERNEL_SOURCE = (
    PARALLEL_SOURCE
    + DECODE_KERNEL_SOURCE
    + ELTWISE_SOURCE
    + GEMV_KERNEL_SOURCE
    + GEMM_VNNI_SOURCE
    + GEMM_AMX_VNNI_SOURCE
    + GEMV_AVX2_SOURCE
    + COMPACT_AVX2_SOURCE
    + GEMM_AVX2_SOURCE
    + SCREEN_SOURCE
    + ATTENTION_AVX2_SOURCE
    + PREFILL_AVX2_SOURCE
    + PREFILL_ATTENTION_SOURCE
    + PREFILL_AVX512_SOURCE
    + PREFILL_DISPATCH_SOURCE
    + DECODE_STEP_SOURCE
    + SPLIT_STEP_SOURCE
    + GREEDY_STEP_SOURCE
)
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
    `vx.gpu.cpu_parallel_source`): 1, the default, each thread its own static range, then the
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
        return os.environ.get("VX_CPU_ATTENTION_KERNEL", "fast") != "portable"
    return fast


def prefill_kernel_available() -> bool:
    """Whether bf16 prefill chunks on CPU use the C kernel (with AMX, on AVX512-BF16 without it,
    or the AVX2 one on AVX2 CPUs without AVX-512); ``VX_CPU_PREFILL_ATTENTION=sdpa`` keeps torch's SDPA for them,
    as does ``VX_CPU_ATTENTION_KERNEL=portable``."""
    if os.environ.get("VX_CPU_PREFILL_ATTENTION", "kernel") == "sdpa":
        return False
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
        enabled = os.environ.get("VX_CPU_ATTENTION_KERNEL", "1") != "0"
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
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        _kernel_state["error"] = "no C compiler found (cc or gcc on PATH, or $CC)"
        logger.warning("no C compiler found; the CPU path uses torch's kernels")
        return None
    with open("/proc/cpuinfo", "rb") as f:  # -march=native: one build per CPU model
        cpu = b"".join(line for line in f if line.startswith((b"flags", b"model name")))
    # VX_CPU_EMULATE=1 (tests): the AVX-512 BF16 and AMX kernels in software on any x86 CPU
    emulate = emulating()
    if emulate:
        cpu += EMULATED_IMMINTRIN.encode() + " ".join(EMULATED_DEFINES).encode()
    key = hashlib.sha256(_DECODE_KERNEL_SOURCE.encode() + " ".join(_CFLAGS).encode() + cpu)
    cache = os.path.join(
        os.environ.get("VX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vx"),
        "kernels",
    )
    name = "decode_attention-emulated" if emulate else "decode_attention"
    path = os.path.join(cache, f"{name}-{key.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = os.path.join(tmp, "decode_attention.c")
            with open(src, "w") as f:
                f.write(_DECODE_KERNEL_SOURCE)
            so = os.path.join(tmp, "decode_attention.so")
            extra = emulation_flags(tmp) if emulate else []
            proc = subprocess.run(
                [cc, *_CFLAGS, *extra, "-o", so, src], capture_output=True, text=True, timeout=300
            )
            if proc.returncode != 0:
                raise KernelBuildError(
                    f"{os.path.basename(cc)} exited with {proc.returncode}: "
                    f"{first_compiler_error(proc.stderr)}"
                )
            os.replace(so, path)  # atomic: concurrent builders each publish a whole file
        logger.info("built the CPU decode attention kernel: %s", path)
    lib = ctypes.CDLL(path)
    i64, i32 = ctypes.c_int64, ctypes.c_int
    ptr = ctypes.c_void_p
    fns = [lib.vx_decode_attention_f32, lib.vx_decode_attention_bf16]
    lib.vx_has_avx2_attention.restype = ctypes.c_int
    if lib.vx_has_avx2_attention():
        fns.append(lib.vx_decode_attention_bf16_avx2)
    lib.vx_has_fast_bf16.restype = ctypes.c_int
    if lib.vx_has_fast_bf16():
        fns.append(lib.vx_decode_attention_bf16_fast)
        lib.vx_fast_amx.restype, lib.vx_fast_amx.argtypes = ctypes.c_int, [ctypes.c_int]
        # AMX tiles for q.k in the fast kernel where the CPU has them (VX_CPU_ATTENTION_AMX=0: off)
        if os.environ.get("VX_CPU_ATTENTION_AMX", "1") != "0" and lib.vx_fast_amx(1):
            logger.info("the fast CPU decode attention kernel uses AMX for q.k")
    for fn in fns:
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr,
            i32, i32, i32, i32, i32, ctypes.c_float, i32,
        ]  # fmt: skip
    lib.vx_has_gemv.restype = ctypes.c_int
    lib.vx_gemv_bf16_max_rows.restype = ctypes.c_int
    if lib.vx_has_gemv():
        for fn in (lib.vx_gemv_int8, lib.vx_gemv_bf16):
            fn.restype = ctypes.c_int
            fn.argtypes = [ptr, i64, i32, ptr, ptr, ptr, ptr, i64, i64, i64]
        lib.vx_gemm_amx_bf16.restype = ctypes.c_int
        lib.vx_gemm_amx_bf16.argtypes = [ptr, i64, i32, ptr, ptr, ptr, i64, i64, i64]
        lib.vx_argmax_amx_bf16.restype = ctypes.c_int
        lib.vx_argmax_amx_bf16.argtypes = [ptr, i64, i32, ptr, i64, i64, ptr]
    lib.vx_has_gemm_vnni.restype = ctypes.c_int
    lib.vx_pack_vnni_bf16.restype = ctypes.c_int
    lib.vx_pack_vnni_bf16.argtypes = [ptr, i64, i64, ptr]
    lib.vx_gemm_vnni_bf16.restype = ctypes.c_int
    lib.vx_gemm_vnni_bf16.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64]
    for fn in (lib.vx_gemm_amx_vnni, lib.vx_gemm_amx_vnni_silu):
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64]
    lib.vx_gemm_amx_vnni_rope.restype = ctypes.c_int
    lib.vx_gemm_amx_vnni_rope.argtypes = [
        ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, ctypes.c_int,
    ]  # fmt: skip
    lib.vx_has_gemm_amx_vnni.restype = ctypes.c_int
    lib.vx_amx_vnni_rows.restype = ctypes.c_int
    lib.vx_amx_vnni_rows.argtypes = [ctypes.c_int]
    lib.vx_argmax_vnni_bf16.restype = ctypes.c_int
    lib.vx_argmax_vnni_bf16.argtypes = [ptr, i64, ctypes.c_int, ptr, i64, i64, ptr]
    lib.vx_has_decode_step.restype = ctypes.c_int
    if lib.vx_has_decode_step():
        lib.vx_llama_decode_bf16.restype = ctypes.c_int
        lib.vx_llama_decode_bf16.argtypes = [ptr, i32, ptr]
        lib.vx_llama_decode_split.restype = ctypes.c_int
        lib.vx_llama_decode_split.argtypes = [ptr, i32, ptr, i32, ptr]
        lib.vx_llama_greedy_whole.restype = ctypes.c_int
        lib.vx_llama_greedy_whole.argtypes = [ptr, i32, ptr, ptr, ptr]
        lib.vx_split_cut.restype = None
        lib.vx_split_cut.argtypes = [ptr, i64, i32, ptr]
        lib.vx_split_set_speeds.restype = None
        lib.vx_split_set_speeds.argtypes = [ptr, i32]
        lib.vx_set_split_adapt.restype = None
        lib.vx_set_split_adapt.argtypes = [i32]
        lib.vx_set_split_steal.restype = None
        lib.vx_set_split_steal.argtypes = [i32]
        lib.vx_split_handovers.restype = ctypes.c_int
    lib.vx_gemv_avx2_max_rows.restype = ctypes.c_int
    lib.vx_has_gemm_panels_avx2.restype = ctypes.c_int
    lib.vx_gemm_panels_avx2.restype = ctypes.c_int
    lib.vx_gemm_panels_avx2.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64]
    lib.vx_gemv_bf16_avx2.restype = ctypes.c_int
    lib.vx_compact_max_rows.restype = ctypes.c_int
    lib.vx_gemv_compact_avx2.restype = ctypes.c_int
    lib.vx_gemv_compact_avx2.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.vx_gemv_bf16_avx2.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64, i64]
    lib.vx_gemv_int8_avx2.restype = ctypes.c_int
    lib.vx_gemv_int8_avx2.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64]
    lib.vx_gemv_int4_avx2.restype = ctypes.c_int
    lib.vx_gemv_int4_avx2.argtypes = [
        ptr, i64, ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, i64, i64
    ]
    lib.vx_screen_i8_avx2.restype = ctypes.c_int
    lib.vx_screen_i8_avx2.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64]
    lib.vx_screen_select.restype = i64
    lib.vx_screen_select.argtypes = [ptr, ctypes.c_int, i64, ptr, ptr, i64, i64, ptr, ptr, i64]
    lib.vx_screen_i8.restype = ctypes.c_int
    lib.vx_screen_i8.argtypes = [ptr, i64, ctypes.c_int, ptr, ptr, ptr, i64, i64]
    lib.vx_has_screen.restype = ctypes.c_int
    # The element-wise kernels are built for every CPU (portable C).
    lib.vx_add_rms_norm_bf16.restype = None
    lib.vx_add_rms_norm_bf16.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
    lib.vx_silu_and_mul_bf16.restype = None
    lib.vx_silu_and_mul_bf16.argtypes = [ptr, i64, ptr, i64, i64]
    lib.vx_silu_simd.restype = ctypes.c_int
    lib.vx_rotary_bf16.restype = None
    lib.vx_rotary_bf16.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
    lib.vx_prefill_attention_bf16.restype = ctypes.c_int
    lib.vx_prefill_attention_bf16.argtypes = [
        ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr,
        i32, i32, i32, i32, i32, ctypes.c_float,
    ]  # fmt: skip
    lib.vx_has_prefill_attention.restype = ctypes.c_int
    lib.vx_bind_threads.restype = ctypes.c_int
    lib.vx_bind_threads.argtypes = [ptr, ctypes.c_int]
    lib.vx_set_work_stealing.restype = None
    lib.vx_set_work_stealing.argtypes = [ctypes.c_int]
    if os.environ.get("VX_CPU_WORK_STEALING", "1") == "0":  # served A/B timing
        lib.vx_set_work_stealing(0)
    lib.vx_write_kv.restype = None
    lib.vx_write_kv.argtypes = [
        ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, ptr, i32, i32, i32, i64,
    ]  # fmt: skip
    return lib
