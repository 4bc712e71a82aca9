/* A mixture-of-experts layer's expert GEMMs on AVX512-BF16 without AMX (Zen 4 and 5): every
   expert the step touches, its gate-up, the SiLU-mul and its down, in one call and one
   parallel region.

   Runs in: the Worker process (vx_kernels.c includes it after gemm_vnni.c, whose micro-tiles
   `vx_vnni_tile` and `vx_vnni_small_tile` it shares; `vx.gpu.layers.cpu_experts` and the fused
   step call it).

   Why: as experts_amx.c on AMX: per expert and linear one call of the dense GEMMs, with a
   torch SiLU-mul between them, was three parallel regions and a few Python ops per touched
   expert, each region's two threads splitting one expert's panels. Here the panels of every
   touched expert are one list, shared with stealing (`vx_ws`), and the threads meet three
   times a layer (after the gate-ups, after the SiLU-mul, after the downs).

   Layout: xs [*, H] bf16 (row stride H) the rows grouped by expert (`vx_moe_group_bf16`'s
   order: expert e's counts[e] rows from sum(counts[:e])); w13[e] expert e's gate-up ([gate;
   up], 2 I outputs) and w2[e] its down, packed by vx_pack_vnni_bf16; gu [*, 2 I] and act
   [*, I] scratch; ys [*, H] the experts' outputs, in xs's order.

   Invariants: each output is the bits of `vx_gemm_vnni_bf16` on that expert's rows alone, then
   `vx_silu_and_mul_bf16`, then `vx_gemm_vnni_bf16` (the same micro-tiles: zero, `vdpbf16ps`
   over k pairs in order, +0 in fp32, one rounding), whatever the other experts' rows, the
   row count (the small-row tile and the 8-row tile give the same bits) and the thread. */
#include "vx_kernels.h"
#if defined(VX_HAS_FAST_BF16)
#define VX_XV_MAX_E 256  /* experts a layer may have */
/* One linear of every touched expert as a list of items (expert, panel of up to 3 vectors of
   16 outputs), each for all of that expert's rows. */
typedef struct {
    int64_t N, K;
    int64_t first[VX_XV_MAX_E + 1];  /* the touched experts' first items; first[ne]: all */
    int e[VX_XV_MAX_E];   /* the touched experts, in order */
    int64_t row0[VX_XV_MAX_E], rows[VX_XV_MAX_E];  /* their rows in xs */
    int ne;
} vx_xv_plan;
static void vx_xv_plan_init(vx_xv_plan* p, const int64_t* counts, int64_t E, int64_t N,
                            int64_t K) {
    p->N = N; p->K = K; p->ne = 0;
    const int64_t panels = (N / 16 + VX_VN_NR - 1) / VX_VN_NR;
    int64_t at = 0, items = 0;
    for (int64_t e = 0; e < E; e++) {
        if (!counts[e]) continue;
        const int i = p->ne++;
        p->e[i] = (int)e; p->row0[i] = at; p->rows[i] = counts[e]; p->first[i] = items;
        items += panels;
        at += counts[e];
    }
    p->first[p->ne] = items;
}
/* Item `it` of plan p: x's rows of its expert (row stride K) times that expert's packed
   weight w[e] into y (row stride N), outputs of the item's panel. */
