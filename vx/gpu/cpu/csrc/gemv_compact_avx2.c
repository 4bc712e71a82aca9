/* The one- and two-row bf16 GEMM on the compact copy of a weight
   (`vx.gpu.cpu.compact`), for CPUs with AVX2 and no AVX-512.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library after the
   AVX2 skinny GEMM, whose tile frame it shares; `vx.gpu.cpu.compact.CompactWeight` and the fused
   step's `vx_linear_apply` call it).

   Why it exists: a one-row decode step only streams the weights, and the bf16 weight is already
   read at this machine's read rate (`vx_gemv_bf16_avx2`). The compact copy holds the same bf16
   values exactly in 12.25 bits each instead of 16 (SmolLM2's layers: 163 MB against 212), so
   the step reads a quarter less. Decoding costs ~9 vector operations per 32 weights, which hide
   under the memory stream at one and two rows; from three rows on they do not (measured behind
   the bf16 kernel at three and four rows on a 2-core Zen 3), hence VX_COMPACT_MAX_ROWS.

   Layout (`vx.gpu.cpu.compact.pack_compact`): per weight row, blocks of 32 columns, 48 bytes a
   block, rows contiguous ([N, K / 32, 48]), and one byte per block in Hb ([N, K / 32]). A bf16
   value is s:1 e:8 m:7. Its low byte, (e & 1) << 7 | m, is stored as is (bytes 0-31 of the
   block, in the order below); its high byte, s << 7 | e >> 1, as a 4-bit code s << 3 | d, where
   d = hb - (e >> 1) and hb, the block's largest e >> 1, is its Hb byte (the codes of bytes j and
   j + 16 share byte 32 + j, low nibble first). A block whose d would pass 7 (0.3% of SmolLM2's
   blocks: a zero or a far smaller value beside large ones) is stored raw instead: Hb 0xFF, its
   32 bf16 values in natural order in `raw`, their index there an int32 at byte 32.

   Decoding a block: one 16-entry byte table per hb (vx_compact_tab, 4 KiB) turns the codes into
   high bytes with one vpshufb; byte unpacks pair them with the low bytes into bf16 words and
   widen those into fp32. The unpacks work within 128-bit lanes, so byte j holds column
   8 ((j & 15) >> 2) + (j & 3) + 4 (j >> 4): the four vectors come out in column order, each lane
   then takes the columns the bf16 kernel's lane takes, in the same order, and the sums are
   `vx_gemv_bf16_avx2`'s, bit for bit. */
#include "vx_kernels.h"
#define VX_COMPACT_MAX_ROWS 2
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* vx_compact_tab[32 h + q] (both 16-byte halves alike): the high byte of code q & 15 in a
   block whose largest e >> 1 is h: (q & 8) << 4 | (h - (q & 7)). */
static uint8_t vx_compact_tab[128 * 32] __attribute__((aligned(64)));
__attribute__((constructor)) static void vx_compact_tab_init(void) {
    for (int h = 0; h < 128; h++)
        for (int q = 0; q < 32; q++)
            vx_compact_tab[h * 32 + q] = (uint8_t)(((q & 8) << 4) | ((h - (q & 7)) & 0x7F));
}
/* A block's 32 columns: f[t] = columns 8 t .. 8 t + 7 as fp32, exactly the bf16 values. */
static inline __attribute__((always_inline)) void vx_compact_decode(
        const uint8_t* blk, uint8_t hb, const vx_bf16* raw, __m256 f[4]) {
    if (__builtin_expect(hb == 0xFF, 0)) {
        int32_t idx;
        __builtin_memcpy(&idx, blk + 32, 4);
        for (int t = 0; t < 4; t++) f[t] = vx_w8_bf16(raw + (int64_t)idx * 32 + 8 * t);
        return;
    }
    const __m256i lo = _mm256_loadu_si256((const __m256i*)blk);
    const __m256i nb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + 32)));
    /* the low nibbles for bytes 0-15, the high ones for 16-31 */
    const __m256i code = _mm256_and_si256(
        _mm256_srlv_epi32(nb, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
    const __m256i tab = _mm256_load_si256((const __m256i*)(vx_compact_tab + 32 * hb));
    const __m256i hi = _mm256_shuffle_epi8(tab, code);
    const __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
    const __m256i z = _mm256_setzero_si256();
    f[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w0));
    f[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w0));
    f[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w1));
    f[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w1));
}
/* vx_avx2_tile's sums over the compact rows n0..n0+3 (the group VX_AVX2_PDG ahead
   prefetched, 192 bytes per block: its 4 rows' share); MM rows of xf. */
