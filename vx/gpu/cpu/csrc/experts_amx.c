/* A mixture-of-experts layer's expert GEMMs on AMX tiles: every expert the step touches, its
   gate-up (with the SiLU-mul in the epilogue) and its down, in one call and one parallel region.

   Runs in: the Worker process (vx_kernels.c includes it after gemm_amx_vnni.c, whose epilogue
   `vx_av_rows` it shares; `vx.gpu.layers.cpu_experts` and the fused step call it).

   Why: per expert and linear one call of the dense GEMMs (`vx_gemm_amx_vnni_silu`, then
   `vx_gemm_amx_vnni`, or at 1-7 rows the skinny GEMMs) was ~320 calls a step of a 20-layer,
   8-expert MoE, each a parallel region of its own, with a few rows an expert (a decode step of
   32 rows routes ~8 an expert): the weights read at ~21 GB/s against ~24 for the dense linears,
   and each region's two threads split one expert's few column blocks. Here the work items of
   every touched expert (a panel of row blocks x a chunk of column pairs) are one list, shared
   with stealing (`vx_ws`), so the threads meet twice a layer (after the gate-ups, after the
   downs), whatever the experts.

   Layout: xs [*, H] bf16 (row stride H) the rows grouped by expert (`vx_moe_group_bf16`'s
   order: expert e's counts[e] rows from sum(counts[:e])); w13[e] expert e's gate-up packed
   with its gate and up rows interleaved by 16 (`VnniWeight(silu=True)`), w2[e] its down packed
   (`VnniWeight(amx=True)`); act [*, I] scratch; ys [*, H] the experts' outputs, in xs's order.
   NOTE: a 32-row block reads whole A tiles, so xs and act must have 32 readable rows past the
   last routed row (their values there are never used: an output row of a tile product depends
   on its own input row alone, and rows past an expert's count are never stored).

   Invariants: each output is the bits of `vx_gemm_amx_vnni_silu` then `vx_gemm_amx_vnni` on
   that expert's rows alone (the same tile products over k in the same order, the same
   epilogue), whatever the other experts' rows and whichever thread computes it. */
#include "vx_kernels.h"
#ifdef VX_HAS_AMX
#define VX_XA_NC_SMALL 4  /* column pairs an item takes at most, up to 2 row blocks */
#define VX_XA_NC 8        /* past them */
#define VX_XA_PM 16       /* 32-row blocks a panel holds at most */
#define VX_XA_MAX_E 256   /* experts a layer may have */
/* One linear of every touched expert as a list of items (e, panel, column chunk). */
typedef struct {
    int64_t N, K;         /* outputs (with silu: 2 I, gate | up) and inputs */
    int silu;
    int64_t first[VX_XA_MAX_E + 1];  /* the touched experts' first items; first[ne]: all */
    int e[VX_XA_MAX_E];   /* the touched experts, in order */
    int64_t row0[VX_XA_MAX_E], rows[VX_XA_MAX_E];  /* their rows in xs */
    int ps[VX_XA_MAX_E];  /* row blocks per panel */
    int64_t nn[VX_XA_MAX_E], nc[VX_XA_MAX_E];  /* column chunks, pairs per chunk */
    int ne;
} vx_xa_plan;
static void vx_xa_plan_init(vx_xa_plan* p, const int64_t* counts, int64_t E, int64_t N,
                            int64_t K, int silu, int nth) {
    p->N = N; p->K = K; p->silu = silu; p->ne = 0;
    const int64_t NB2 = (N / 16 + 1) / 2;
    int64_t at = 0, items = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = counts[e];
        if (!n) continue;
        const int i = p->ne++;
        const int MB2 = (int)((n + 31) / 32);
        int NP = (MB2 + VX_XA_PM - 1) / VX_XA_PM;
        const int PS = (MB2 + NP - 1) / NP;
        NP = (MB2 + PS - 1) / PS;
        const int64_t nc_max = MB2 > 2 ? VX_XA_NC : VX_XA_NC_SMALL;
        int64_t NN = (NB2 + nc_max - 1) / nc_max;
        /* a lone big expert (a prompt's rows): as many items as a multiple of the threads */
        while ((NP * NN) % nth && NN < NB2 && MB2 > 2) NN++;
        const int64_t NC = (NB2 + NN - 1) / NN;
        NN = (NB2 + NC - 1) / NC;
        p->e[i] = (int)e; p->row0[i] = at; p->rows[i] = n; p->ps[i] = PS;
        p->nn[i] = NN; p->nc[i] = NC; p->first[i] = items;
        items += NP * NN;
        at += n;
    }
    p->first[p->ne] = items;
}
/* Item `it` of plan p: expert i's rows x (row stride K) times its packed weight w into y (row
   stride y_st: N, or with silu N / 2). */