static void vx_xv_item(const vx_xv_plan* p, int64_t it, const vx_bf16* x,
                       const uint32_t* const* w, vx_bf16* y) {
    int i = 0;
    while (p->first[i + 1] <= it) i++;
    const int64_t K = p->K, N = p->N, KP = K / 2, bs = KP * 16, NV = N / 16;
    const int64_t v0 = (it - p->first[i]) * VX_VN_NR;
    const int nr = NV - v0 < VX_VN_NR ? (int)(NV - v0) : VX_VN_NR;
    const int M = (int)p->rows[i];
    const vx_bf16* xe = x + p->row0[i] * K;
    vx_bf16* ye = y + p->row0[i] * N + 16 * v0;
    const uint32_t* wp = w[p->e[i]] + v0 * bs;
    if (M <= VX_VN_SMALL) {  /* constant trip counts, so the accumulators stay in registers */
#define VX_XV_S(R, C) vx_vnni_small_tile(xe, K, R, wp, bs, KP, NULL, ye, N, C)
#define VX_XV_SM(R) do { if (nr == 3) VX_XV_S(R, 3); else if (nr == 2) VX_XV_S(R, 2); \
                         else VX_XV_S(R, 1); } while (0)
        switch (M) {
        case 1: VX_XV_SM(1); break;
        case 2: VX_XV_SM(2); break;
        case 3: VX_XV_SM(3); break;
        default: VX_XV_SM(4); break;
        }
#undef VX_XV_SM
#undef VX_XV_S
        return;
    }
    /* the next item's panel (most often this thread's next), prefetched a share per row block
       while this one computes, as vx_vnni_run prefetches its next panel */
    const char* nx = 0;
    int64_t lines = 0;
    if (it + 1 < p->first[p->ne]) {
        const int j = p->first[i + 1] <= it + 1 ? i + 1 : i;
        const int64_t u0 = (it + 1 - p->first[j]) * VX_VN_NR;
        nx = (const char*)(w[p->e[j]] + u0 * bs);
        lines = (NV - u0 < VX_VN_NR ? NV - u0 : VX_VN_NR) * KP;
    }
    const int64_t nrb = (M + VX_VN_MR - 1) / VX_VN_MR, per = (lines + nrb - 1) / nrb;
    const int q = (int)((per + KP - 1) / KP);
    for (int m0 = 0; m0 < M; m0 += VX_VN_MR) {
        const int mr = M - m0 < VX_VN_MR ? M - m0 : VX_VN_MR;
        const vx_bf16* xm = xe + (int64_t)m0 * K;
        vx_bf16* ym = ye + (int64_t)m0 * N;
        const int64_t l0 = (m0 / VX_VN_MR) * per, l1 = l0 + per < lines ? l0 + per : lines;
        /* the first row block streams the panel from memory: prefetched ahead */
#define VX_XV_T(C, P) vx_vnni_tile(xm, K, mr, wp, bs, KP, NULL, ym, N, C, P, nx, l0, l1, q, \
                                   NULL, NULL, 0)
        if (m0 == 0) {
            if (nr == 3) VX_XV_T(3, 1); else if (nr == 2) VX_XV_T(2, 1); else VX_XV_T(1, 1);
        } else {
            if (nr == 3) VX_XV_T(3, 0); else if (nr == 2) VX_XV_T(2, 0); else VX_XV_T(1, 0);
        }
#undef VX_XV_T
    }
}
int vx_moe_experts_vnni(const vx_bf16* xs, const int64_t* counts, int64_t E,
                        const uint32_t* const* w13, const uint32_t* const* w2, int64_t H,
                        int64_t I, vx_bf16* gu, vx_bf16* act, vx_bf16* ys) {
    if (E < 1 || E > VX_XV_MAX_E || H % 16 || I % 16 || H < 16 || I < 16) return -2;
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) n += counts[e];
    if (!n) return 0;
    const int par = n * 3 * I * H >= ((int64_t)1 << 20);
    vx_xv_plan up, down;
    vx_xv_plan_init(&up, counts, E, 2 * I, H);
    vx_xv_plan_init(&down, counts, E, H, I);
    vx_ws ws_up, ws_down;
    vx_ws_init(&ws_up, up.first[up.ne], par);
    vx_ws_init(&ws_down, down.first[down.ne], par);
    _Pragma("omp parallel if (par)") {
        const int t = omp_get_thread_num();
        for (int64_t it; (it = vx_ws_next(&ws_up, t)) >= 0;)
            vx_xv_item(&up, it, xs, w13, gu);
        _Pragma("omp barrier")  /* a row's SiLU-mul reads its gate and its up */
        /* chunks of rows below the function's own parallel threshold (its bits are each
           element's alone) */
        const int64_t c = (65536 - 1) / I > 0 ? (65536 - 1) / I : 1;
        _Pragma("omp for schedule(static)")
        for (int64_t r = 0; r < n; r += c)
            vx_silu_and_mul_bf16(gu + r * 2 * I, 2 * I, act + r * I, n - r < c ? n - r : c, I);
        /* the implicit barrier: a down reads whole rows of act */
        for (int64_t it; (it = vx_ws_next(&ws_down, t)) >= 0;)
            vx_xv_item(&down, it, act, w2, ys);
    }
    return 0;
}
#else
int vx_moe_experts_vnni(const vx_bf16* xs, const int64_t* counts, int64_t E,
                        const uint32_t* const* w13, const uint32_t* const* w2, int64_t H,
                        int64_t I, vx_bf16* gu, vx_bf16* act, vx_bf16* ys) {
    (void)xs; (void)counts; (void)E; (void)w13; (void)w2; (void)H; (void)I; (void)gu;
    (void)act; (void)ys;
    return -2;
}
#endif
