/* The fp32 GEMM for CPUs with AVX2 and no AVX-512, past the skinny GEMM's rows:
   y = x @ W.T + bias for bf16 rows x and bf16 W laid out in panels of 16 output columns, widened
   to fp32 in registers.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library;
   `vx.gpu.cpu.widen.WideWeight` calls it for decode batches from 5 rows, prompts, and every
   row count of a weight without a compact copy, the LM head's logits among them: 1-4 rows in
   its small-row loop; the screen's candidates, packed in a panel, `vx_screen_argmax`).

   Why it exists: on AVX2 machines the bf16 model's GEMMs run in fp32 (bf16 x bf16 products are
   exact there; `vx.gpu.cpu.widen`). From 25 to 2,048 rows on a 2-core Zen 3, this kernel with
   fp32 panels and 6-row tiles was measured ahead of oneDNN's packed fp32 GEMM. The panel
   layout makes the inner loop the classic outer product: per k, 16 weights and 5 broadcasts of x
   feed 10 FMAs, with the 5 x 16 sums in registers, so the FMA units, not the loads, bound it. The
   weights stay bf16, in pairs of k in one 32-bit word: a bf16 value is the top half of its fp32
   value, so k even is the word shifted left by 16 and k odd the word masked, two integer
   operations per 10 FMAs. The sums are those of an fp32 copy (bit for bit) from half its bytes.
   Five rows, not six: with the mask, six rows' 12 sums left no register free and GCC spilled one
   sum to the stack, a store-to-load chain in the inner loop. Against the fp32 panels with
   6-row tiles (SmolLM2's 120 layer matrices, alternated in one process): ahead from 10 to 64
   rows, level from 256 to 2,048.

   Layout: x [M, K] bf16 (row stride x_st); P the panels, 32-bit words [N / 16, K / 2, 16]: word
   P[p][i][j] holds W[16 p + j][2 i] in its low half and W[16 p + j][2 i + 1] in its high half
   (`vx.gpu.cpu.widen.pack_panels`); bias [N] bf16 or NULL; y [M, N] bf16 (row stride y_st).
   N % 16 == 0, K even, M >= 1. Each output is its row's fp32 sum over k in order (one FMA chain
   per output), plus the bias, rounded to bf16 once: a row's outputs do not depend on the other
   rows. Parallel over (panel, block of rows) items with stealing (`vx_ws`), panel first, so a
   thread's consecutive items reuse one panel from L2 (its K x 16 bf16 values) while x's rows
   stream by; a block is as many rows (a multiple of 5) as fit ~192 KB of x. */
#include "vx_kernels.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
/* st_bf16 on 8 lanes: vx_round8_bf16's rounding, NaNs quieted as st_bf16 quiets them. */
static inline void vx_avx2_st8_bf16(vx_bf16* p, __m256 v) {
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    const __m256i hi = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32((int)0xffff0000u));
    const __m256 q = _mm256_castsi256_ps(_mm256_or_si256(hi, _mm256_set1_epi32(0x400000)));
    vx_st8_bf16(p, _mm256_blendv_ps(vx_round8_bf16(v), q, nan));
}
/* Rows x[0..MR) (fp32, row stride K) against panel w ([K / 2][16] words, each two bf16: k even
   in its low half, k + 1 in its high half), plus the panel's bias (its 16 values or NULL),
   rounded into y's rows (stride y_st). A bf16 value is the high half of its fp32 value, so
   widening is a shift (k even) or a mask (k odd), and the sums are the fp32 panels' bits. */
