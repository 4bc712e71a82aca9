/* The skinny bf16 GEMM for CPUs with AVX2 and no AVX-512 (most laptops,
   AMD EPYC before Zen 4): y = x @ W.T + bias for 1-24 rows of x, W bf16 or (`--quantization int8`)
   int8 with per-row scales; and the LM head's int8 screen.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library;
   `vx.gpu.cpu.widen.WideWeight` calls it for the rows its wide copy is not worth).

   Why it exists: at one to a few rows a decode step only streams the weights. torch's bf16 GEMV
   reads them well below two AVX2 cores' read rate and the fp32 copy doubles the bytes; this kernel
   reads the bf16 weight once, widening each 8 values with a shift, with the next rows
   prefetched (the matrices are too short for the hardware prefetcher to ramp up). Past 3 rows
   each group of 4 weight rows is read from memory once and from L1 for the other rows of x, so
   it stays ahead of the fp32 copy (oneDNN's packed fp32 GEMM) up to ~24 rows (measured on
   SmolLM2's 120 linears, weights cold, 2-core AMD EPYC; at 32 rows the fp32 copy is ahead),
   hence VX_AVX2_MAX_ROWS.

   Layout: x [M, K] bf16 (row stride x_st), W [N, K] bf16 row-major, bias [N] bf16 or NULL, y
   [M, N] bf16 (row stride y_st); 1 <= M <= VX_AVX2_MAX_ROWS, K % 8 == 0, K <= VX_AVX2_MAX_K.
   fp32 products and sums, one bf16 rounding at the end (the sums' order differs from torch's).
   Parallel over blocks of 4 output rows, shared with stealing (`vx_ws`).

   Beside it, for the LM head's exact greedy search (`vx.gpu.cpu.screen`): `vx_screen_i8_avx2`,
   the same tiles over an int8 copy of W with per-row scales (fp32 out); `vx_screen_select`
   (screen.c) picks the rows it cannot rule out. */
#include "vx_kernels.h"
#define VX_AVX2_MAX_ROWS 24
#define VX_AVX2_MT 3  /* rows of x per tile: 3 x 4 accumulators, 4 weight vectors, x */
#define VX_AVX2_MAX_K 16384
#define VX_AVX2_PDG 2  /* the group of 4 rows this many groups ahead is prefetched */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
static inline __m256 vx_w8_bf16(const vx_bf16* p) {  /* 8 bf16 -> 8 fp32, exact */
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline float vx_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline __m256 vx_w8_i8(const int8_t* p) {  /* 8 int8 -> 8 fp32, exact */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
/* Rows n0..n0+3 of W (weights of type WT, widened 8 at a time by LOAD; PFB bytes of a later
   group prefetched per 8 columns) against the M rows of xf (fp32, [M, K]): out[m * 4 + r]. */
#define VX_AVX2_TILE(NAME, MM, WT, LOAD, PFB) \
static void NAME##_##MM(const float* xf, const WT* W, int64_t K, int64_t n0, int64_t nr, \
                        float* out) { \
    __m256 acc[MM][4]; \
    for (int m = 0; m < MM; m++) \
        for (int r = 0; r < 4; r++) acc[m][r] = _mm256_setzero_ps(); \
    const WT* w[4]; \
    for (int r = 0; r < 4; r++) w[r] = W + (n0 + (r < nr ? r : 0)) * K; \
    /* PFB bytes of a later group per 8 columns: its 4 rows over this group's K. */ \
    const char* pf = (const char*)(W + (n0 + 4 * VX_AVX2_PDG) * K); \
    for (int64_t k = 0; k < K; k += 8) { \
        _mm_prefetch(pf + k * (PFB / 8), _MM_HINT_T0); \
        __m256 wv[4]; \
        for (int r = 0; r < 4; r++) wv[r] = LOAD(w[r] + k); \
        for (int m = 0; m < MM; m++) { \
            const __m256 xv = _mm256_loadu_ps(xf + m * K + k); \
            for (int r = 0; r < 4; r++) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]); \
        } \
    } \
    for (int m = 0; m < MM; m++) \
        for (int r = 0; r < 4; r++) out[m * 4 + r] = vx_hsum8(acc[m][r]); \
}
VX_AVX2_TILE(vx_avx2_tile, 1, vx_bf16, vx_w8_bf16, 64)
VX_AVX2_TILE(vx_avx2_tile, 2, vx_bf16, vx_w8_bf16, 64)
VX_AVX2_TILE(vx_avx2_tile, 3, vx_bf16, vx_w8_bf16, 64)
VX_AVX2_TILE(vx_avx2_tile_i8, 1, int8_t, vx_w8_i8, 32)
VX_AVX2_TILE(vx_avx2_tile_i8, 2, int8_t, vx_w8_i8, 32)
VX_AVX2_TILE(vx_avx2_tile_i8, 3, int8_t, vx_w8_i8, 32)
/* The int8 GEMM's tile over the packed layout of `vx.gpu.cpu.widen.pack_int8_avx2`: in each
   block of 32 columns, byte 4 i + j is column 8 j + i, so one 32-byte load holds four vectors
   of 8 columns and byte j of each 32-bit lane is widened by a shift and a mask into q * 2^24
   (exact in fp32) instead of a cross-lane vpmovsxbd per 8 columns, which bounded the plain
   layout's tile (SmolLM2's linears at one row: as slow from L3 as from memory). The lanes
   take their columns in the plain tile's order, so the sums are its sums times 2^24, exactly;
   `out` is scaled back. */
