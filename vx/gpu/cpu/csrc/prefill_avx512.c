/* The CPU prefill attention's items on AVX512-BF16 without AMX (Zen 4 and 5,
   Cooper Lake, Sapphire Rapids with its tiles off), built into the same library as the other
   kernels: vx_kernels.c includes it between prefill_amx.c's helpers and its
   entry point `vx_prefill_attention_bf16`, which packs K and V and hands out the items.

   Runs in: the Worker process. */

/* `vx_pf_item_dp`: one item (32 queries of up to 4 query heads that share a kv head, rows
   [t0, t0 + m) of a chunk), flash style over the item's keys 256 at a time, as the AMX items
   do, with the products on `vdpbf16ps` register tiles over the same packed layouts
   (`vx_pf_pack`): a K^T tile's row j holds 16 keys' dims (2j, 2j + 1), so one query's dim
   pair broadcast against it adds two products to 16 scores; a V tile's row j holds keys
   (2j, 2j + 1) of 16 dims, so one query's probability pair broadcast against it adds two
   terms to 16 outputs.
   - S = Q K^T: 8 query rows by 32 keys (16 accumulators), 10 loads per 16 products;
   - softmax: `vx_pf_softmax16` (running max, exp, bf16 probabilities, sums), 16 rows a call;
   - O = O * corr + P V in one pass: 4 rows by 4 16-dim slices (16 accumulators, 8 loads per
     16 products) start from the rescaled running output, so no chunk product is stored apart.
   Rows past the item's queries are computed only up to the next 16 (their queries are zero,
   their scores finite) and never stored. The arithmetic is the AMX items' up to fp32
   summation order: probabilities rounded to bf16, fp32 accumulation, output rounded once. */
#include "vx_kernels.h"
#if defined(VX_PF_512)
#define VX_PF_DP_ROWS 8192  /* an item's Q and output scratch in elements: heads x 32 x D */
/* S rows [0, 8) (qb: row stride ldq bf16) against the 32 keys of one packed pair (kp: its
   two 16-key groups of DV K^T tiles) into s (row stride lds floats): keys 0-15, 16-31. */
VX_INLINE void vx_pf_dp_s8(const vx_bf16* qb, int ldq, const uint32_t* kp, int DV, float* s,
                           int lds) {
    __m512 a[8], b[8];
    for (int r = 0; r < 8; r++) a[r] = b[r] = _mm512_setzero_ps();
    const int32_t* qd = (const int32_t*)qb;
    const int qdl = ldq / 2;
    for (int sl = 0; sl < DV; sl++) {
        const uint32_t* k0 = kp + (int64_t)sl * 256;
        const uint32_t* k1 = kp + (int64_t)(DV + sl) * 256;
        for (int j = 0; j < 16; j++) {
            const __m512bh x0 = (__m512bh)_mm512_load_si512((const void*)(k0 + 16 * j));
            const __m512bh x1 = (__m512bh)_mm512_load_si512((const void*)(k1 + 16 * j));
            for (int r = 0; r < 8; r++) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32(qd[r * qdl + 16 * sl + j]);
                a[r] = _mm512_dpbf16_ps(a[r], qv, x0);
                b[r] = _mm512_dpbf16_ps(b[r], qv, x1);
            }
        }
    }
    for (int r = 0; r < 8; r++) {
        _mm512_store_ps(s + (int64_t)r * lds, a[r]);
        _mm512_store_ps(s + (int64_t)r * lds + 16, b[r]);
    }
}
/* Output rows [0, 4) (acc: row stride lda floats), dim slices [c0, c0 + NS) of 16:
   acc = acc * corr + P V over np packed pairs of keys (pb: the rows' bf16 probabilities,
   row stride VX_PCH; vt: pair 0's V tiles, pair p at p * pair_dw). */
