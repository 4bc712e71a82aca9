/* The bf16 decode attention for CPUs with AVX2 and no AVX-512.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library and hands it
   out as the "fast" bf16 decode kernel where it was built).

   Why it exists: the portable kernel (decode_attention.c) widens every K and V row to
   fp32 in a scratch row and reduces one dot product per (key, head) to a scalar, which the
   compiler vectorises poorly: it was a large share of a SmolLM2 decode step at 64 requests x
   256 keys on a 2-core AVX2 EPYC. Here the q.k products run in register tiles of 4 keys x
   up to 3 query heads (each K row widened from bf16 as it is loaded, once for the tile's heads),
   reduced with horizontal adds; the softmax uses an 8-lane exp; P V runs in tiles of up to 3
   heads x 32 dims whose sums stay in registers over a block's keys; and the next block is
   prefetched while the current one is computed. The tiles replaced a scratch copy of each K
   block in fp32 and P V sums kept in memory (a load and a store per product): the same bits
   in less time (measured with `bench/attention.py` on a 2-core Zen 3, from 1 to 64 requests).

   Same arguments and layout as the portable kernel: one item per (request, kv head), scores for
   the item's G query heads over the whole context, then P V. fp32 throughout, one bf16 rounding
   per output; normalisation by the sum at the end (the portable kernel normalises P first).
   With a `window`, only keys [len - window, len) count: q.k starts at their first block, P V at
   the first key; with a `softcap`, scores go through cap * tanh(s / cap) first. */
#include "vx_kernels.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define VX_AVX2_ATT_MAX_D 256
#define VX_AVX2_ATT_MAX_BS 64
/* the least (rows x query heads x keys) of a call worth a parallel region */
#define VX_AVX2_ATT_PAR 1024
/* vx_ld8_bf16 and vx_exp8 come with the AVX2 SiLU (eltwise.c). */
/* The 4 horizontal sums of a[0..3], each ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of
   its lanes l (the order of the kernel's earlier 8-key reduction: the same bits). */
static inline __m128 vx_hsum4x4(const __m256* a) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
/* Scores of 4 keys (rows kr[j]) for GN query heads (qf + g D, fp32, scaled): dst[g lp + j].
   Each key's dot product is summed lane-wise over the D / 8 chunks in order, then by
   vx_hsum4x4: the sums the earlier kernel (K widened into a scratch block first) formed.
   GN x 4 sums, GN q vectors and one K vector stay in registers (16 at GN = 3). */
static inline __attribute__((always_inline)) void vx_avx2_qk_tile(
        const float* qf, int D, const vx_bf16* const* kr, int DV, const int GN, float* dst,
        int64_t lp) {
    __m256 a[3][4];
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm256_setzero_ps();
    for (int c = 0; c < DV; c++) {
        __m256 qv[3];
        for (int g = 0; g < GN; g++) qv[g] = _mm256_load_ps(qf + g * D + c * 8);
        for (int j = 0; j < 4; j++) {
            const __m256 kv = vx_ld8_bf16(kr[j] + c * 8);
            for (int g = 0; g < GN; g++) a[g][j] = _mm256_fmadd_ps(qv[g], kv, a[g][j]);
        }
    }
    for (int g = 0; g < GN; g++) _mm_storeu_ps(dst + g * lp, vx_hsum4x4(a[g]));
}
/* acc[g D + c 8 ..] += sum over the block's first smax keys s of p[g lp + s] * V[s] for GN
   query heads and CN chunks of 8 dims, in key order (each sum's additions as before): the
   GN x CN sums stay in registers over the keys, loaded and stored once a block. */
