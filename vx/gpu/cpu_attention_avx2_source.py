"""The C source of the bf16 decode attention for CPUs with AVX2 and no AVX-512.

Runs in: the Worker process (`vx.gpu.kv_cache` builds it into the kernel library and hands it
out as the "fast" bf16 decode kernel where it was built).

Why it exists: the portable kernel (`vx.gpu.cpu_kernel_source`) widens every K and V row to
fp32 in a scratch row and reduces one dot product per (key, head) to a scalar, which the
compiler vectorises poorly: a SmolLM2 decode step at 64 requests x 256 keys spent ~80 of its
~290 ms there on a 2-core AVX2 EPYC. Here each 16-key block of K is widened once into L1 and
shared by the item's G query heads, eight keys' dot products are reduced together with
horizontal adds, the softmax uses an 8-lane exp, and the next block is prefetched while the
current one is computed.

Same arguments and layout as the portable kernel: one item per (request, kv head), scores for
the item's G query heads over the whole context, then P V. fp32 throughout, one bf16 rounding
per output; normalisation by the sum at the end (the portable kernel normalises P first).
"""

from __future__ import annotations

ATTENTION_AVX2_SOURCE = r"""
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define VX_AVX2_ATT_MAX_D 256
#define VX_AVX2_ATT_MAX_BS 64
/* the least (rows x query heads x keys) of a call worth a parallel region */
#define VX_AVX2_ATT_PAR 1024
/* vx_ld8_bf16 and vx_exp8 come with the AVX2 SiLU (`vx.gpu.cpu_eltwise_source`). */
/* The 8 horizontal sums of a[0..7], in order, as one vector. */
static inline __m256 vx_hsum8x8(const __m256* a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 = [0 1 2 3 | 0 1 2 3] halves of the sums (low lanes, high lanes), same for 4-7 */
    const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
    const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
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
        int B, int Hq, int Hkv, int D, int BS, float scale, int max_len) {
    if (D % 8 || D > VX_AVX2_ATT_MAX_D || BS > VX_AVX2_ATT_MAX_BS || Hq % Hkv || Hq / Hkv > 64)
        return -2;
    const int G = Hq / Hkv, DV = D / 8;
    int failed = 0;
    vx_ws ws;
    /* Parallel from one row up (it was serial below 8,192 rows x kv heads x keys): SmolLM2's
       one row at 192 keys (3 items) takes 0.70 of its serial time on 2 threads, at 1,024 keys
       0.65, 4 rows at 192 keys 0.75 (2-core Zen 3, `bench/attention.py`): the region costs a
       few us against ~28 us a layer. */
    const int par = B * Hkv >= 2 && (int64_t)B * Hq * max_len >= VX_AVX2_ATT_PAR;
    vx_ws_init(&ws, (int64_t)B * Hkv, par);
    _Pragma("omp parallel if (par) reduction(| : failed)") {
    const int ml = max_len > 0 ? max_len : 1;
    float* sc = (float*)aligned_alloc(32, sizeof(float) * (((size_t)G * (size_t)(ml + 8) + 7) & ~(size_t)7));
    float* qf = (float*)aligned_alloc(32, sizeof(float) * (size_t)G * D);
    float* acc = (float*)aligned_alloc(32, sizeof(float) * (size_t)G * D);
    float* kf = (float*)aligned_alloc(32, sizeof(float) * (size_t)(BS + 8) * D);
    if (!sc || !qf || !acc || !kf) failed = 1;
    else for (int64_t w; (w = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
        const int b = (int)(w / Hkv), h = (int)(w % Hkv), len = lens[b];
        const int nblk = (len + BS - 1) / BS, lp = len + 8;  /* sc row stride */
        const int32_t* row_bt = bt + b * bt_s;
        for (int g = 0; g < G; g++) {
            const vx_bf16* qr = q + b * q_st + (int64_t)(h * G + g) * q_sh;
            for (int d = 0; d < D; d++) qf[g * D + d] = ld_bf16(qr[d]) * scale;
        }
        /* S = q K^T, a block of K widened once for the G heads. */
        for (int n = 0; n < nblk; n++) {
            const vx_bf16* kb = vx_avx2_block(kc + h * c_sh, row_bt, n, nblk, c_sb, BS, c_ss, D);
            const int smax = (len - n * BS) < BS ? (len - n * BS) : BS;
            const int s8 = (smax + 7) & ~7;
            for (int s = 0; s < s8; s++)
                for (int c = 0; c < DV; c++)
                    _mm256_store_ps(kf + s * D + c * 8,
                                    s < smax ? vx_ld8_bf16(kb + s * c_ss + c * 8) : _mm256_setzero_ps());
            for (int g = 0; g < G; g++) {
                const float* qg = qf + g * D;
                for (int s0 = 0; s0 < s8; s0 += 8) {
                    __m256 a[8];
                    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
                    for (int c = 0; c < DV; c++) {
                        const __m256 qv = _mm256_load_ps(qg + c * 8);
                        for (int j = 0; j < 8; j++)
                            a[j] = _mm256_fmadd_ps(qv, _mm256_load_ps(kf + (s0 + j) * D + c * 8), a[j]);
                    }
                    _mm256_storeu_ps(sc + (int64_t)g * lp + n * BS + s0, vx_hsum8x8(a));
                }
            }
        }
        /* Softmax numerators and sums (the tail past len is never read). */
        float inv[64];  /* G <= 64 */
        for (int g = 0; g < G; g++) {
            float* sg = sc + (int64_t)g * lp;
            float m = sg[0];
            for (int j = 1; j < len; j++) m = sg[j] > m ? sg[j] : m;
            const __m256 mv = _mm256_set1_ps(m);
            __m256 sv = _mm256_setzero_ps();
            int j = 0;
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
        /* O = P V, one V row widened once for the G heads. */
        for (int i = 0; i < G * D; i++) acc[i] = 0.f;
        for (int n = 0; n < nblk; n++) {
            const vx_bf16* vb = vx_avx2_block(vc + h * c_sh, row_bt, n, nblk, c_sb, BS, c_ss, D);
            const int smax = (len - n * BS) < BS ? (len - n * BS) : BS;
            for (int s = 0; s < smax; s++) {
                __m256 vr[VX_AVX2_ATT_MAX_D / 8];
                for (int c = 0; c < DV; c++) vr[c] = vx_ld8_bf16(vb + s * c_ss + c * 8);
                for (int g = 0; g < G; g++) {
                    const __m256 p = _mm256_set1_ps(sc[(int64_t)g * lp + n * BS + s]);
                    float* ag = acc + g * D;
                    for (int c = 0; c < DV; c++)
                        _mm256_store_ps(ag + c * 8, _mm256_fmadd_ps(p, vr[c], _mm256_load_ps(ag + c * 8)));
                }
            }
        }
        for (int g = 0; g < G; g++) {
            vx_bf16* orow = out + b * o_st + (int64_t)(h * G + g) * o_sh;
            const float iv = inv[g];
            for (int d = 0; d < D; d++) orow[d] = st_bf16(len > 0 ? acc[g * D + d] * iv : 0.f);
        }
    }
    free(sc); free(qf); free(acc); free(kf);
    }
    return failed ? -1 : 0;
}
int vx_has_avx2_attention(void) { return 1; }
#else
int vx_decode_attention_bf16_avx2(
        const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh,
        const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss,
        const int32_t* bt, int64_t bt_s, const int32_t* lens,
        int B, int Hq, int Hkv, int D, int BS, float scale, int max_len) {
    (void)q; (void)q_st; (void)q_sh; (void)out; (void)o_st; (void)o_sh; (void)kc; (void)vc;
    (void)c_sh; (void)c_sb; (void)c_ss; (void)bt; (void)bt_s; (void)lens; (void)B; (void)Hq;
    (void)Hkv; (void)D; (void)BS; (void)scale; (void)max_len;
    return -2;
}
int vx_has_avx2_attention(void) { return 0; }
#endif
"""
