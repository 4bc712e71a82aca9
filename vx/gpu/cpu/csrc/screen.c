/* The LM head's int8 screen on AVX512-BF16, and of the screen's candidate
   selection on every CPU.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library after the
   GEMV sources; `vx.gpu.cpu.screen.ScreenedHead` calls it).

   Why it exists: at batch 1 a decode step only streams weights, and SmolLM2's bf16 LM head is a
   fifth of them (57 MB of ~270), and the step's time follows the bytes. The int8 copy is
   half the bytes; `vx.gpu.cpu.screen` states the search and the bound it rests on.

   `vx_screen_i8`: y [M, N] fp32, y[m, n] = s[n] * (x[m] . W[n]) for bf16 x [M, K] (row stride
   x_st) and int8 W [N, K]; 1 <= M <= VX_SCREEN_MAX_ROWS, K % 32 == 0. Each 32 weights are widened
   to bf16 once (int8 values are exact in bf16) and VDPBF16PS takes them against each row of x
   (the products are exact in fp32, the sums rounded in fp32), so the bytes read are the int8
   copy's and the arithmetic stays well under what the memory delivers. It is the bf16 GEMV's
   tile and loop (`VX_DP_TILE`, `VX_DP_BODY` in gemv.c) with the widening in
   place of the weight load: blocks of 4 weight rows shared with stealing (`vx_ws`), the next
   rows prefetched.
   Without AVX512-BF16 it returns -2 (`vx_has_screen()` is 0), and AVX2 builds have
   `vx_screen_i8_avx2` (gemv_avx2.c) instead.

   `vx_screen_select`: row m's logits lie within a[m, n] +- l1[m] bound[n], with l1[m] = |x[m]|_1
   (computed here in double, from x as stored); n is a candidate of row m unless its upper end is
   below the largest lower end less |that| 2^-6. Writes the union of all rows' candidates,
   ascending, to idx, and whether each is row m's to cand[m * max_union + j]; returns the union's
   size, or -1 past max_union or where an l1 is not finite. */
#include "vx_kernels.h"
#define VX_SCREEN_MAX_ROWS 4
#if defined(__AVX512BF16__)
#define VX_SCREEN_PD 8192  /* int8 weights ahead: one VX_GEMV_PD's worth of bf16 bytes */
static inline __attribute__((always_inline)) __m512bh vx_screen_widen(const int8_t* p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);  /* weights 0-15 in the low half, as stored */
}
/* R weight rows from n0 against M rows of x: out[m * 4 + r] = W[n0 + r] . x[m]. */
VX_DP_TILE(vx_screen_tile, int8_t, vx_screen_widen, VX_SCREEN_PD, VX_SCREEN_MAX_ROWS)
#define VX_SCREEN_BODY(M) \
    VX_DP_BODY(vx_screen_tile, M, 4, VX_SCREEN_MAX_ROWS, \
        for (int r = 0; r < rr; r++) \
            for (int m = 0; m < M; m++) y[m * N + n0 + r] = o[m * 4 + r] * s[n0 + r];)
