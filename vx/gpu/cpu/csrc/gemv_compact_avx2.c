/* The one- to four-row bf16 GEMM on the compact copy of a weight
   (`vx.gpu.cpu.compact`), for CPUs with AVX2 and no AVX-512.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library after the
   AVX2 skinny and panel GEMMs, whose helpers it shares; `vx.gpu.cpu.compact.CompactWeight` and
   the fused step's `vx_linear_apply` call it).

   Why it exists: a one-row decode step only streams the weights, and the bf16 weight is already
   read at this machine's read rate (`vx_gemv_bf16_avx2`). The compact copy holds the same bf16
   values exactly in 12.25 bits each instead of 16 (SmolLM2's layers: 163 MB against 212), so
   the step reads a quarter less. Its blocks are laid out in the panel GEMM's order
   (`vx_gemm_panels_avx2`), and its sums are that GEMM's, bit for bit: one FMA chain per output
   over k in order. Prompts and batches from five rows take the panels, so a row's outputs are
   the same bits whatever the row count of its step (speculation's verify rows score as one-row
   steps do). One block's decode (~9 vector operations per 32 weights) serves every row of the
   call; measured on the forced x86-64-v3 build (Sapphire Rapids, SmolLM2's 120 layer shapes),
   one and two rows ahead of the row-major compact copy in `vx_gemv_bf16_avx2`'s order, three
   and four rows ahead of that skinny GEMM (`bench/avx2_rows.py`).

   Layout (`vx.gpu.cpu.compact.pack_compact` of `panel_order(W)`): per panel of 16 outputs, per
   pair of k, one block of 32 values: the 16 outputs' weights at k even, then at k odd. Blocks
   are 48 bytes, panels contiguous ([N / 16, K / 2, 48]), and one byte per block in Hb
   ([N / 16, K / 2]). A bf16 value is s:1 e:8 m:7. Its low byte, (e & 1) << 7 | m, is stored as
   is (bytes 0-31 of the block, in the order below); its high byte, s << 7 | e >> 1, as a 4-bit
   code s << 3 | d, where d = hb - (e >> 1) and hb, the block's largest e >> 1, is its Hb byte
   (the codes of bytes j and j + 16 share byte 32 + j, low nibble first). A block whose d would
   pass 7 (a zero or a far smaller value beside large ones) is stored raw instead: Hb 0xFF, its
   32 bf16 values in block order in `raw`, their index there an int32 at byte 32.

   Decoding a block: one 16-entry byte table per hb (vx_compact_tab, 4 KiB) turns the codes into
   high bytes with one vpshufb; byte unpacks pair them with the low bytes into bf16 words and
   widen those into fp32. The unpacks work within 128-bit lanes, so byte j holds value
   8 ((j & 15) >> 2) + (j & 3) + 4 (j >> 4) of the block: the four vectors come out in block
   order, f[0] and f[1] the panel's 16 outputs at k even, f[2] and f[3] at k odd. */
#include "vx_kernels.h"
#define VX_COMPACT_MAX_ROWS 4  /* from five rows: the panel GEMM itself */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* vx_compact_tab[32 h + q] (both 16-byte halves alike): the high byte of code q & 15 in a
   block whose largest e >> 1 is h: (q & 8) << 4 | (h - (q & 7)). */
static uint8_t vx_compact_tab[128 * 32] __attribute__((aligned(64)));
__attribute__((constructor)) static void vx_compact_tab_init(void) {
    for (int h = 0; h < 128; h++)
        for (int q = 0; q < 32; q++)
            vx_compact_tab[h * 32 + q] = (uint8_t)(((q & 8) << 4) | ((h - (q & 7)) & 0x7F));
}
/* A block's 32 values: f[t] = values 8 t .. 8 t + 7 as fp32, exactly the bf16 values. */
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
#ifndef VX_COMPACT_PFD
#define VX_COMPACT_PFD 16  /* blocks ahead a panel's stream is prefetched */
#endif
/* G panels' outputs (16 each, blocks contiguous from blk: [G][K / 2][48], their Hb bytes from
   hb: [G][K / 2]) for MR rows of xf (fp32, row stride K), plus the bias (16 G values or NULL),
   rounded into y's rows (stride y_st). Block i of a panel decodes into f[0] = the panel's 8
   first outputs' weights at k = 2 i, f[1] its 8 last, f[2] and f[3] the same at k = 2 i + 1,
   and each row's sums take them as `vx_avx2_panel_tile` takes its panel's words: per output
   one FMA chain over k in order, so the sums, the bias and the rounding are the panel GEMM's
   bit for bit. */