static inline __attribute__((always_inline)) void vx_avx2_pv_tile(
        const vx_bf16* v, int64_t c_ss, int smax, const float* p, int64_t lp, float* acc, int D,
        const int GN, const int CN) {
    __m256 a[3][4];
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CN; c++) a[g][c] = _mm256_load_ps(acc + g * D + c * 8);
    for (int s = 0; s < smax; s++) {
        __m256 pv[3];
        for (int g = 0; g < GN; g++) pv[g] = _mm256_broadcast_ss(p + g * lp + s);
        for (int c = 0; c < CN; c++) {
            const __m256 vr = vx_ld8_bf16(v + s * c_ss + c * 8);
            for (int g = 0; g < GN; g++) a[g][c] = _mm256_fmadd_ps(pv[g], vr, a[g][c]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int c = 0; c < CN; c++) _mm256_store_ps(acc + g * D + c * 8, a[g][c]);
}
/* cap * tanh(s / cap) on n scores in place (8 lanes at a time from vx_exp8: (1 - e^-2|x|) /
   (1 + e^-2|x|) with x's sign; the tail scalar). */
static void vx_softcap_avx2(float* s, int n, float cap) {
    const __m256 c = _mm256_set1_ps(cap), ic = _mm256_set1_ps(1.f / cap), one = _mm256_set1_ps(1.f);
    const __m256 sign = _mm256_set1_ps(-0.f);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), ic);
        const __m256 e = vx_exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.f)));
        const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign, x)), c));
    }
    for (; j < n; j++) s[j] = cap * tanhf(s[j] / cap);
}
static inline void vx_prefetch_block(const vx_bf16* p, int rows, int64_t c_ss, int D) {
    for (int s = 0; s < rows; s++)
        for (int d = 0; d < D; d += 32) _mm_prefetch((const char*)(p + s * c_ss + d), _MM_HINT_T0);
}
/* Block n of a request's row of the block table in c (one kv head's cache), with block n + 1
   prefetched while block n is computed. */