VX_INLINE void vx_pf_dp_pv4(const vx_bf16* pb, const uint32_t* vt, int64_t pair_dw, int np,
                            float* acc, int lda, const float* corr, int c0, const int NS) {
    __m512 o[4][4];
    for (int r = 0; r < 4; r++) {
        const __m512 cv = _mm512_set1_ps(corr[r]);
        for (int c = 0; c < NS; c++)
            o[r][c] = _mm512_mul_ps(_mm512_load_ps(acc + r * lda + 16 * (c0 + c)), cv);
    }
    const int32_t* pd = (const int32_t*)pb;
    for (int p = 0; p < np; p++) {
        const uint32_t* v = vt + p * pair_dw + (int64_t)c0 * 256;
        for (int j = 0; j < 16; j++) {
            __m512bh x[4];
            for (int c = 0; c < NS; c++)
                x[c] = (__m512bh)_mm512_load_si512((const void*)(v + c * 256 + 16 * j));
            for (int r = 0; r < 4; r++) {
                const __m512bh pv = (__m512bh)_mm512_set1_epi32(pd[r * (VX_PCH / 2) + 16 * p + j]);
                for (int c = 0; c < NS; c++) o[r][c] = _mm512_dpbf16_ps(o[r][c], pv, x[c]);
            }
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < NS; c++) _mm512_store_ps(acc + r * lda + 16 * (c0 + c), o[r][c]);
}
/* One item: GH (<= VX_PF_GH, GH * 32 * D <= VX_PF_DP_ROWS) query heads sharing one kv head
   (q and out: head g at g * q_sh, g * o_sh), rows [t0, t0 + m) of a chunk with nc cached
   tokens before it, m <= 32; packed: the kv head's packed pairs from key 0. */
static void vx_pf_item_dp(const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out,
                          int64_t o_st, int64_t o_sh, int GH, const uint32_t* packed, int nc,
                          int t0, int m, float scale, int DV, int W, float cin, float cout) {
    const int D = 32 * DV, ND = D / 16, rows = m > 16 ? 32 : 16;
    vx_bf16 qb[VX_PF_DP_ROWS] __attribute__((aligned(64)));
    float acc[VX_PF_DP_ROWS] __attribute__((aligned(64)));
    float sb[32][VX_PCH] __attribute__((aligned(64)));
    vx_bf16 pb[32][VX_PCH] __attribute__((aligned(64)));
    float mx[VX_PF_GH][32] __attribute__((aligned(64))), sum[VX_PF_GH][32];
    float corr[32] __attribute__((aligned(64)));
    for (int g = 0; g < GH; g++)
        vx_pf_init(qb + g * 32 * D, D, acc + g * 32 * D, D, mx[g], sum[g], 32, q + g * q_sh,
                   q_st, t0, m, D);
    const int kv_end = nc + t0 + m;
    const int64_t pair_dw = (int64_t)4 * DV * 256;  /* dwords per 32 packed keys */
    const __m512 sv = _mm512_set1_ps(scale * 1.44269504088896341f);
    for (int c0 = vx_pf_first(nc + t0, W); c0 < kv_end; c0 += VX_PCH) {
        const int cnt = kv_end - c0 < VX_PCH ? kv_end - c0 : VX_PCH, np = (cnt + 31) / 32;
        const uint32_t* kc0 = packed + (int64_t)(c0 / 32) * pair_dw;
        for (int hg = 0; hg < GH; hg++) {
            const vx_bf16* qh = qb + hg * 32 * D;
            float* ah = acc + hg * 32 * D;
            for (int r0 = 0; r0 < rows; r0 += 8)
                for (int p = 0; p < np; p++)
                    vx_pf_dp_s8(qh + r0 * D, D, kc0 + p * pair_dw, DV, &sb[r0][32 * p], VX_PCH);
            for (int h = 0; h < rows; h += 16)
                vx_pf_softmax16(sb + h, pb + h, mx[hg] + h, sum[hg] + h, corr + h,
                                nc + t0 + h + 1 - c0, vx_pf_lo(nc + t0 + h - c0, W), cnt, np,
                                sv, cin, cout);
            for (int r0 = 0; r0 < rows; r0 += 4) {
                int c = 0;
                for (; c + 4 <= ND; c += 4)
                    vx_pf_dp_pv4(&pb[r0][0], kc0 + 2 * DV * 256, pair_dw, np, ah + r0 * D, D,
                                 corr + r0, c, 4);
                if (c < ND)  /* ND is even */
                    vx_pf_dp_pv4(&pb[r0][0], kc0 + 2 * DV * 256, pair_dw, np, ah + r0 * D, D,
                                 corr + r0, c, 2);
            }
        }
    }
    for (int g = 0; g < GH; g++)
        vx_pf_store(acc + g * 32 * D, D, sum[g], out + g * o_sh, o_st, t0, m, D);
}
#endif