static inline __attribute__((always_inline)) void vx_compact_panel_tile(
        const float* xf, int64_t K, const uint8_t* blk, const uint8_t* hb, const vx_bf16* raw,
        const int MR, const int G, const vx_bf16* bias, vx_bf16* y, int64_t y_st) {
    __m256 c[4][4][2];
    const int64_t kp = K / 2;
    for (int i = 0; i < MR; i++)
        for (int g = 0; g < G; g++) c[i][g][0] = c[i][g][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < kp; b++) {
        for (int g = 0; g < G; g++) {
            /* each panel's stream VX_COMPACT_PFD blocks ahead (past its end: the next panel's
               start, the next item's for the last panel) */
            _mm_prefetch((const char*)(blk + (g * kp + b + VX_COMPACT_PFD) * 48), _MM_HINT_T0);
            __m256 f[4];
            vx_compact_decode(blk + (g * kp + b) * 48, hb[g * kp + b], raw, f);
            for (int i = 0; i < MR; i++) {
                const __m256 a = _mm256_broadcast_ss(xf + i * K + 2 * b);
                c[i][g][0] = _mm256_fmadd_ps(a, f[0], c[i][g][0]);
                c[i][g][1] = _mm256_fmadd_ps(a, f[1], c[i][g][1]);
            }
            for (int i = 0; i < MR; i++) {
                const __m256 a = _mm256_broadcast_ss(xf + i * K + 2 * b + 1);
                c[i][g][0] = _mm256_fmadd_ps(a, f[2], c[i][g][0]);
                c[i][g][1] = _mm256_fmadd_ps(a, f[3], c[i][g][1]);
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
/* Panels an item: enough independent FMA chains to cover the FMA latency at one row. */
#define VX_COMPACT_G1 4
#define VX_COMPACT_G2 2
/* y = x @ W.T + bias for 1 to VX_COMPACT_MAX_ROWS rows of x (bf16, row stride x_st) and W's
   compact copy in panel order (W, Hb, raw as above): `vx_gemm_panels_avx2`'s outputs, bit for
   bit. N % 16 == 0, K even. Parallel over items of a few panels, with stealing (`vx_ws`). */
int vx_gemv_compact_avx2(const vx_bf16* x, int64_t x_st, int M, const uint8_t* W,
                         const uint8_t* Hb, const vx_bf16* raw, const vx_bf16* bias, vx_bf16* y,
                         int64_t y_st, int64_t N, int64_t K) {
    if (M < 1 || M > VX_COMPACT_MAX_ROWS || K < 2 || K % 2 || N < 16 || N % 16) return -1;
    float* xf = vx_avx2_widen_x(x, x_st, M, K);
    if (!xf) return -3;
    const int64_t panels = N / 16, kp = K / 2;
    const int G = M == 1 ? VX_COMPACT_G1 : M == 2 ? VX_COMPACT_G2 : 1;
    const int64_t items = (panels + G - 1) / G;
    const int par = N * K >= 262144;
    vx_ws ws;
    vx_ws_init(&ws, items, par);
    _Pragma("omp parallel if (par)")
    for (int64_t it; (it = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
        const int64_t p0 = it * G, np = panels - p0 < G ? panels - p0 : G;
        for (int64_t p = p0; p < p0 + np; p += (np == G ? G : 1)) {
            const uint8_t* blk = W + p * kp * 48;
            const uint8_t* hb = Hb + p * kp;
            const vx_bf16* bp = bias ? bias + p * 16 : NULL;
            vx_bf16* yp = y + p * 16;
            if (np == G && G == 4) vx_compact_panel_tile(xf, K, blk, hb, raw, 1, 4, bp, yp, y_st);
            else if (np == G && G == 2) vx_compact_panel_tile(xf, K, blk, hb, raw, 2, 2, bp, yp, y_st);
            else switch (M) {
            case 1: vx_compact_panel_tile(xf, K, blk, hb, raw, 1, 1, bp, yp, y_st); break;
            case 2: vx_compact_panel_tile(xf, K, blk, hb, raw, 2, 1, bp, yp, y_st); break;
            case 3: vx_compact_panel_tile(xf, K, blk, hb, raw, 3, 1, bp, yp, y_st); break;
            default: vx_compact_panel_tile(xf, K, blk, hb, raw, 4, 1, bp, yp, y_st); break;
            }
        }
    }
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
