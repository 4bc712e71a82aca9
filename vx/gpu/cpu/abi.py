"""The C ABI of vx's CPU kernel library: every exported function's ctypes types, in one table.

Runs in: each Worker process (`vx.gpu.cpu.library` binds the table when it loads the library).

Invariants: `KERNEL_ABI` declares exactly the functions of ``vx/gpu/cpu/csrc/vx_kernels.h``, in the
same kinds (a C pointer is ``c_void_p``, ``int64_t`` ``c_int64``, ``int`` and ``int32_t``
``c_int``, ``float`` ``c_float``, ``void`` None); tests/gpu/cpu/test_abi.py parses the header
and holds the two together. A symbol in `OPTIONAL` exists only in some ISAs' builds, or is
used only where the library's ``vx_has_*`` query says its kernel exists: the loader binds it
where present and a build without it still loads. Any other missing symbol fails the load.
"""

from __future__ import annotations

import ctypes

__all__ = ["KERNEL_ABI", "OPTIONAL", "bind_kernels"]

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

#: q, q strides, out, out strides, K and V caches, cache strides, block table, its stride,
#: lengths, then B, Hq, Hkv, D, BS, scale, max_len, window (<= 0: none), softcap (<= 0: none).
_DECODE_ATTENTION = (_I32, [
    _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P,
    _I32, _I32, _I32, _I32, _I32, _F32, _I32, _I32, _F32,
])  # fmt: skip
#: x, x's row stride, M, weight, bias, y, y's row stride, N, K.
_GEMM = (_I32, [_P, _I64, _I32, _P, _P, _P, _I64, _I64, _I64])
#: x, x's row stride, M, weight, its scale, bias, y, y's row stride, N, K.
_GEMV_SCALED = (_I32, [_P, _I64, _I32, _P, _P, _P, _P, _I64, _I64, _I64])
#: A query of the library's build: no arguments, an int.
_QUERY = (_I32, [])