int vx_screen_i8(const vx_bf16* x, int64_t x_st, int M, const int8_t* W, const float* s,
                 float* y, int64_t N, int64_t K) {
    if (M < 1 || M > VX_SCREEN_MAX_ROWS || K % 32) return -1;
    switch (M) {  /* constant M per case, so the accumulators stay in registers */
    case 1: { VX_SCREEN_BODY(1) } break;
    case 2: { VX_SCREEN_BODY(2) } break;
    case 3: { VX_SCREEN_BODY(3) } break;
    default: { VX_SCREEN_BODY(4) } break;
    }
    return 0;
}
int vx_has_screen(void) { return 1; }
#else
int vx_screen_i8(const vx_bf16* x, int64_t x_st, int M, const int8_t* W, const float* s,
                 float* y, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)W; (void)s; (void)y; (void)N; (void)K;
    return -2;
}
int vx_has_screen(void) { return 0; }
#endif
/* max over n of a[n] - t bound[n], in double (8 lanes at a time where AVX-512 is built) */
static double vx_screen_top(const float* a, int64_t N, const double* bound, double t) {
    double top = -INFINITY;
    int64_t n = 0;
#if defined(__AVX512F__)
    __m512d vt = _mm512_set1_pd(-INFINITY);
    const __m512d vl = _mm512_set1_pd(t);
    for (; n + 8 <= N; n += 8)
        vt = _mm512_max_pd(vt, _mm512_fnmadd_pd(vl, _mm512_loadu_pd(bound + n),
                                                _mm512_cvtps_pd(_mm256_loadu_ps(a + n))));
    top = _mm512_reduce_max_pd(vt);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256d vt = _mm256_set1_pd(-INFINITY);
    const __m256d vl = _mm256_set1_pd(t);
    for (; n + 4 <= N; n += 4)
        vt = _mm256_max_pd(vt, _mm256_fnmadd_pd(vl, _mm256_loadu_pd(bound + n),
                                                _mm256_cvtps_pd(_mm_loadu_ps(a + n))));
    double t4[4];
    _mm256_storeu_pd(t4, vt);
    for (int i = 0; i < 4; i++) top = t4[i] > top ? t4[i] : top;
#endif
    for (; n < N; n++) {
        const double lo = (double)a[n] - t * bound[n];
        top = lo > top ? lo : top;
    }
    return top;
}
int64_t vx_screen_select(const float* a, int M, int64_t N, const double* bound,
                         const vx_bf16* x, int64_t x_st, int64_t K, int64_t* idx,
                         uint8_t* cand, int64_t max_union) {
    double l1[VX_SCREEN_MAX_ROWS], floor[VX_SCREEN_MAX_ROWS];
    if (M < 1 || M > VX_SCREEN_MAX_ROWS) return -1;
    for (int m = 0; m < M; m++) {
        double t = 0;
        for (int64_t k = 0; k < K; k++) t += fabs((double)ld_bf16(x[m * x_st + k]));
        if (!isfinite(t)) return -1;
        l1[m] = t;
        const double top = vx_screen_top(a + m * N, N, bound, t);
        if (!isfinite(top)) return -1;
        floor[m] = top - fabs(top) * 0x1p-6 - 1e-30;
    }
    int64_t u = 0, n = 0;
    /* row j: a candidate of the rows of x whose floor its upper end reaches */
#define VX_SCREEN_TAKE(j) do { \
        int any_ = 0; \
        uint8_t c_[VX_SCREEN_MAX_ROWS]; \
        for (int m = 0; m < M; m++) { \
            c_[m] = (double)a[m * N + (j)] + l1[m] * bound[j] >= floor[m]; \
            any_ |= c_[m]; \
        } \
        if (any_) { \
            if (u == max_union) return -1; \
            idx[u] = (j); \
            for (int m = 0; m < M; m++) cand[m * max_union + u] = c_[m]; \
            u++; \
        } \
    } while (0)
#if defined(__AVX512F__)
    /* 8 rows at a time: most have no candidate in any row of x, and are skipped whole */
    for (; n + 8 <= N; n += 8) {
        const __m512d b = _mm512_loadu_pd(bound + n);
        __mmask8 any = 0;
        for (int m = 0; m < M; m++)
            any |= _mm512_cmp_pd_mask(
                _mm512_fmadd_pd(_mm512_set1_pd(l1[m]), b,
                                _mm512_cvtps_pd(_mm256_loadu_ps(a + m * N + n))),
                _mm512_set1_pd(floor[m]), _CMP_GE_OQ);
        if (any)
            for (int64_t j = n; j < n + 8; j++) VX_SCREEN_TAKE(j);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* 4 rows at a time, as above */
    for (; n + 4 <= N; n += 4) {
        const __m256d b = _mm256_loadu_pd(bound + n);
        int any = 0;
        for (int m = 0; m < M; m++)
            any |= _mm256_movemask_pd(_mm256_cmp_pd(
                _mm256_fmadd_pd(_mm256_set1_pd(l1[m]), b,
                                _mm256_cvtps_pd(_mm_loadu_ps(a + m * N + n))),
                _mm256_set1_pd(floor[m]), _CMP_GE_OQ));
        if (any)
            for (int64_t j = n; j < n + 4; j++) VX_SCREEN_TAKE(j);
    }
#endif
    for (; n < N; n++) VX_SCREEN_TAKE(n);
#undef VX_SCREEN_TAKE
    return u;
}
