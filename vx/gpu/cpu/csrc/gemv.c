/* The CPU skinny GEMM (decode at small batch): y = x @ W.T * scale + bias.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the same library as the decode
   attention kernel; `vx.gpu.layers.quantization` calls it).

   Why it exists: at 1-8 rows a decode step only streams the weights, and both oneDNN's packed bf16
   GEMM and torch's `_weight_int8pack_mm` read SmolLM2's 121 small matrices well below what two
   cores can read. The loads are not the limit, the misses are: each matrix is a
   fresh stream too short for the hardware prefetcher to ramp up. Software prefetch `VX_GEMV_PD`
   weights ahead of every row closes most of that gap (measured on SmolLM2's int8 step).

   Layout: x [M, K] bf16 (row stride x_st), W [N, K] row-major int8 or bf16, scale [N] bf16 (int8
   only: per output channel), bias [N] bf16 or NULL, y [M, N] bf16 (row stride y_st). M <= 8,
   K % 16 == 0, K <= 16384. fp32 products and sums, one bf16 rounding at the end.
   Parallel over groups of output rows on torch's OpenMP pool (small matrices on the caller). */
#include "vx_kernels.h"
#include <immintrin.h>
#define VX_GEMV_MAX_ROWS 8
#define VX_GEMV_MAX_K 16384
#define VX_GEMV_PD 4096
#define VX_GEMV_MAX_ROWS_DP 16
#if defined(__AVX512F__)
#include <omp.h>
static float vx_gemv_x[VX_GEMV_MAX_ROWS * VX_GEMV_MAX_K] __attribute__((aligned(64)));