#: {symbol: (restype, argtypes)}, in the header's order.
KERNEL_ABI: dict[str, tuple[type | None, list[type]]] = {
    # parallel.c
    "vx_bind_threads": (_I32, [_P, _I32]),
    "vx_set_work_stealing": (None, [_I32]),
    # decode_attention.c
    "vx_decode_attention_f32": _DECODE_ATTENTION,
    "vx_decode_attention_bf16": _DECODE_ATTENTION,
    "vx_decode_attention_bf16_fast": _DECODE_ATTENTION,
    "vx_fast_amx": (_I32, [_I32]),
    "vx_has_fast_bf16": _QUERY,
    "vx_write_kv": (None, [
        _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _P,
        _I32, _I32, _I32, _I64,
    ]),  # fmt: skip
    # eltwise.c
    "vx_add_rms_norm_bf16": (None, [_P, _I64, _P, _P, _P, _P, _I64, _I64, _F32]),
    "vx_silu_and_mul_bf16": (None, [_P, _I64, _P, _I64, _I64]),
    "vx_silu_simd": _QUERY,
    "vx_rotary_bf16": (None, [_P, _I64, _I64, _I64, _I64, _P, _P]),
    "vx_rotary_part_bf16": (None, [_P, _I64, _I64, _I64, _I64, _I64, _P, _P]),
    "vx_gemma_rms_norm_bf16": (None, [_P, _I64, _P, _P, _P, _P, _I64, _I64, _F32]),
    "vx_head_rms_norm_bf16": (None, [_P, _I64, _I64, _I64, _I64, _P, _F32, _I32]),
    "vx_gelu_tanh_and_mul_bf16": (None, [_P, _I64, _P, _I64, _I64]),
    # moe.c
    "vx_moe_group_bf16": (_I32, [_P, _I64, _P, _I64, _I64, _I64, _I64, _P, _P, _P]),
    "vx_moe_combine_bf16": (None, [_P, _P, _P, _I32, _I64, _I64, _I64, _P]),
    "vx_moe_topk_bf16": (None, [_P, _I64, _I64, _I64, _I64, _I32, _I32, _P, _P]),
    # gemv.c
    "vx_has_gemv": _QUERY,
    "vx_gemv_bf16_max_rows": _QUERY,
    "vx_gemv_int8": _GEMV_SCALED,
    "vx_gemv_bf16": _GEMV_SCALED,
    "vx_gemm_amx_bf16": _GEMM,
    "vx_argmax_amx_bf16": (_I32, [_P, _I64, _I32, _P, _I64, _I64, _P]),
    # gemm_vnni.c
    "vx_has_gemm_vnni": _QUERY,
    "vx_pack_vnni_bf16": (_I32, [_P, _I64, _I64, _P]),
    "vx_gemm_vnni_bf16": _GEMM,
    "vx_argmax_vnni_bf16": (_I32, [_P, _I64, _I32, _P, _I64, _I64, _P]),
    "vx_vnni_small_loop": (_I32, [_I32]),
    # gemm_amx_vnni.c
    "vx_has_gemm_amx_vnni": _QUERY,
    "vx_amx_vnni_rows": (_I32, [_I32]),
    "vx_gemm_amx_vnni": _GEMM,
    "vx_gemm_amx_vnni_silu": _GEMM,
    "vx_gemm_amx_vnni_rope": (_I32, [*_GEMM[1], _P, _P, _I64, _I32]),
    # experts_amx.c
    "vx_moe_experts_amx": (_I32, [_P, _P, _I64, _P, _P, _I64, _I64, _P, _P]),
    # experts_vnni.c
    "vx_moe_experts_vnni": (_I32, [_P, _P, _I64, _P, _P, _I64, _I64, _P, _P, _P]),
    # gemv_avx2.c
    "vx_gemv_avx2_max_rows": _QUERY,
    "vx_gemv_bf16_avx2": _GEMM,
    "vx_gemv_int8_avx2": _GEMV_SCALED,
    "vx_gemv_int4_avx2": (_I32, [_P, _I64, _I32, _P, _P, _P, _P, _P, _I64, _I64, _I64]),
    # gemv_compact_avx2.c
    "vx_compact_max_rows": _QUERY,
    "vx_gemv_compact_avx2": (_I32, [_P, _I64, _I32, _P, _P, _P, _P, _P, _I64, _I64, _I64]),
    # gemm_avx2.c
    "vx_has_gemm_panels_avx2": _QUERY,
    "vx_panel_small_loop": (_I32, [_I32]),
    "vx_gemm_panels_avx2": _GEMM,
    # gemm_f32.c
    "vx_has_gemm_f32_panels": _QUERY,
    "vx_gemm_f32_panels": _GEMM,
    # screen.c
    "vx_has_screen": _QUERY,
    "vx_screen_i8": (_I32, [_P, _I64, _I32, _P, _P, _P, _I64, _I64]),
    "vx_screen_i8_avx2": (_I32, [_P, _I64, _I32, _P, _P, _P, _I64, _I64]),
    "vx_screen_select": (_I64, [_P, _I32, _I64, _P, _P, _I64, _I64, _P, _P, _I64]),
    # decode_attention_avx2.c
    "vx_has_avx2_attention": _QUERY,
    "vx_decode_attention_bf16_avx2": _DECODE_ATTENTION,
    # prefill_*.c
    "vx_has_prefill_attention": _QUERY,
    "vx_prefill_attention_bf16": (_I32, [
        _P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _P, _P,
        _I32, _I32, _I32, _I32, _I32, _F32, _I32, _F32,
    ]),  # fmt: skip
    # decode_step.c, split_step.c, greedy_step.c
    "vx_has_decode_step": _QUERY,
    "vx_llama_decode_bf16": (_I32, [_P, _I32, _P]),
    "vx_llama_decode_split": (_I32, [_P, _I32, _P, _I32, _P]),
    "vx_llama_greedy_whole": (_I32, [_P, _I32, _P, _P, _P]),
    "vx_split_cut": (None, [_P, _I64, _I32, _P]),
    "vx_split_set_speeds": (None, [_P, _I32]),
    "vx_set_split_adapt": (None, [_I32]),
    "vx_set_split_steal": (None, [_I32]),
    "vx_split_handovers": _QUERY,
}

#: Symbols a build may lack: the AVX-512 skinny GEMMs and AMX GEMM (`vx_has_gemv`), the
#: AVX512-BF16 decode attention and its AMX switch (`vx_has_fast_bf16`), the AVX2 one
#: (`vx_has_avx2_attention`), and the fused step's (`vx_has_decode_step`).
OPTIONAL = frozenset({
    "vx_gemv_int8", "vx_gemv_bf16", "vx_gemm_amx_bf16", "vx_argmax_amx_bf16",
    "vx_decode_attention_bf16_fast", "vx_fast_amx", "vx_decode_attention_bf16_avx2",
    "vx_llama_decode_bf16", "vx_llama_decode_split", "vx_llama_greedy_whole", "vx_split_cut",
    "vx_split_set_speeds", "vx_set_split_adapt", "vx_set_split_steal", "vx_split_handovers",
})  # fmt: skip


def bind_kernels(lib: ctypes.CDLL) -> None:
    """Sets every `KERNEL_ABI` function's restype and argtypes on `lib`. Raises AttributeError
    for a missing symbol outside `OPTIONAL` (a library that does not match this table)."""
    for name, (restype, argtypes) in KERNEL_ABI.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name in OPTIONAL:
                continue
            raise
        fn.restype, fn.argtypes = restype, argtypes
