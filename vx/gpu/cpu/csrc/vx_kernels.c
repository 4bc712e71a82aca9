/* vx's CPU kernel library as one translation unit: `vx.gpu.cpu.library` compiles this file alone.

   Invariant: the order below is the dependency order. Besides vx_kernels.h, a file may use
   the static helpers and macros of the files above it (the work sharing `vx_ws` of
   parallel.c; the bf16 loads and the AMX switches of decode_attention.c; the skinny GEMMs'
   row kernels of gemv.c and gemv_avx2.c in the GEMMs, the screen and the fused step; the
   decode step's `vx_step` for the split and greedy steps), so they are compiled together, in
   this order, and never one by one. One unit also keeps the code the compiler generates the
   same as when the sources were one string (the kernels' results are bit-for-bit the same). */
#include "parallel.c"
#include "decode_attention.c"
#include "eltwise.c"
#include "moe.c"
#include "gemv.c"
#include "gemm_vnni.c"
#include "experts_vnni.c"
#include "gemm_amx_vnni.c"
#include "experts_amx.c"
#include "gemv_avx2.c"
#include "gemm_avx2.c"
#include "gemv_compact_avx2.c"
#include "gemm_f32.c"
#include "screen.c"
#include "decode_attention_avx2.c"
#include "prefill_avx2.c"
#include "prefill_amx.c"
#include "prefill_avx512.c"
#include "prefill_dispatch.c"
#include "decode_step.c"
#include "split_step.c"
#include "greedy_step.c"
