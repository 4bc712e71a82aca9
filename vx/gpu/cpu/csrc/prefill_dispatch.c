/* The CPU prefill attention's entry point: the chunks of a step to AMX's kernel
   (prefill_amx.c), AVX512-BF16's (prefill_avx512.c) or AVX2's (prefill_avx2.c). */

/* The entry point, after prefill_avx512.c (the items without AMX). */
#include "vx_kernels.h"
int vx_prefill_attention_bf16(
        const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh,
        const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss,
        const int32_t* bt, int64_t bt_s, const int32_t* starts, const int32_t* lens,
        const int32_t* computed, int nchunks, int Hq, int Hkv, int D, int BS, float scale,
        int window, float softcap) {
#ifdef VX_PF_512
    if (D % 32 || D > 256 || Hkv < 1 || Hq % Hkv || nchunks < 1) return -2;
#ifdef VX_HAS_AMX
    const int amx = vx_amx_on;
#else
    const int amx = 0;
#endif
    const int G = Hq / Hkv, DV = D / 32;
    /* query rows per item: 32 (vx_pf_item32, vx_pf_item_dp) where it applies, else 16 */
    const int QR = !amx || DV <= 2 ? 32 : 16;
    /* each kv head's G query heads in NGR groups of at most GH heads an item (vx_pf_item32
       up to VX_PF_GH; vx_pf_item_dp as many as its scratch holds; vx_pf_item one) */
    const int GHM = !amx ? (VX_PF_DP_ROWS / (32 * D) < VX_PF_GH ? VX_PF_DP_ROWS / (32 * D) : VX_PF_GH)
                         : QR == 32 ? VX_PF_GH : 1;
    const int NGR = (G + GHM - 1) / GHM, GH = (G + NGR - 1) / NGR;
    const int HI = Hkv * NGR;  /* (kv head, head group) pairs */
    const int64_t pair_dw = (int64_t)4 * DV * 256;
    const float cin = softcap > 0.f ? scale / softcap : 0.f, cout = softcap > 0.f ? softcap / scale : 0.f;
    /* chunk i's first packed pair: the one its first query's window starts in */
#define VX_PF_P0(i) (vx_pf_first(computed[i], window) / 32)
    /* per chunk: first packed pair group, first work item */
    int64_t* pg0 = (int64_t*)malloc(sizeof(int64_t) * (size_t)(2 * nchunks + 2));
    if (!pg0) return -1;
    int64_t* it0 = pg0 + nchunks + 1;
    pg0[0] = it0[0] = 0;
    for (int i = 0; i < nchunks; i++) {
        pg0[i + 1] = pg0[i] + (int64_t)Hkv * ((computed[i] + lens[i] + 31) / 32 - VX_PF_P0(i));
        it0[i + 1] = it0[i] + (int64_t)HI * ((lens[i] + QR - 1) / QR);
    }
    uint32_t* packed = (uint32_t*)aligned_alloc(64, (size_t)pg0[nchunks] * pair_dw * 4 + 64);
    if (!packed) { free(pg0); return -1; }
    const int64_t npg = pg0[nchunks], nit = it0[nchunks];
    _Pragma("omp parallel") {
    _Pragma("omp for schedule(static)")
    for (int64_t w = 0; w < npg; w++) {
        int i = 0;
        while (pg0[i + 1] <= w) i++;
        const int ctx = computed[i] + lens[i], p0 = VX_PF_P0(i), per = (ctx + 31) / 32 - p0;
        const int h = (int)((w - pg0[i]) / per), pg = p0 + (int)((w - pg0[i]) % per);
        const int kfirst = window > 0 && computed[i] - window + 1 > 0 ? computed[i] - window + 1 : 0;
        vx_pf_pack(packed + w * pair_dw, kc + h * c_sh, vc + h * c_sh, bt + i * bt_s, c_sb,
                   c_ss, BS, ctx, pg, DV, kfirst);
    }
#ifdef VX_HAS_AMX
    if (amx) vx_amx_load_tiles(8);
#endif
    _Pragma("omp for schedule(dynamic, 1)")
    for (int64_t w = 0; w < nit; w++) {
        int i = 0;
        while (it0[i + 1] <= w) i++;
        const int nq = (lens[i] + QR - 1) / QR;
        /* the last query tile (most keys) of each head first */
        const int qt = nq - 1 - (int)((w - it0[i]) / HI), hi = (int)((w - it0[i]) % HI);
        const int h = hi / NGR, hq = h * G + (hi % NGR) * GH;
        const int gh = G - (hi % NGR) * GH < GH ? G - (hi % NGR) * GH : GH, t0 = QR * qt;
        const int m = lens[i] - t0 < QR ? lens[i] - t0 : QR;
        const int ctx = computed[i] + lens[i], p0 = VX_PF_P0(i);
        /* addressed by absolute pair index (the items index pairs by key / 32): pairs before
           p0 are never read */
        const uint32_t* pk = packed + (pg0[i] + (int64_t)h * ((ctx + 31) / 32 - p0) - p0) * pair_dw;
        const vx_bf16* qr = q + (int64_t)starts[i] * q_st + (int64_t)hq * q_sh;
        vx_bf16* orow = out + (int64_t)starts[i] * o_st + (int64_t)hq * o_sh;
        if (!amx) {
            vx_pf_item_dp(qr, q_st, q_sh, orow, o_st, o_sh, gh, pk, computed[i], t0, m,
                          scale, DV, window, cin, cout);
            continue;
        }
#ifdef VX_HAS_AMX
#define VX_PF_ITEM(N) vx_pf_item(qr, q_st, orow, o_st, pk, computed[i], t0, m, scale, N, window, \
                                 cin, cout)
        if (QR == 32) {
            if (DV == 1)
                vx_pf_item32(qr, q_st, q_sh, orow, o_st, o_sh, gh, pk, computed[i], t0, m,
                             scale, 1, window, cin, cout);
            else
                vx_pf_item32(qr, q_st, q_sh, orow, o_st, o_sh, gh, pk, computed[i], t0, m,
                             scale, 2, window, cin, cout);
        } else
        switch (DV) {  /* one specialisation per D, so loops over D unroll */
        case 3: VX_PF_ITEM(3); break; case 4: VX_PF_ITEM(4); break;
        default: VX_PF_ITEM(DV); break;
        }
#undef VX_PF_ITEM
#endif
    }
#ifdef VX_HAS_AMX
    if (amx) _tile_release();
#endif
    }
    free(packed);
    free(pg0);