static inline __m512 vx_w16_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
static inline __m512 vx_w16_bf16(const vx_bf16* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
/* R weight rows from n0 against M activation rows; out[m * 4 + r]. One prefetch per 64-byte
   line of each row, VX_GEMV_PD weights ahead. */
#define VX_GEMV_TILE(NAME, WT, LOAD, PER_LINE) \
static inline __attribute__((always_inline)) void NAME(const WT* W, int64_t K, int64_t n0, \
        int R, int M, const float* xf, float* out) { \
    __m512 acc[4][VX_GEMV_MAX_ROWS]; \
    for (int r = 0; r < R; r++) for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps(); \
    for (int64_t k = 0; k < K; k += 16) { \
        for (int r = 0; r < R; r++) { \
            const WT* p = W + (n0 + r) * K + k; \
            if ((k & (PER_LINE - 1)) == 0) _mm_prefetch((const char*)(p + VX_GEMV_PD), _MM_HINT_T0); \
            const __m512 w = LOAD(p); \
            for (int m = 0; m < M; m++) \
                acc[r][m] = _mm512_fmadd_ps(w, _mm512_load_ps(xf + m * K + k), acc[r][m]); \
        } \
    } \
    for (int r = 0; r < R; r++) \
        for (int m = 0; m < M; m++) out[m * 4 + r] = _mm512_reduce_add_ps(acc[r][m]); \
}
VX_GEMV_TILE(vx_gemv_tile_i8, int8_t, vx_w16_i8, 64)
VX_GEMV_TILE(vx_gemv_tile_bf16, vx_bf16, vx_w16_bf16, 32)

#define VX_GEMV_BODY(TILE, M, R) \
    vx_ws ws; \
    vx_ws_init(&ws, (N + R - 1) / R, N * K >= 262144); \
    _Pragma("omp parallel if (N * K >= 262144)") \
    for (int64_t g; (g = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) { \
        const int64_t n0 = g * R; \
        const int rr = N - n0 < R ? (int)(N - n0) : R; \
        float o[VX_GEMV_MAX_ROWS * 4]; \
        if (rr == R) TILE(W, K, n0, R, M, xf, o); \
        else for (int r = 0; r < rr; r++) TILE(W, K, n0 + r, 1, M, xf, o + r); \
        for (int r = 0; r < rr; r++) { \
            const float s = scale ? ld_bf16(scale[n0 + r]) : 1.f; \
            const float b = bias ? ld_bf16(bias[n0 + r]) : 0.f; \
            for (int m = 0; m < M; m++) y[m * y_st + n0 + r] = st_bf16(o[m * 4 + r] * s + b); \
        } \
    }
/* Constant M and R per case, so the accumulators stay in registers. */
#define VX_GEMV_FN(NAME, WT, TILE) \
int NAME(const vx_bf16* x, int64_t x_st, int M, const WT* W, const vx_bf16* scale, \
         const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) { \
    if (M < 1 || M > VX_GEMV_MAX_ROWS || K % 16 || K > VX_GEMV_MAX_K) return -1; \
    float* xf = vx_gemv_x; \
    for (int m = 0; m < M; m++) \
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = ld_bf16(x[m * x_st + k]); \
    switch (M) { \
    case 1: { VX_GEMV_BODY(TILE, 1, 4) } break; \
    case 2: { VX_GEMV_BODY(TILE, 2, 4) } break; \
    case 3: { VX_GEMV_BODY(TILE, 3, 4) } break; \
    case 4: { VX_GEMV_BODY(TILE, 4, 4) } break; \
    case 5: { VX_GEMV_BODY(TILE, 5, 2) } break; \
    case 6: { VX_GEMV_BODY(TILE, 6, 2) } break; \
    case 7: { VX_GEMV_BODY(TILE, 7, 2) } break; \
    case 8: { VX_GEMV_BODY(TILE, 8, 2) } break; \
    } \
    return 0; \
}
VX_GEMV_FN(vx_gemv_int8, int8_t, vx_gemv_tile_i8)
#if defined(__AVX512BF16__)
/* A VDPBF16PS tile, NAME(W, K, n0, R, M, x, x_st, out): out[m * 4 + r] = W[n0 + r] . x[m] for
   R <= 4 weight rows of type WT and M <= MAXM rows of bf16 x, read as stored; WIDEN(p) gives
   the 32 weights at p as bf16 (bf16 products are exact in fp32; pairs are summed before the
   accumulate), PD the prefetch distance in weights, into L2 (ahead of L1 prefetches at
   one and two rows of SmolLM2's 120 cold matrices, as measured). The bf16 GEMV's tile below
   and the LM head's int8 screen (screen.c) are the two. */
#define VX_DP_TILE(NAME, WT, WIDEN, PD, MAXM) \
static inline __attribute__((always_inline)) void NAME(const WT* W, int64_t K, int64_t n0, \
        int R, int M, const vx_bf16* x, int64_t x_st, float* out) { \
    __m512 acc[4][MAXM]; \
    for (int r = 0; r < R; r++) for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps(); \
    for (int64_t k = 0; k < K; k += 32) { \
        for (int r = 0; r < R; r++) { \
            const WT* p = W + (n0 + r) * K + k; \
            _mm_prefetch((const char*)(p + (PD)), _MM_HINT_T1); \
            const __m512bh w = WIDEN(p); \
            for (int m = 0; m < M; m++) \
                acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w, \
                                             (__m512bh)_mm512_loadu_si512(x + m * x_st + k)); \
        } \
    } \
    for (int r = 0; r < R; r++) \
        for (int m = 0; m < M; m++) out[m * 4 + r] = _mm512_reduce_add_ps(acc[r][m]); \
}
#define VX_DP_LOAD_BF16(p) ((__m512bh)_mm512_loadu_si512(p))
/* bf16 weights: 32 weights and one x row per instruction. */
VX_DP_TILE(vx_gemv_tile_dp, vx_bf16, VX_DP_LOAD_BF16, VX_GEMV_PD, VX_GEMV_MAX_ROWS_DP)
/* Rows of W in groups of R shared with stealing (`vx_ws`), each group's TILE out in o, then
   the caller's store (n0, rr and o in scope). Needs N, K, W, x and x_st in scope. */
#define VX_DP_BODY(TILE, M, R, MAXM, ...) \
    vx_ws ws; \
    vx_ws_init(&ws, (N + R - 1) / R, N * K >= 262144); \
    _Pragma("omp parallel if (N * K >= 262144)") \
    for (int64_t g; (g = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) { \
        const int64_t n0 = g * R; \
        const int rr = N - n0 < R ? (int)(N - n0) : R; \
        float o[MAXM * 4]; \
        if (rr == R) TILE(W, K, n0, R, M, x, x_st, o); \
        else for (int r = 0; r < rr; r++) TILE(W, K, n0 + r, 1, M, x, x_st, o + r); \
        __VA_ARGS__ \
    }
#define VX_GEMV_DP_BODY(M, R) \
    VX_DP_BODY(vx_gemv_tile_dp, M, R, VX_GEMV_MAX_ROWS_DP, \
        for (int r = 0; r < rr; r++) { \
            const float b = bias ? ld_bf16(bias[n0 + r]) : 0.f; \
            for (int m = 0; m < M; m++) y[m * y_st + n0 + r] = st_bf16(o[m * 4 + r] + b); \
        })
int vx_gemv_bf16(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W, const vx_bf16* scale,
                 const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    (void)scale;
    if (M < 1 || M > VX_GEMV_MAX_ROWS_DP || K % 32) return -1;
    switch (M) {
    case 1: { VX_GEMV_DP_BODY(1, 4) } break;
    case 2: { VX_GEMV_DP_BODY(2, 4) } break;
    case 3: { VX_GEMV_DP_BODY(3, 4) } break;
    case 4: { VX_GEMV_DP_BODY(4, 4) } break;
    case 5: { VX_GEMV_DP_BODY(5, 2) } break;
    case 6: { VX_GEMV_DP_BODY(6, 2) } break;
    case 7: { VX_GEMV_DP_BODY(7, 2) } break;
    case 8: { VX_GEMV_DP_BODY(8, 2) } break;
    case 9: { VX_GEMV_DP_BODY(9, 1) } break;
    case 10: { VX_GEMV_DP_BODY(10, 1) } break;
    case 11: { VX_GEMV_DP_BODY(11, 1) } break;
    case 12: { VX_GEMV_DP_BODY(12, 1) } break;
    case 13: { VX_GEMV_DP_BODY(13, 1) } break;
    case 14: { VX_GEMV_DP_BODY(14, 1) } break;
    case 15: { VX_GEMV_DP_BODY(15, 1) } break;
    case 16: { VX_GEMV_DP_BODY(16, 1) } break;
    }
    return 0;
}
int vx_gemv_bf16_max_rows(void) { return VX_GEMV_MAX_ROWS_DP; }
#else
VX_GEMV_FN(vx_gemv_bf16, vx_bf16, vx_gemv_tile_bf16)
int vx_gemv_bf16_max_rows(void) { return VX_GEMV_MAX_ROWS; }
#endif
/* A 16 x 16 fp32 block in registers, transposed in place: r[j] becomes column j (pure data
   movement: any 32-bit patterns; the AMX GEMMs' x and C blocks, the prefill attention's K^T). */
static inline __attribute__((always_inline)) void vx_transpose16(__m512* r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    }
}
#ifdef VX_HAS_AMX
/* bf16 GEMM for 1-192 rows on AMX tiles, computed transposed: C^T[n][m] = W[n][k] . X^T[k][m],
   so each A tile is 16 weight rows x 32 k loaded straight from W (row stride K), and only x
   is re-laid out (VNNI pairs, zero-padded to 16 rows per block, once per call). Up to four
   C tiles (m blocks) share every A tile load; past 64 rows the next four m blocks take the
   same 16 weight rows again while they are still in L1/L2, so the weights stream from memory
   once per call whatever the rows. The next block of 16 weight rows is prefetched tile by
   tile into L2, not L1 (measured ahead with cold weights at 64 rows: L1 prefetches hold the
   core's few line-fill buffers the tile loads also need). Needs vx_fast_amx(1) to have been
   granted; returns -2 where it does not apply (the caller falls back). */
#define VX_AMX_MAX_ROWS 192
static vx_bf16 vx_amx_xb[(VX_AMX_MAX_ROWS / 16) * (VX_GEMV_MAX_K / 32) * 512]
    __attribute__((aligned(64)));
#define VX_AMX_STEP(T) \
    _tile_loadd(5, xg + ((int64_t)(T) * KC + kc) * 512, 64); _tile_dpbf16ps(T, 4, 5);
/* C^T tiles 0 .. mbn-1 = W[16 rows at a] . (x blocks xg)^T over all of K; prefetch: the next 16
   weight rows, tile by tile. Tiles 0-3 C^T, 4 A (weights), 5 B (x), configured by the caller. */
static inline __attribute__((always_inline)) void vx_amx_block(
        const vx_bf16* a, int64_t K, const vx_bf16* xg, int mbn, int prefetch) {
    const int64_t KC = K / 32;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kc = 0; kc < KC; kc++) {
        if (prefetch)
            for (int i = 0; i < 16; i++)
                _mm_prefetch((const char*)(a + (16 + i) * K + kc * 32), _MM_HINT_T1);
        _tile_loadd(4, a + kc * 32, K * 2);
        switch (mbn) {
        case 4: VX_AMX_STEP(3) /* fall through */
        case 3: VX_AMX_STEP(2) /* fall through */
        case 2: VX_AMX_STEP(1) /* fall through */
        default: VX_AMX_STEP(0)
        }
    }
}
/* C^T tile mb (0-3) into c [16 n][16 m] fp32. */
static inline __attribute__((always_inline)) void vx_amx_store_c(int mb, float* c) {
    switch (mb) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
    }
}
/* W's 16-row blocks nb as vx_ws hands them to this thread (its own range in order, then
   others' leftovers), and for each, every C^T tile of x's rows: the tile into c, then the
   caller's code with nb and m0 (the tile's first row of x) in scope. Needs N, K, W, xb, MB,
   KC, c and ws (vx_ws_init'ed over N / 16 blocks before the region). */