#define VX_AVX2_TILE_I8P(MM) \
static void vx_avx2_tile_i8p_##MM(const float* xf, const int8_t* W, int64_t K, int64_t n0, \
                                  int64_t nr, float* out) { \
    __m256 acc[MM][4]; \
    for (int m = 0; m < MM; m++) \
        for (int r = 0; r < 4; r++) acc[m][r] = _mm256_setzero_ps(); \
    const int8_t* w[4]; \
    for (int r = 0; r < 4; r++) w[r] = W + (n0 + (r < nr ? r : 0)) * K; \
    const char* pf = (const char*)(W + (n0 + 4 * VX_AVX2_PDG) * K); \
    const __m256i top = _mm256_set1_epi32((int)0xFF000000u); \
    for (int64_t k = 0; k < K; k += 32) { \
        _mm_prefetch(pf + k * 4, _MM_HINT_T0); \
        _mm_prefetch(pf + k * 4 + 64, _MM_HINT_T0); \
        __m256i v[4]; \
        for (int r = 0; r < 4; r++) v[r] = _mm256_loadu_si256((const __m256i*)(w[r] + k)); \
        for (int j = 0; j < 4; j++) { \
            __m256 wv[4]; \
            for (int r = 0; r < 4; r++) { \
                const __m256i b = j == 3 ? v[r] : _mm256_slli_epi32(v[r], 24 - 8 * j); \
                wv[r] = _mm256_cvtepi32_ps(j == 0 ? b : _mm256_and_si256(b, top)); \
            } \
            for (int m = 0; m < MM; m++) { \
                const __m256 xv = _mm256_loadu_ps(xf + m * K + k + 8 * j); \
                for (int r = 0; r < 4; r++) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]); \
            } \
        } \
    } \
    for (int m = 0; m < MM; m++) \
        for (int r = 0; r < 4; r++) out[m * 4 + r] = vx_hsum8(acc[m][r]) * 0x1p-24f; \
}
VX_AVX2_TILE_I8P(1)
VX_AVX2_TILE_I8P(2)
VX_AVX2_TILE_I8P(3)
/* The int4 GEMM's tile (`--quantization int4`, groups of 32 columns: w = (q - 8) s + z) over the
   layout of `vx.gpu.cpu.widen.pack_int4_avx2`: in each block of 64 columns, nibble j of 32-bit
   lane i holds q - 8 (two's complement) of column 8 j + i, so a shift and a mask give
   (q - 8) 2^28 exactly; a group's products are summed, then scaled by S (the group's s
   2^-28) into the row's sums; the zeros' part, sum_g z_g (the group's sum of x), is added
   after (XS: those sums, [M][K / 32]). Two rows of x a tile, one weight row at a time: the
   accumulators, x and the weight vectors stay in registers. */