static inline __attribute__((always_inline)) void vx_avx2_panel_tile(
        const float* x, int64_t K, const uint32_t* w, const int MR, const vx_bf16* bias,
        vx_bf16* y, int64_t y_st) {
    __m256 c[5][2];
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < MR; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        const __m256i* wk = (const __m256i*)(w + k * 8);
        __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_load_si256(wk), 16));
        __m256 b1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_load_si256(wk + 1), 16));
        for (int i = 0; i < MR; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * K + k);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
        b0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_load_si256(wk), hi));
        b1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_load_si256(wk + 1), hi));
        for (int i = 0; i < MR; i++) {
            const __m256 a = _mm256_broadcast_ss(x + i * K + k + 1);
            c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
        }
    }
    if (bias) {
        const __m256 v0 = vx_ld8_bf16(bias), v1 = vx_ld8_bf16(bias + 8);
        for (int i = 0; i < MR; i++) {
            c[i][0] = _mm256_add_ps(c[i][0], v0);
            c[i][1] = _mm256_add_ps(c[i][1], v1);
        }
    }
    for (int i = 0; i < MR; i++) {
        vx_avx2_st8_bf16(y + i * y_st, c[i][0]);
        vx_avx2_st8_bf16(y + i * y_st + 8, c[i][1]);
    }
}
/* The panel tile for few rows: G panels at once (contiguous from w, [G][K / 2][16] words),
   MR rows, each output's sums exactly as vx_avx2_panel_tile forms them (one FMA chain over k
   in order), but G panels' chains interleaved, so that at one row the FMA latency does not
   bound the stream, and each panel's words prefetched VX_PANEL_PFD bytes ahead (past its end:
   the next panel's, for the last one the next item's). */