#define VX_AMX_FOR_TILES(...) \
    for (int64_t nb; (nb = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) { \
        for (int mg = 0; mg < MB; mg += 4) {  /* four m blocks (C tiles) at a time */ \
            const int mbn = MB - mg < 4 ? MB - mg : 4; \
            vx_amx_block(W + nb * 16 * K, K, xb + (int64_t)mg * KC * 512, mbn, \
                         mg == 0 && nb + 1 < N / 16); \
            for (int mb = 0; mb < mbn; mb++) { \
                const int m0 = (mg + mb) * 16; \
                vx_amx_store_c(mb, c); \
                __VA_ARGS__ \
            } \
        } \
    }
/* x [M, K] into the B tiles' layout, xb[mb][kc][r][j][2] = x[mb * 16 + j][kc * 32 + 2 r + {0, 1}],
   zero past row M: per 16 x 32 block, a 16 x 16 transpose of bf16 pairs, in registers (16
   gathers a block were a measurable cost over a 64-row decode step's 120 calls). Thread tid of
   nt packs its share of the blocks (the GEMM's threads, then a barrier: on one thread before
   the parallel region it was a measurable share of a 64-row call with hot weights). */
static void vx_amx_pack_x(const vx_bf16* x, int64_t x_st, int M, int64_t K, vx_bf16* xb,
                          int tid, int nt) {
    const int MB = (M + 15) / 16;
    const int64_t KC = K / 32, nblk = MB * KC;
    if (x_st % 2 == 0) {
        for (int64_t w = nblk * tid / nt; w < nblk * (tid + 1) / nt; w++) {  /* block (mb, kc) */
            const int mb = (int)(w / KC), left = M - mb * 16;
            const int64_t kc = w % KC;
            const vx_bf16* src = x + (int64_t)mb * 16 * x_st + kc * 32;
            __m512 r[16];
            for (int j = 0; j < 16; j++)
                r[j] = j < left ? _mm512_castsi512_ps(_mm512_loadu_si512(
                                      (const void*)(src + (int64_t)j * x_st)))
                                : _mm512_setzero_ps();
            vx_transpose16(r);
            vx_bf16* t = xb + w * 512;  /* w = mb * KC + kc */
            for (int i = 0; i < 16; i++)
                _mm512_store_si512((void*)(t + 32 * i), _mm512_castps_si512(r[i]));
        }
    } else if (tid == 0) {
        for (int mb = 0; mb < MB; mb++)
            for (int64_t kc = 0; kc < KC; kc++) {
                vx_bf16* t = xb + ((int64_t)mb * KC + kc) * 512;
                for (int j = 0; j < 16; j++) {
                    const int m = mb * 16 + j;
                    for (int r = 0; r < 16; r++) {
                        t[r * 32 + 2 * j] = m < M ? x[m * x_st + kc * 32 + 2 * r] : 0;
                        t[r * 32 + 2 * j + 1] = m < M ? x[m * x_st + kc * 32 + 2 * r + 1] : 0;
                    }
                }
            }
    }
}
int vx_gemm_amx_bf16(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W,
                     const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    if (!vx_amx_on || M < 1 || M > VX_AMX_MAX_ROWS || K % 32 || K > VX_GEMV_MAX_K || N % 16)
        return -2;
    const int MB = (M + 15) / 16;
    const int64_t KC = K / 32;
    vx_bf16* xb = vx_amx_xb;
    vx_ws ws;
    vx_ws_init(&ws, N / 16, N * K >= 262144);
    _Pragma("omp parallel if (N * K >= 262144)") {
        vx_amx_pack_x(x, x_st, M, K, xb, omp_get_thread_num(), omp_get_num_threads());
        _Pragma("omp barrier")
        vx_amx_load_tiles(6);  /* 0-3: C^T blocks, 4: A (weights), 5: B (x) */
        float c[16 * 16] __attribute__((aligned(64)));
        VX_AMX_FOR_TILES({
            /* column j of c (16 n) is row m = m0 + j of y: c transposed in registers, then a
               store per row (16 gathers a tile were a large share of a 64-row call's time) */
            const __m512 bv = bias ? vx_ld16_bf16(bias + nb * 16) : _mm512_setzero_ps();
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c + 16 * i);
            vx_transpose16(r);
            for (int j = 0; j < 16 && m0 + j < M; j++)
                _mm256_storeu_si256((__m256i*)(y + (int64_t)(m0 + j) * y_st + nb * 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(r[j], bv)));
        })
        _tile_release();
    }
    return 0;
}
/* The greedy token of each of M rows: out[m] = the first n with the largest bf16(x[m] . W[n]),
   the logits vx_gemm_amx_bf16 would write (same tiles, same rounding), never stored; a NaN
   counts above every number, as in numpy's argmax. Returns -2 where vx_gemm_amx_bf16 would,
   -1 if scratch could not be allocated. */