static void vx_xa_item(const vx_xa_plan* p, int64_t it, const vx_bf16* x,
                       const uint32_t* const* w, vx_bf16* y, float* c) {
    int i = 0;
    while (p->first[i + 1] <= it) i++;
    const int64_t local = it - p->first[i], K = p->K, N = p->N, KC = K / 32;
    const int64_t NB = N / 16, NB2 = (NB + 1) / 2, y_st = p->silu ? N / 2 : N;
    const int64_t M = p->rows[i];
    const int MB2 = (int)((M + 31) / 32);
    const int mp = (int)(local / p->nn[i]);
    const int64_t ncx = local % p->nn[i];
    const int mb2e = (mp + 1) * p->ps[i] < MB2 ? (mp + 1) * p->ps[i] : MB2;
    const int64_t nb2e = (ncx + 1) * p->nc[i] < NB2 ? (ncx + 1) * p->nc[i] : NB2;
    const int stream = MB2 > 2;  /* as vx_av_run: B tiles past L1 where row blocks repeat */
    const vx_bf16* xe = x + p->row0[i] * K;
    vx_bf16* ye = y + p->row0[i] * y_st;
    const uint32_t* wp = w[p->e[i]];
    for (int mb2 = mp * p->ps[i]; mb2 < mb2e; mb2++) {
        const int m0 = mb2 * 32;
        const int two = M - m0 > 16;  /* the second A tile holds routed rows */
        const vx_bf16* a0 = xe + (int64_t)m0 * K;
        const vx_bf16* a1 = a0 + 16 * K;
        for (int64_t nb2 = ncx * p->nc[i]; nb2 < nb2e; nb2++) {
            const int nt = 2 * nb2 + 1 < NB ? 2 : 1;
            const uint32_t* b0 = wp + (2 * nb2) * KC * 256;
            const uint32_t* b1 = b0 + KC * 256;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t kc = 0; kc < KC; kc++) {
                _tile_loadd(4, a0 + kc * 32, K * 2);
                if (stream) _tile_stream_loadd(6, b0 + kc * 256, 64);
                else _tile_loadd(6, b0 + kc * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (nt == 2) {
                    if (stream) _tile_stream_loadd(7, b1 + kc * 256, 64);
                    else _tile_loadd(7, b1 + kc * 256, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two) {
                    _tile_loadd(5, a1 + kc * 32, K * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (nt == 2) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c, 128);
            if (nt == 2) _tile_stored(1, c + 16, 128);
            if (two) {
                _tile_stored(2, c + 512, 128);
                if (nt == 2) _tile_stored(3, c + 528, 128);
            }
            vx_av_rows(c, ye, y_st, m0, (int)M, 32 * nb2, nt, NULL, p->silu, 0, 32);
        }
    }
}
int vx_moe_experts_amx(const vx_bf16* xs, const int64_t* counts, int64_t E,
                       const uint32_t* const* w13, const uint32_t* const* w2, int64_t H,
                       int64_t I, vx_bf16* act, vx_bf16* ys) {
    if (!vx_amx_on || E < 1 || E > VX_XA_MAX_E || H % 32 || I % 32 || H > VX_GEMV_MAX_K
        || I > VX_GEMV_MAX_K)
        return -2;
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) n += counts[e];
    if (!n) return 0;
    const int par = n * 3 * I * H >= ((int64_t)1 << 20);
    const int nth = par ? omp_get_max_threads() : 1;
    vx_xa_plan up, down;
    vx_xa_plan_init(&up, counts, E, 2 * I, H, 1, nth);
    vx_xa_plan_init(&down, counts, E, H, I, 0, nth);
    vx_ws ws_up, ws_down;
    vx_ws_init(&ws_up, up.first[up.ne], par);
    vx_ws_init(&ws_down, down.first[down.ne], par);
    _Pragma("omp parallel if (par)") {
        vx_amx_load_tiles(8);  /* 0-3: C, 4, 5: A (rows 0-15, 16-31), 6, 7: B (columns) */
        float c[32 * 32] __attribute__((aligned(64)));
        const int t = omp_get_thread_num();
        for (int64_t it; (it = vx_ws_next(&ws_up, t)) >= 0;)
            vx_xa_item(&up, it, xs, w13, act, c);
        _Pragma("omp barrier")  /* a down reads whole rows of act */
        for (int64_t it; (it = vx_ws_next(&ws_down, t)) >= 0;)
            vx_xa_item(&down, it, act, w2, ys, c);
        _tile_release();
    }
    return 0;
}
#else
int vx_moe_experts_amx(const vx_bf16* xs, const int64_t* counts, int64_t E,
                       const uint32_t* const* w13, const uint32_t* const* w2, int64_t H,
                       int64_t I, vx_bf16* act, vx_bf16* ys) {
    (void)xs; (void)counts; (void)E; (void)w13; (void)w2; (void)H; (void)I; (void)act; (void)ys;
    return -2;
}
#endif