static inline const vx_bf16* vx_avx2_block(const vx_bf16* c, const int32_t* row_bt, int n,
                                           int nblk, int64_t c_sb, int BS, int64_t c_ss, int D) {
    if (n + 1 < nblk) vx_prefetch_block(c + (int64_t)row_bt[n + 1] * c_sb, BS, c_ss, D);
    return c + (int64_t)row_bt[n] * c_sb;
}
int vx_decode_attention_bf16_avx2(
        const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh,
        const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss,
        const int32_t* bt, int64_t bt_s, const int32_t* lens,
        int B, int Hq, int Hkv, int D, int BS, float scale, int max_len, int window,
        float softcap) {
    if (D % 8 || D > VX_AVX2_ATT_MAX_D || BS > VX_AVX2_ATT_MAX_BS || Hq % Hkv || Hq / Hkv > 64)
        return -2;
    const int G = Hq / Hkv, DV = D / 8;
    int failed = 0;
    vx_ws ws;
    /* Parallel from one row up (it was serial below 8,192 rows x kv heads x keys): SmolLM2's
       one row at 192 keys (3 items) already takes less time on 2 threads, and so do longer
       contexts and more rows (2-core Zen 3, `bench/attention.py`): the region's cost is small
       against a layer's work. */
    const int par = B * Hkv >= 2 && (int64_t)B * Hq * max_len >= VX_AVX2_ATT_PAR;
    vx_ws_init(&ws, (int64_t)B * Hkv, par);
    _Pragma("omp parallel if (par) reduction(| : failed)") {
    const int ml = max_len > 0 ? max_len : 1;
    float* sc = (float*)aligned_alloc(32, sizeof(float) * (((size_t)G * (size_t)(ml + 8) + 7) & ~(size_t)7));
    float* qf = (float*)aligned_alloc(32, sizeof(float) * (size_t)G * D);
    float* acc = (float*)aligned_alloc(32, sizeof(float) * (size_t)G * D);
    if (!sc || !qf || !acc) failed = 1;
    else for (int64_t w; (w = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
        const int b = (int)(w / Hkv), h = (int)(w % Hkv), len = lens[b];
        const int nblk = (len + BS - 1) / BS, lp = len + 8;  /* sc row stride */
        const int lo = window > 0 && len > window ? len - window : 0, n0 = lo / BS;
        const int32_t* row_bt = bt + b * bt_s;
        for (int g = 0; g < G; g++) {
            const vx_bf16* qr = q + b * q_st + (int64_t)(h * G + g) * q_sh;
            for (int d = 0; d < D; d++) qf[g * D + d] = ld_bf16(qr[d]) * scale;
        }
        /* S = q K^T in tiles of 4 keys x up to 3 query heads (vx_avx2_qk_tile), each K row
           widened as it is read; keys past smax repeat the block's last one (their scores lie
           past len and are never read). */
        for (int n = n0; n < nblk; n++) {
            const vx_bf16* kb = vx_avx2_block(kc + h * c_sh, row_bt, n, nblk, c_sb, BS, c_ss, D);
            const int smax = (len - n * BS) < BS ? (len - n * BS) : BS;
            for (int s0 = 0; s0 < smax; s0 += 4) {
                const vx_bf16* kr[4];
                for (int j = 0; j < 4; j++)
                    kr[j] = kb + (int64_t)(s0 + j < smax ? s0 + j : smax - 1) * c_ss;
                for (int g0 = 0; g0 < G; g0 += 3) {
                    const float* qg = qf + g0 * D;
                    float* dst = sc + (int64_t)g0 * lp + n * BS + s0;
                    switch (G - g0) {
                    case 1: vx_avx2_qk_tile(qg, D, kr, DV, 1, dst, lp); break;
                    case 2: vx_avx2_qk_tile(qg, D, kr, DV, 2, dst, lp); break;
                    default: vx_avx2_qk_tile(qg, D, kr, DV, 3, dst, lp); break;
                    }
                }
            }
        }
        /* Softmax numerators and sums (the tail past len is never read). */
        float inv[64];  /* G <= 64 */
        for (int g = 0; g < G; g++) {
            float* sg = sc + (int64_t)g * lp;
            if (softcap > 0.f) vx_softcap_avx2(sg + lo, len - lo, softcap);
            float m = sg[lo];
            for (int j = lo + 1; j < len; j++) m = sg[j] > m ? sg[j] : m;
            const __m256 mv = _mm256_set1_ps(m);
            __m256 sv = _mm256_setzero_ps();
            int j = lo;
            for (; j + 8 <= len; j += 8) {
                const __m256 e = vx_exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv));
                _mm256_storeu_ps(sg + j, e);
                sv = _mm256_add_ps(sv, e);
            }
            float sum = 0.f, t8[8];
            _mm256_storeu_ps(t8, sv);
            for (int i = 0; i < 8; i++) sum += t8[i];
            for (; j < len; j++) { sg[j] = vx_expf(sg[j] - m); sum += sg[j]; }
            inv[g] = 1.f / sum;
        }
        /* O = P V in tiles of up to 3 query heads x 32 dims (vx_avx2_pv_tile), their sums in
           registers over a block's keys. */
        for (int i = 0; i < G * D; i++) acc[i] = 0.f;
        for (int n = n0; n < nblk; n++) {
            const vx_bf16* vb0 = vx_avx2_block(vc + h * c_sh, row_bt, n, nblk, c_sb, BS, c_ss, D);
            const int s0 = n * BS < lo ? lo - n * BS : 0;  /* the window's first key */
            const vx_bf16* vb = vb0 + s0 * c_ss;
            const int smax = ((len - n * BS) < BS ? (len - n * BS) : BS) - s0;
            for (int c0 = 0; c0 < DV; c0 += 4)
                for (int g0 = 0; g0 < G; g0 += 3) {
                    const float* p = sc + (int64_t)g0 * lp + n * BS + s0;
                    float* a = acc + g0 * D + c0 * 8;
                    const int gn = G - g0 < 3 ? G - g0 : 3, cn = DV - c0 < 4 ? DV - c0 : 4;
                    switch (gn * 4 + cn) {
#define VX_PV(GN, CN) case GN * 4 + CN: \
    vx_avx2_pv_tile(vb + c0 * 8, c_ss, smax, p, lp, a, D, GN, CN); break;
                    VX_PV(1, 1) VX_PV(1, 2) VX_PV(1, 3) VX_PV(1, 4)
                    VX_PV(2, 1) VX_PV(2, 2) VX_PV(2, 3) VX_PV(2, 4)
                    VX_PV(3, 1) VX_PV(3, 2) VX_PV(3, 3) default: VX_PV(3, 4)
#undef VX_PV
                    }
                }
        }
        for (int g = 0; g < G; g++) {
            vx_bf16* orow = out + b * o_st + (int64_t)(h * G + g) * o_sh;
            const float iv = inv[g];
            for (int d = 0; d < D; d++) orow[d] = st_bf16(len > 0 ? acc[g * D + d] * iv : 0.f);
        }
    }
    free(sc); free(qf); free(acc);
    }
    return failed ? -1 : 0;
}
int vx_has_avx2_attention(void) { return 1; }
#else
int vx_decode_attention_bf16_avx2(
        const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh,
        const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss,
        const int32_t* bt, int64_t bt_s, const int32_t* lens,
        int B, int Hq, int Hkv, int D, int BS, float scale, int max_len, int window,
        float softcap) {
    (void)window; (void)softcap; (void)q; (void)q_st; (void)q_sh; (void)out; (void)o_st; (void)o_sh; (void)kc; (void)vc;
    (void)c_sh; (void)c_sb; (void)c_ss; (void)bt; (void)bt_s; (void)lens; (void)B; (void)Hq;
    (void)Hkv; (void)D; (void)BS; (void)scale; (void)max_len;
    return -2;
}
int vx_has_avx2_attention(void) { return 0; }
#endif
