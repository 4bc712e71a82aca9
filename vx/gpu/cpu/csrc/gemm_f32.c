/* The fp32 GEMM of `--batch-invariant` on fp32 models: y = x @ W.T + bias, fp32, with W laid
   out in panels of 16 output columns.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library;
   `vx.gpu.cpu.fp32_panels.Fp32Panels` calls it for every row count).

   Why it exists: torch's fp32 GEMM (oneDNN, MKL) picks its kernel and its blocking of k by the
   number of rows, so a row's sums depend on the rows beside it. Here each output is its row's
   fp32 sum over k in order (one FMA chain per output, from 0), plus the bias: the same bits
   for a row whatever M, the tile it lands in, or the thread that takes it.

   Layout: x [M, K] fp32 (row stride x_st); P the panels [N / 16, K, 16] (panel p, row k, column
   j: W[16 p + j][k]; `Fp32Panels` packs them), 32-byte aligned; bias [N] or NULL; y [M, N]
   (row stride y_st). N % 16 == 0, K >= 1, M >= 1. Parallel over (panel, block of rows) items
   with stealing (`vx_ws`), panel first, so a thread's consecutive items reuse one panel from
   L2. Built with AVX2 and FMA (every x86-64-v3 CPU and later); -2 elsewhere. */
#include "vx_kernels.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VX_F32_MR 6  /* rows a tile: 12 sums, 2 weight vectors and a broadcast in 16 ymm */
/* Rows x[0..MR) (row stride x_st) against panel w ([K][16]), plus bias (16 or NULL), to y. */
static inline __attribute__((always_inline)) void vx_f32_panel_tile(
        const float* x, int64_t x_st, int64_t K, const float* w, const int MR,
        const float* bias, float* y, int64_t y_st) {
    __m256 c[VX_F32_MR][2];
    for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 b0 = _mm256_load_ps(w + k * 16), b1 = _mm256_load_ps(w + k * 16 + 8);
        for (int i = 0; i < MR; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * x_st + k);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
    }
    if (bias) {
        const __m256 v0 = _mm256_loadu_ps(bias), v1 = _mm256_loadu_ps(bias + 8);
        for (int i = 0; i < MR; i++) {
            c[i][0] = _mm256_add_ps(c[i][0], v0);
            c[i][1] = _mm256_add_ps(c[i][1], v1);
        }
    }
    for (int i = 0; i < MR; i++) {
        _mm256_storeu_ps(y + i * y_st, c[i][0]);
        _mm256_storeu_ps(y + i * y_st + 8, c[i][1]);
    }
}
int vx_gemm_f32_panels(const float* x, int64_t x_st, int M, const float* P, const float* bias,
                       float* y, int64_t y_st, int64_t N, int64_t K) {
    if (M < 1 || K < 1 || N < 16 || N % 16) return -1;
    if (((uintptr_t)P & 31) != 0) return -1;  /* the panels' aligned loads */
    const int64_t panels = N / 16;
    int64_t mb = (49152 / K) / VX_F32_MR * VX_F32_MR;  /* rows an item: x's block in ~192 KB */
    if (mb < VX_F32_MR) mb = VX_F32_MR;
    const int64_t blocks = (M + mb - 1) / mb;
    const int par = (int64_t)M * N * K >= 1 << 20;
    vx_ws ws;
    vx_ws_init(&ws, blocks * panels, par);
    _Pragma("omp parallel if (par)")
    for (int64_t it; (it = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
        const int64_t p = it / blocks, b = it % blocks;
        const float* w = P + p * K * 16;
        const float* bp = bias ? bias + p * 16 : NULL;
        const int64_t r1 = (b + 1) * mb < M ? (b + 1) * mb : M;
        for (int64_t m0 = b * mb; m0 < r1; m0 += VX_F32_MR) {
            const float* xm = x + m0 * x_st;
            float* ym = y + m0 * y_st + p * 16;
            switch (r1 - m0 < VX_F32_MR ? (int)(r1 - m0) : VX_F32_MR) {
            case 1: vx_f32_panel_tile(xm, x_st, K, w, 1, bp, ym, y_st); break;
            case 2: vx_f32_panel_tile(xm, x_st, K, w, 2, bp, ym, y_st); break;
            case 3: vx_f32_panel_tile(xm, x_st, K, w, 3, bp, ym, y_st); break;
            case 4: vx_f32_panel_tile(xm, x_st, K, w, 4, bp, ym, y_st); break;
            case 5: vx_f32_panel_tile(xm, x_st, K, w, 5, bp, ym, y_st); break;
            default: vx_f32_panel_tile(xm, x_st, K, w, 6, bp, ym, y_st); break;
            }
        }
    }
    return 0;
}
int vx_has_gemm_f32_panels(void) { return 1; }
#else
int vx_gemm_f32_panels(const float* x, int64_t x_st, int M, const float* P, const float* bias,
                       float* y, int64_t y_st, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)P; (void)bias; (void)y; (void)y_st; (void)N; (void)K;
    return -2;
}
int vx_has_gemm_f32_panels(void) { return 0; }
#endif