#undef VX_PF_P0
    return 0;
#elif defined(VX_PFA_AVX2)  /* prefill_avx2.c */
    return vx_prefill_attention_bf16_avx2(q, q_st, q_sh, out, o_st, o_sh, kc, vc, c_sh, c_sb,
                                          c_ss, bt, bt_s, starts, lens, computed, nchunks, Hq,
                                          Hkv, D, BS, scale, window, softcap);
#else
    (void)q; (void)q_st; (void)q_sh; (void)out; (void)o_st; (void)o_sh; (void)kc; (void)vc;
    (void)c_sh; (void)c_sb; (void)c_ss; (void)bt; (void)bt_s; (void)starts; (void)lens;
    (void)computed; (void)nchunks; (void)Hq; (void)Hkv; (void)D; (void)BS; (void)scale;
    (void)window; (void)softcap;
    return -2;
#endif
}
/* Which prefill kernel `vx_prefill_attention_bf16` runs now: 1 AMX, 2 AVX2, 3 AVX512-BF16
   without AMX (prefill_avx512.c), 0 none. */
int vx_has_prefill_attention(void) {
#if defined(VX_HAS_AMX)
    return vx_amx_on ? 1 : 3;
#elif defined(VX_PF_512)
    return 3;
#elif defined(VX_PFA_AVX2)
    return 2;
#else
    return 0;
#endif
}