#define VX_AVX2_TILE_I4(MM) \
static void vx_avx2_tile_i4_##MM(const float* xf, const uint8_t* W, int64_t K, int64_t n0, \
                                 int64_t nr, const float* S, const float* Z, const float* XS, \
                                 float* out) { \
    __m256 acc[MM][4]; \
    for (int m = 0; m < MM; m++) \
        for (int r = 0; r < 4; r++) acc[m][r] = _mm256_setzero_ps(); \
    const int64_t G = K / 32; \
    const uint8_t* w[4]; \
    const float* s[4]; \
    for (int r = 0; r < 4; r++) { \
        const int64_t row = n0 + (r < nr ? r : 0); \
        w[r] = W + row * (K / 2); \
        s[r] = S + row * G; \
    } \
    const char* pf = (const char*)(W + (n0 + 4 * VX_AVX2_PDG) * (K / 2)); \
    const __m256i top = _mm256_set1_epi32((int)0xF0000000u); \
    for (int64_t k = 0; k < K; k += 64) { \
        _mm_prefetch(pf + k * 2, _MM_HINT_T0); \
        _mm_prefetch(pf + k * 2 + 64, _MM_HINT_T0); \
        for (int r = 0; r < 4; r++) { \
            const __m256i v = _mm256_loadu_si256((const __m256i*)(w[r] + k / 2)); \
            for (int h = 0; h < 2; h++) {  /* group k / 32 + h: nibbles 4 h .. 4 h + 3 */ \
                __m256 ga[MM]; \
                for (int jj = 0; jj < 4; jj++) { \
                    const int j = 4 * h + jj; \
                    const __m256i b = j == 7 ? v : _mm256_slli_epi32(v, 28 - 4 * j); \
                    const __m256 wv = _mm256_cvtepi32_ps(j == 0 ? b : _mm256_and_si256(b, top)); \
                    for (int m = 0; m < MM; m++) { \
                        const __m256 xv = _mm256_loadu_ps(xf + m * K + k + 8 * j); \
                        ga[m] = jj ? _mm256_fmadd_ps(xv, wv, ga[m]) : _mm256_mul_ps(xv, wv); \
                    } \
                } \
                const __m256 sv = _mm256_broadcast_ss(s[r] + k / 32 + h); \
                for (int m = 0; m < MM; m++) acc[m][r] = _mm256_fmadd_ps(ga[m], sv, acc[m][r]); \
            } \
        } \
    } \
    for (int m = 0; m < MM; m++) \
        for (int r = 0; r < 4; r++) { \
            const float* z = Z + (s[r] - S); \
            float zs = 0.f; \
            for (int64_t g = 0; g < G; g++) zs += z[g] * XS[m * G + g]; \
            out[m * 4 + r] = vx_hsum8(acc[m][r]) + zs; \
        } \
}
VX_AVX2_TILE_I4(2)
/* One row of x: the four weight rows' words in registers, each x vector loaded once for
   all four (the 2-row tile reloads them per weight row); the same sums in the same order. */