#define VX_COMPACT_TILE(MM) \
static void vx_compact_tile_##MM(const float* xf, const uint8_t* W, const uint8_t* Hb, \
                                 const vx_bf16* raw, int64_t K, int64_t n0, int64_t nr, \
                                 float* out) { \
    __m256 acc[MM][4]; \
    for (int m = 0; m < MM; m++) \
        for (int r = 0; r < 4; r++) acc[m][r] = _mm256_setzero_ps(); \
    const int64_t nbk = K / 32; \
    const uint8_t* w[4]; \
    const uint8_t* h[4]; \
    for (int r = 0; r < 4; r++) { \
        const int64_t row = n0 + (r < nr ? r : 0); \
        w[r] = W + row * nbk * 48; \
        h[r] = Hb + row * nbk; \
    } \
    const char* pf = (const char*)(W + (n0 + 4 * VX_AVX2_PDG) * nbk * 48); \
    for (int64_t b = 0; b < nbk; b++) { \
        _mm_prefetch(pf + b * 192, _MM_HINT_T0); \
        _mm_prefetch(pf + b * 192 + 64, _MM_HINT_T0); \
        _mm_prefetch(pf + b * 192 + 128, _MM_HINT_T0); \
        for (int r = 0; r < 4; r++) { \
            __m256 f[4]; \
            vx_compact_decode(w[r] + b * 48, h[r][b], raw, f); \
            for (int m = 0; m < MM; m++) \
                for (int t = 0; t < 4; t++) \
                    acc[m][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * K + 32 * b + 8 * t), \
                                                f[t], acc[m][r]); \
        } \
    } \
    for (int m = 0; m < MM; m++) \
        for (int r = 0; r < 4; r++) out[m * 4 + r] = vx_hsum8(acc[m][r]); \
}
VX_COMPACT_TILE(1)
VX_COMPACT_TILE(2)
VX_COMPACT_TILE(3)
/* VX_AVX2_GEMM calls TILE##_mm(xm, W, K, n0, nr, o): these pass Hb and raw along. */
#define vx_compact_w_1(xm, W, K, n0, nr, o) vx_compact_tile_1(xm, W, Hb, raw, K, n0, nr, o)
#define vx_compact_w_2(xm, W, K, n0, nr, o) vx_compact_tile_2(xm, W, Hb, raw, K, n0, nr, o)
#define vx_compact_w_3(xm, W, K, n0, nr, o) vx_compact_tile_3(xm, W, Hb, raw, K, n0, nr, o)
/* y = x @ W.T + bias for 1-2 rows of x (bf16, row stride x_st) and W's compact copy (W, Hb,
   raw as above): `vx_gemv_bf16_avx2`'s outputs, bit for bit. K % 32 == 0. */
int vx_gemv_compact_avx2(const vx_bf16* x, int64_t x_st, int M, const uint8_t* W,
                         const uint8_t* Hb, const vx_bf16* raw, const vx_bf16* bias, vx_bf16* y,
                         int64_t y_st, int64_t N, int64_t K) {
    if (M < 1 || M > VX_COMPACT_MAX_ROWS || K % 32 || K > VX_AVX2_MAX_K) return -1;
    float* xf = vx_avx2_widen_x(x, x_st, M, K);
    if (!xf) return -3;
    VX_AVX2_GEMM(vx_compact_w, W, for (int64_t r = 0; r < nr; r++) {
        const float b = bias ? ld_bf16(bias[n0 + r]) : 0.f;
        for (int m = 0; m < mm; m++) y[(m0 + m) * y_st + n0 + r] = st_bf16(o[m * 4 + r] + b);
    });
    free(xf);
    return 0;
}
int vx_compact_max_rows(void) { return VX_COMPACT_MAX_ROWS; }
#else
int vx_gemv_compact_avx2(const vx_bf16* x, int64_t x_st, int M, const uint8_t* W,
                         const uint8_t* Hb, const vx_bf16* raw, const vx_bf16* bias, vx_bf16* y,
                         int64_t y_st, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)W; (void)Hb; (void)raw; (void)bias; (void)y;
    (void)y_st; (void)N; (void)K;
    return -2;
}
int vx_compact_max_rows(void) { return 0; }
#endif