#define VX_PANEL_PFD 1024
static int vx_panel_small_on = 1;
static inline __attribute__((always_inline)) void vx_avx2_panel_small(
        const float* x, int64_t K, const uint32_t* w, const int MR, const int G,
        const vx_bf16* bias, vx_bf16* y, int64_t y_st) {
    __m256 c[4][4][2];
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int i = 0; i < MR; i++)
        for (int g = 0; g < G; g++) c[i][g][0] = c[i][g][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        for (int g = 0; g < G; g++) {
            const __m256i* wk = (const __m256i*)(w + g * K * 8 + k * 8);
            _mm_prefetch((const char*)wk + VX_PANEL_PFD, _MM_HINT_T0);
            const __m256i u0 = _mm256_load_si256(wk), u1 = _mm256_load_si256(wk + 1);
            __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(u0, 16));
            __m256 b1 = _mm256_castsi256_ps(_mm256_slli_epi32(u1, 16));
            for (int i = 0; i < MR; i++) {
                const __m256 a = _mm256_broadcast_ss(x + i * K + k);
                c[i][g][0] = _mm256_fmadd_ps(a, b0, c[i][g][0]);
                c[i][g][1] = _mm256_fmadd_ps(a, b1, c[i][g][1]);
            }
            b0 = _mm256_castsi256_ps(_mm256_and_si256(u0, hi));
            b1 = _mm256_castsi256_ps(_mm256_and_si256(u1, hi));
            for (int i = 0; i < MR; i++) {
                const __m256 a = _mm256_broadcast_ss(x + i * K + k + 1);
                c[i][g][0] = _mm256_fmadd_ps(a, b0, c[i][g][0]);
                c[i][g][1] = _mm256_fmadd_ps(a, b1, c[i][g][1]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        if (bias) {
            const __m256 v0 = vx_ld8_bf16(bias + 16 * g), v1 = vx_ld8_bf16(bias + 16 * g + 8);
            for (int i = 0; i < MR; i++) {
                c[i][g][0] = _mm256_add_ps(c[i][g][0], v0);
                c[i][g][1] = _mm256_add_ps(c[i][g][1], v1);
            }
        }
        for (int i = 0; i < MR; i++) {
            vx_avx2_st8_bf16(y + i * y_st + 16 * g, c[i][g][0]);
            vx_avx2_st8_bf16(y + i * y_st + 16 * g + 8, c[i][g][1]);
        }
    }
}
#define VX_PANEL_SMALL_ROWS 4
/* 1 to VX_PANEL_SMALL_ROWS rows of xf: items of a few panels (4 at one row, 2 at two, 1 at
   three and four), shared with stealing; the same bits as the general loop's tiles. */
static void vx_avx2_panels_small(const float* xf, int M, const uint32_t* P, const vx_bf16* bias,
                                 vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    const int64_t panels = N / 16;
    const int G = M == 1 ? 4 : M == 2 ? 2 : 1;
    const int64_t items = (panels + G - 1) / G;
    const int par = N * K >= 262144;
    vx_ws ws;
    vx_ws_init(&ws, items, par);
    _Pragma("omp parallel if (par)")
    for (int64_t it; (it = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
        const int64_t p0 = it * G, np = panels - p0 < G ? panels - p0 : G;
        for (int64_t p = p0; p < p0 + np; p += (np == G ? G : 1)) {
            const uint32_t* w = P + p * K * 8;
            const vx_bf16* bp = bias ? bias + p * 16 : NULL;
            vx_bf16* yp = y + p * 16;
            if (np == G && G == 4) vx_avx2_panel_small(xf, K, w, 1, 4, bp, yp, y_st);
            else if (np == G && G == 2) vx_avx2_panel_small(xf, K, w, 2, 2, bp, yp, y_st);
            else switch (M) {
            case 1: vx_avx2_panel_small(xf, K, w, 1, 1, bp, yp, y_st); break;
            case 2: vx_avx2_panel_small(xf, K, w, 2, 1, bp, yp, y_st); break;
            case 3: vx_avx2_panel_small(xf, K, w, 3, 1, bp, yp, y_st); break;
            default: vx_avx2_panel_small(xf, K, w, 4, 1, bp, yp, y_st); break;
            }
        }
    }
}
int vx_gemm_panels_avx2(const vx_bf16* x, int64_t x_st, int M, const uint32_t* P,
                        const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    if (M < 1 || K < 2 || K % 2 || N < 16 || N % 16) return -1;
    if (((uintptr_t)P & 31) != 0) return -1;  /* the panels' aligned loads */
    float* xf = (float*)malloc(sizeof(float) * (size_t)M * (size_t)K);
    if (!xf) return -3;
    if (M <= VX_PANEL_SMALL_ROWS && vx_panel_small_on) {
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++) xf[r * K + k] = ld_bf16(x[r * x_st + k]);
        vx_avx2_panels_small(xf, M, P, bias, y, y_st, N, K);
        free(xf);
        return 0;
    }
    const int64_t panels = N / 16;
    int64_t mb = (49152 / K) / 5 * 5;  /* rows an item: x's block within ~192 KB */
    if (mb < 5) mb = 5;
    const int64_t blocks = (M + mb - 1) / mb;
    const int par = (int64_t)M * N * K >= 1 << 20;
    vx_ws ws;
    vx_ws_init(&ws, blocks * panels, par);
    _Pragma("omp parallel if (par)") {
        _Pragma("omp for schedule(static)")
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++) xf[r * K + k] = ld_bf16(x[r * x_st + k]);
        /* the omp for's barrier: every row is widened before any tile reads it */
        for (int64_t it; (it = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
            /* panel-major: a thread's consecutive items share a panel, which stays in L2 */
            const int64_t p = it / blocks, b = it % blocks;
            const uint32_t* w = P + p * K * 8;
            const vx_bf16* bp = bias ? bias + p * 16 : NULL;
            const int64_t r1 = (b + 1) * mb < M ? (b + 1) * mb : M;
            for (int64_t m0 = b * mb; m0 < r1; m0 += 5) {
                const float* xm = xf + m0 * K;
                vx_bf16* ym = y + m0 * y_st + p * 16;
                switch (r1 - m0 < 5 ? (int)(r1 - m0) : 5) {
                case 1: vx_avx2_panel_tile(xm, K, w, 1, bp, ym, y_st); break;
                case 2: vx_avx2_panel_tile(xm, K, w, 2, bp, ym, y_st); break;
                case 3: vx_avx2_panel_tile(xm, K, w, 3, bp, ym, y_st); break;
                case 4: vx_avx2_panel_tile(xm, K, w, 4, bp, ym, y_st); break;
                default: vx_avx2_panel_tile(xm, K, w, 5, bp, ym, y_st); break;
                }
            }
        }
    }
    free(xf);
    return 0;
}
int vx_has_gemm_panels_avx2(void) { return 1; }
/* Whether 1-4 rows take the small-row loop (on: 1, off: 0, -1 only asks); tests and A/B runs. */
int vx_panel_small_loop(int on) {
    if (on >= 0) vx_panel_small_on = on;
    return vx_panel_small_on;
}
#else
int vx_gemm_panels_avx2(const vx_bf16* x, int64_t x_st, int M, const uint32_t* P,
                        const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)P; (void)bias; (void)y; (void)y_st; (void)N; (void)K;
    return -2;
}
int vx_has_gemm_panels_avx2(void) { return 0; }
int vx_panel_small_loop(int on) { (void)on; return 0; }
#endif