static void vx_avx2_tile_i4_1(const float* xf, const uint8_t* W, int64_t K, int64_t n0,
                              int64_t nr, const float* S, const float* Z, const float* XS,
                              float* out) {
    __m256 acc[4];
    const int64_t G = K / 32;
    const uint8_t* w[4];
    const float* s[4];
    for (int r = 0; r < 4; r++) {
        const int64_t row = n0 + (r < nr ? r : 0);
        w[r] = W + row * (K / 2);
        s[r] = S + row * G;
        acc[r] = _mm256_setzero_ps();
    }
    const char* pf = (const char*)(W + (n0 + 4 * VX_AVX2_PDG) * (K / 2));
    const __m256i top = _mm256_set1_epi32((int)0xF0000000u);
    for (int64_t k = 0; k < K; k += 64) {
        _mm_prefetch(pf + k * 2, _MM_HINT_T0);
        _mm_prefetch(pf + k * 2 + 64, _MM_HINT_T0);
        __m256i v[4];
        for (int r = 0; r < 4; r++) v[r] = _mm256_loadu_si256((const __m256i*)(w[r] + k / 2));
        for (int h = 0; h < 2; h++) {
            __m256 ga[4];
            for (int jj = 0; jj < 4; jj++) {
                const int j = 4 * h + jj;
                const __m256 xv = _mm256_loadu_ps(xf + k + 8 * j);
                for (int r = 0; r < 4; r++) {
                    const __m256i b = j == 7 ? v[r] : _mm256_slli_epi32(v[r], 28 - 4 * j);
                    const __m256 wv = _mm256_cvtepi32_ps(j == 0 ? b : _mm256_and_si256(b, top));
                    ga[r] = jj ? _mm256_fmadd_ps(xv, wv, ga[r]) : _mm256_mul_ps(xv, wv);
                }
            }
            for (int r = 0; r < 4; r++)
                acc[r] = _mm256_fmadd_ps(ga[r], _mm256_broadcast_ss(s[r] + k / 32 + h), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) {
        const float* z = Z + (s[r] - S);
        float zs = 0.f;
        for (int64_t g = 0; g < G; g++) zs += z[g] * XS[g];
        out[r] = vx_hsum8(acc[r]) + zs;
    }
}
/* x (bf16 rows, stride x_st) widened to fp32 [M, K]; NULL: no memory. */
static float* vx_avx2_widen_x(const vx_bf16* x, int64_t x_st, int M, int64_t K) {
    float* xf = (float*)malloc(sizeof(float) * (size_t)M * (size_t)K);
    if (xf)
        for (int m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) xf[m * K + k] = ld_bf16(x[m * x_st + k]);
    return xf;
}
/* The body both GEMMs share: M rows of xf against the N rows of W, in groups of 4 weight rows
   shared with stealing; 3 rows of x at a time against a group (the first pass reads the
   group from memory, the others from L1: 4 K bf16 is 12 KiB at K = 1536). STORE writes
   the tile's sums out: o[m * 4 + r] (m < mm, r < nr) is row m0 + m of x with weight row
   n0 + r. */
#define VX_AVX2_GEMM(TILE, W, STORE) do { \
    vx_ws ws; \
    const int64_t groups = (N + 3) / 4; \
    const int par = N * K >= 262144; \
    vx_ws_init(&ws, groups, par); \
    _Pragma("omp parallel if (par)") \
    for (int64_t g; (g = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) { \
        const int64_t n0 = g * 4, nr = N - n0 < 4 ? N - n0 : 4; \
        for (int m0 = 0; m0 < M; m0 += VX_AVX2_MT) { \
            const int mm = M - m0 < VX_AVX2_MT ? M - m0 : VX_AVX2_MT; \
            const float* xm = xf + (int64_t)m0 * K; \
            float o[VX_AVX2_MT * 4]; \
            switch (mm) { \
            case 1: TILE##_1(xm, W, K, n0, nr, o); break; \
            case 2: TILE##_2(xm, W, K, n0, nr, o); break; \
            default: TILE##_3(xm, W, K, n0, nr, o); break; \
            } \
            STORE; \
        } \
    } \
} while (0)
int vx_gemv_bf16_avx2(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W,
                      const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    if (M < 1 || M > VX_AVX2_MAX_ROWS || K % 8 || K > VX_AVX2_MAX_K) return -1;
    float* xf = vx_avx2_widen_x(x, x_st, M, K);
    if (!xf) return -3;
    VX_AVX2_GEMM(vx_avx2_tile, W, for (int64_t r = 0; r < nr; r++) {
        const float b = bias ? ld_bf16(bias[n0 + r]) : 0.f;
        for (int m = 0; m < mm; m++) y[(m0 + m) * y_st + n0 + r] = st_bf16(o[m * 4 + r] + b);
    });
    free(xf);
    return 0;
}
/* The screen of an int8 copy of W (per-row scales s): y [M, N] fp32, y[m, n] = s[n] *
   (x[m] . Q[n]), fp32 products and sums. The LM head's exact greedy search reads it
   (`vx.gpu.cpu.screen`). Same shapes and limits as vx_gemv_bf16_avx2. */
int vx_screen_i8_avx2(const vx_bf16* x, int64_t x_st, int M, const int8_t* Q, const float* s,
                      float* y, int64_t N, int64_t K) {
    if (M < 1 || M > VX_AVX2_MAX_ROWS || K % 8 || K > VX_AVX2_MAX_K) return -1;
    float* xf = vx_avx2_widen_x(x, x_st, M, K);
    if (!xf) return -3;
    VX_AVX2_GEMM(vx_avx2_tile_i8, Q, for (int64_t r = 0; r < nr; r++) {
        for (int m = 0; m < mm; m++) y[(m0 + m) * N + n0 + r] = o[m * 4 + r] * s[n0 + r];
    });
    free(xf);
    return 0;
}
/* Weight-only int8 (`--quantization int8`): y = (x @ Q.T) * scale[n] + bias, Q [N, K] int8 with
   bf16 per-row scales in the packed layout (vx_avx2_tile_i8p), as `vx_gemv_int8` (the AVX-512
   kernel) computes it: fp32 products and sums, one bf16 rounding. Half the bytes of
   vx_gemv_bf16_avx2's weight. */
int vx_gemv_int8_avx2(const vx_bf16* x, int64_t x_st, int M, const int8_t* Q,
                      const vx_bf16* scale, const vx_bf16* bias, vx_bf16* y, int64_t y_st,
                      int64_t N, int64_t K) {
    if (M < 1 || M > VX_AVX2_MAX_ROWS || K % 32 || K > VX_AVX2_MAX_K) return -1;
    float* xf = vx_avx2_widen_x(x, x_st, M, K);
    if (!xf) return -3;
    VX_AVX2_GEMM(vx_avx2_tile_i8p, Q, for (int64_t r = 0; r < nr; r++) {
        const float s = ld_bf16(scale[n0 + r]);
        const float b = bias ? ld_bf16(bias[n0 + r]) : 0.f;
        for (int m = 0; m < mm; m++) y[(m0 + m) * y_st + n0 + r] = st_bf16(o[m * 4 + r] * s + b);
    });
    free(xf);
    return 0;
}
/* Weight-only int4 (`--quantization int4`): y = x @ W.T + bias for W[n, k] = (q - 8) s + z per
   group of 32 columns, q the packed nibbles of `pack_int4_avx2` ([N, K / 2] bytes), S the
   scales times 2^-28 and Z the zeros ([N, K / 32] fp32 each): fp32 products and sums, one
   bf16 rounding. A quarter of the bf16 weight's bytes (and an eighth more for S and Z). */
int vx_gemv_int4_avx2(const vx_bf16* x, int64_t x_st, int M, const uint8_t* Q, const float* S,
                      const float* Z, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N,
                      int64_t K) {
    if (M < 1 || M > VX_AVX2_MAX_ROWS || K % 64 || K > VX_AVX2_MAX_K) return -1;
    const int64_t G = K / 32;
    float* xf = vx_avx2_widen_x(x, x_st, M, K);
    float* xs = (float*)malloc(sizeof(float) * (size_t)(M * G));
    if (!xf || !xs) { free(xf); free(xs); return -3; }
    for (int m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float t = 0.f;
            for (int c = 0; c < 32; c++) t += xf[m * K + g * 32 + c];
            xs[m * G + g] = t;
        }
    vx_ws ws;
    const int64_t groups = (N + 3) / 4;
    const int par = N * K >= 262144;
    vx_ws_init(&ws, groups, par);
    _Pragma("omp parallel if (par)")
    for (int64_t g; (g = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
        const int64_t n0 = g * 4, nr = N - n0 < 4 ? N - n0 : 4;
        for (int m0 = 0; m0 < M; m0 += 2) {
            const int mm = M - m0 < 2 ? M - m0 : 2;
            float o[8];
            if (mm == 1) vx_avx2_tile_i4_1(xf + m0 * K, Q, K, n0, nr, S, Z, xs + m0 * G, o);
            else vx_avx2_tile_i4_2(xf + m0 * K, Q, K, n0, nr, S, Z, xs + m0 * G, o);
            for (int64_t r = 0; r < nr; r++) {
                const float b = bias ? ld_bf16(bias[n0 + r]) : 0.f;
                for (int m = 0; m < mm; m++) y[(m0 + m) * y_st + n0 + r] = st_bf16(o[m * 4 + r] + b);
            }
        }
    }
    free(xf);
    free(xs);
    return 0;
}
int vx_gemv_avx2_max_rows(void) { return VX_AVX2_MAX_ROWS; }
#else
int vx_gemv_int4_avx2(const vx_bf16* x, int64_t x_st, int M, const uint8_t* Q, const float* S,
                      const float* Z, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N,
                      int64_t K) {
    (void)x; (void)x_st; (void)M; (void)Q; (void)S; (void)Z; (void)bias; (void)y; (void)y_st;
    (void)N; (void)K;
    return -2;
}
int vx_gemv_int8_avx2(const vx_bf16* x, int64_t x_st, int M, const int8_t* Q,
                      const vx_bf16* scale, const vx_bf16* bias, vx_bf16* y, int64_t y_st,
                      int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)Q; (void)scale; (void)bias; (void)y; (void)y_st;
    (void)N; (void)K;
    return -2;
}
int vx_screen_i8_avx2(const vx_bf16* x, int64_t x_st, int M, const int8_t* Q, const float* s,
                      float* y, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)Q; (void)s; (void)y; (void)N; (void)K;
    return -2;
}
int vx_gemv_bf16_avx2(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W,
                      const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)W; (void)bias; (void)y; (void)y_st; (void)N; (void)K;
    return -2;
}
int vx_gemv_avx2_max_rows(void) { return 0; }
#endif