int vx_argmax_amx_bf16(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W, int64_t N,
                       int64_t K, int64_t* out) {
    if (!vx_amx_on || M < 1 || M > VX_AMX_MAX_ROWS || K % 32 || K > VX_GEMV_MAX_K || N % 16)
        return -2;
    const int MB = (M + 15) / 16, nt = omp_get_max_threads();
    const int64_t KC = K / 32;
    /* per thread, per row: the best value so far and its n (-1: none yet) */
    float* best = (float*)aligned_alloc(64, sizeof(float) * (size_t)nt * VX_AMX_MAX_ROWS);
    int32_t* arg = (int32_t*)aligned_alloc(64, sizeof(int32_t) * (size_t)nt * VX_AMX_MAX_ROWS);
    if (!best || !arg) { free(best); free(arg); return -1; }
    for (int i = 0; i < nt * VX_AMX_MAX_ROWS; i++) { best[i] = -INFINITY; arg[i] = -1; }
    vx_bf16* xb = vx_amx_xb;
    int used = 1;
    vx_ws ws;
    vx_ws_init(&ws, N / 16, N * K >= 262144);
    _Pragma("omp parallel if (N * K >= 262144)") {
        vx_amx_pack_x(x, x_st, M, K, xb, omp_get_thread_num(), omp_get_num_threads());
        _Pragma("omp barrier")
        vx_amx_load_tiles(6);
        float c[16 * 16] __attribute__((aligned(64)));
        const int t = omp_get_thread_num();
        float* bv = best + (int64_t)t * VX_AMX_MAX_ROWS;
        int32_t* bi = arg + (int64_t)t * VX_AMX_MAX_ROWS;
        if (t == 0) used = omp_get_num_threads();
        /* blocks in any order (a thread may take another's leftovers): ties go to the
           smaller n, so the result does not depend on which thread saw what */
        VX_AMX_FOR_TILES({
            const __m512i nv_base = _mm512_set1_epi32((int)(nb * 16));
            /* row r of c is n = nb * 16 + r for 16 rows m of x: one vector per n */
            __m512 v_best = _mm512_load_ps(bv + m0);
            __m512i v_arg = _mm512_load_si512((const void*)(bi + m0));
            for (int r = 0; r < 16; r++) {
                const __m256bh h = _mm512_cvtneps_pbh(_mm512_load_ps(c + 16 * r));
                const __m512 v = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
                /* greater, or equal at a smaller n; a NaN beats every number, and the
                   NaN at the smallest n every other NaN; anything beats none yet (-1) */
                const __m512i nv = _mm512_add_epi32(nv_base, _mm512_set1_epi32(r));
                const __mmask16 earlier = _mm512_cmpgt_epi32_mask(v_arg, nv);
                const __mmask16 take =
                    _mm512_cmp_ps_mask(v, v_best, _CMP_GT_OQ) |
                    (_mm512_cmp_ps_mask(v, v_best, _CMP_EQ_OQ) & earlier) |
                    (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) &
                     (_mm512_cmp_ps_mask(v_best, v_best, _CMP_ORD_Q) | earlier)) |
                    _mm512_cmpeq_epi32_mask(v_arg, _mm512_set1_epi32(-1));
                v_best = _mm512_mask_mov_ps(v_best, take, v);
                v_arg = _mm512_mask_mov_epi32(v_arg, take, nv);
            }
            _mm512_store_ps(bv + m0, v_best);
            _mm512_store_si512((void*)(bi + m0), v_arg);
        })
        _tile_release();
    }
    /* the threads' bests, by the same rule */
    for (int m = 0; m < M; m++) {
        float b = best[m];
        int32_t i = arg[m];
        for (int th = 1; th < used; th++) {
            const float v = best[(int64_t)th * VX_AMX_MAX_ROWS + m];
            const int32_t j = arg[(int64_t)th * VX_AMX_MAX_ROWS + m];
            if (j < 0) continue;
            const int nan_v = isnan(v), nan_b = isnan(b);
            if (i < 0 || (nan_v && (!nan_b || j < i)) ||
                (!nan_v && !nan_b && (v > b || (v == b && j < i)))) { b = v; i = j; }
        }
        out[m] = i;
    }
    free(best);
    free(arg);
    return 0;
}
#else
int vx_argmax_amx_bf16(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W, int64_t N,
                       int64_t K, int64_t* out) {
    (void)x; (void)x_st; (void)M; (void)W; (void)N; (void)K; (void)out;
    return -2;
}
int vx_gemm_amx_bf16(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W,
                     const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)W; (void)bias; (void)y; (void)y_st; (void)N; (void)K;
    return -2;
}
#endif
int vx_has_gemv(void) { return 1; }
#else
/* Without AVX-512 (AVX2 laptops and servers) none of the kernels above exist: the callers
   look at vx_has_gemv first, and these two symbols are all the loader binds here. */
int vx_has_gemv(void) { return 0; }
int vx_gemv_bf16_max_rows(void) { return 0; }
#endif
