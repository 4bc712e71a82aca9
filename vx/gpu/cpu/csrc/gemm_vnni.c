/* The bf16 GEMM on AVX512-BF16 CPUs without AMX (Zen 4 and 5, Cooper Lake),
   over weights packed once at load time into `vdpbf16ps`'s pair-interleaved ("VNNI") layout.
   Built into the kernel library (vx_kernels.c includes it after the skinny GEMMs' source,
   whose helpers it uses: `vx_ld16_bf16`, `vx_ws`).

   Runs in: the Worker process.

   Why: without AMX, oneDNN's bf16 GEMM stayed well below `vdpbf16ps`'s peak on two Zen 5 cores
   at 16-128 rows, and the skinny GEMM (plain weights, a reduction per output) stops paying past
   12 rows; this kernel needs no reduction and no repacking per call (see `vx.gpu.cpu.vnni`). */

/* Layout: wp [N / 16][K / 2][16] dwords; dword (b, p, c) holds W[16 b + c][2 p], W[16 b + c]
   [2 p + 1] (two bf16, the lower index in the low half), so one aligned 64-byte load is the
   B operand of `vdpbf16ps` for 16 outputs and two k, and a row of x's k-pair, broadcast, is
   its A operand. Each item of the parallel loop is a panel of 48 outputs (the last one 16 or
   32), for every row of x in blocks of 8: 8 rows by 3 vectors, 24 accumulators, 11 loads per
   24 products, and the panel's weights (48 K bf16: 54 KB at K = 576) stay in L2 across the
   row blocks, so the weights stream from memory once a call. fp32 accumulation over k in
   order, the bias added in fp32, one rounding to bf16 (nearest even). */
#include "vx_kernels.h"
#if defined(VX_HAS_FAST_BF16)
#define VX_VN_MR 8   /* rows of x per micro-tile */
#define VX_VN_NR 3   /* 16-output vectors per panel */
#ifndef VX_VN_PF
#define VX_VN_PF 32  /* weight prefetch distance in k-pairs (64-byte lines per vector) */
#endif
/* Packs W [N, K] (row stride K) into wp; N % 16 == 0 and K even, else -2. */
int vx_pack_vnni_bf16(const vx_bf16* w, int64_t N, int64_t K, uint32_t* wp) {
    if (N % 16 || K % 2 || N < 16 || K < 2) return -2;
    const int64_t KP = K / 2;
    _Pragma("omp parallel for schedule(static)")
    for (int64_t b = 0; b < N / 16; b++)
        for (int c = 0; c < 16; c++) {
            const uint32_t* row = (const uint32_t*)(w + (16 * b + c) * K);
            uint32_t* dst = wp + b * KP * 16 + c;
            for (int64_t p = 0; p < KP; p++) dst[p * 16] = row[p];
        }
    return 0;
}
/* y rows [0, mr) (mr <= 8), outputs [0, 16 NR) of the panel at w (vector j at j * bs dwords):
   rows past mr read row 0 and are not stored. */
VX_INLINE void vx_vnni_tile(const vx_bf16* x, int64_t x_st, int mr, const uint32_t* w,
                            int64_t bs, int64_t KP, const vx_bf16* bias, vx_bf16* y,
                            int64_t y_st, const int NR, const int PF, const char* nx,
                            int64_t l0, int64_t l1, int q, float* bv, int64_t* bi,
                            int64_t n0) {
    __m512 a[VX_VN_MR][VX_VN_NR];
    const int32_t* xr[VX_VN_MR];
    for (int i = 0; i < VX_VN_MR; i++) {
        for (int j = 0; j < NR; j++) a[i][j] = _mm512_setzero_ps();
        xr[i] = (const int32_t*)(x + (int64_t)(i < mr ? i : 0) * x_st);
    }
    for (int64_t p = 0; p < KP; p++) {
        __m512bh wv[VX_VN_NR];
        for (int j = 0; j < NR; j++) {
            if (PF) _mm_prefetch((const char*)(w + j * bs + (p + VX_VN_PF) * 16), _MM_HINT_T0);
            wv[j] = (__m512bh)_mm512_load_si512((const void*)(w + j * bs + p * 16));
        }
        if (nx)  /* this block's share of the next panel's lines, q a step */
            for (int u = 0; u < q; u++) {
                const int64_t l = l0 + p * q + u;
                if (l < l1) _mm_prefetch(nx + l * 64, _MM_HINT_T1);
            }
        for (int i = 0; i < VX_VN_MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[i][p]);
            for (int j = 0; j < NR; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, wv[j]);
        }
    }
    if (bv) {  /* argmax: each row's first maximum of its bf16-rounded outputs so far */
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < NR; j++) {
                const __m256i h = (__m256i)_mm512_cvtneps_pbh(a[i][j]);
                const __m512 r = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                const float m = _mm512_reduce_max_ps(r);
                if (m < bv[i]) continue;
                const __mmask16 k = _mm512_cmp_ps_mask(r, _mm512_set1_ps(m), _CMP_EQ_OQ);
                const int64_t id = n0 + 16 * j + __builtin_ctz((unsigned)k);
                if (m > bv[i] || id < bi[i]) { bv[i] = m; bi[i] = id; }
            }
        return;
    }
    for (int j = 0; j < NR; j++) {
        const __m512 bb = bias ? vx_ld16_bf16(bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            _mm256_storeu_si256((__m256i*)(y + i * y_st + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a[i][j], bb)));
    }
}
/* y [M, N] (row stride y_st) = x [M, K] (row stride x_st) @ W.T + bias, W packed by
   vx_pack_vnni_bf16; -2 (nothing written) unless N % 16 == 0, K even and x's rows 4-byte
   aligned. */
static int vx_vnni_run(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                       const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K,
                       float* bvs, int64_t* bis) {
    const int64_t KP = K / 2, bs = KP * 16, NV = N / 16;
    const int64_t npan = (NV + VX_VN_NR - 1) / VX_VN_NR;
    const int par = (int64_t)M * N * K >= ((int64_t)1 << 20);
    vx_ws ws;
    vx_ws_init(&ws, npan, par);
    _Pragma("omp parallel if (par)")
    for (int64_t pn; (pn = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
        /* argmax: this thread's best value and index per row (M of each a thread) */
        float* bv = bvs ? bvs + (int64_t)omp_get_thread_num() * M : 0;
        int64_t* bi = bis ? bis + (int64_t)omp_get_thread_num() * M : 0;
        const int64_t v0 = pn * VX_VN_NR;
        const int nr = NV - v0 < VX_VN_NR ? (int)(NV - v0) : VX_VN_NR;
        const uint32_t* w = wp + v0 * bs;
        const vx_bf16* bp = bias ? bias + 16 * v0 : 0;
        /* the next panel of this thread's range (if any), prefetched a share per row block
           while this one computes: it streams from memory while the cores are busy */
        const int64_t nv1 = NV - (v0 + nr) < VX_VN_NR ? NV - (v0 + nr) : VX_VN_NR;
        const char* nx = nv1 > 0 ? (const char*)(w + nr * bs) : 0;
        const int64_t nrb = (M + VX_VN_MR - 1) / VX_VN_MR, lines = nv1 * KP;
        const int64_t per = (lines + nrb - 1) / nrb;
        const int q = (int)((per + KP - 1) / KP);
        for (int m0 = 0; m0 < M; m0 += VX_VN_MR) {
            const int mr = M - m0 < VX_VN_MR ? M - m0 : VX_VN_MR;
            const vx_bf16* xm = x + (int64_t)m0 * x_st;
            vx_bf16* ym = y + (int64_t)m0 * y_st + 16 * v0;
            const int64_t l0 = (m0 / VX_VN_MR) * per, l1 = l0 + per < lines ? l0 + per : lines;
#define VX_VN_TILE(N, P) vx_vnni_tile(xm, x_st, mr, w, bs, KP, bp, ym, y_st, N, P, nx, l0, \
                                      l1, q, bv ? bv + m0 : 0, bi ? bi + m0 : 0, 16 * v0)
            /* the first row block streams the panel from memory: prefetched ahead */
            if (m0 == 0) {
                if (nr == 3) VX_VN_TILE(3, 1);
                else if (nr == 2) VX_VN_TILE(2, 1);
                else VX_VN_TILE(1, 1);
            } else {
                if (nr == 3) VX_VN_TILE(3, 0);
                else if (nr == 2) VX_VN_TILE(2, 0);
                else VX_VN_TILE(1, 0);
            }
#undef VX_VN_TILE
        }
    }
    return 0;
}
/* The small-row loop: M <= VX_VN_SMALL rows (a decode step's one row, a few verify rows),
   where the general loop's 8-row tile and 48-output panels left the cores waiting on memory
   (one row: twice the VDPBF16PS GEMV's time; the matrices below its parallel threshold ran on
   one thread). Items of up to VX_VN_SV vectors (16 outputs each; as many as keep the threads'
   shares even), parallel from the GEMV's size, each vector's line VX_VN_SPD dwords ahead
   prefetched into L2 (measured: 2 KB ahead was ahead of 8 and 16 KB, SmolLM2's 120 matrices
   at one row, 2-core Sapphire Rapids with AMX off: level with the GEMV). Each output's sum is
   the general loop's, operation for operation: zero, then `vdpbf16ps` over k pairs in order,
   the bias (or +0) added in fp32, one rounding; so a row's bits do not depend on the rows
   beside it or on which loop ran. */
#define VX_VN_SMALL 4
#define VX_VN_SV 6        /* most vectors (16 outputs each) a tile: one sum chain each a row */
#define VX_VN_SPD 512  /* dwords: 32 lines ahead in each vector's stream */
VX_INLINE void vx_vnni_small_tile(const vx_bf16* x, int64_t x_st, const int M, const uint32_t* w,
                                  int64_t bs, int64_t KP, const vx_bf16* bias, vx_bf16* y,
                                  int64_t y_st, const int NV) {
    __m512 a[VX_VN_SMALL][VX_VN_SV];
    const int32_t* xr[VX_VN_SMALL];
    for (int i = 0; i < M; i++) {
        for (int j = 0; j < NV; j++) a[i][j] = _mm512_setzero_ps();
        xr[i] = (const int32_t*)(x + (int64_t)i * x_st);
    }
    for (int64_t p = 0; p < KP; p++) {
        __m512bh wv[VX_VN_SV];
        for (int j = 0; j < NV; j++) {
            _mm_prefetch((const char*)(w + j * bs + p * 16 + VX_VN_SPD), _MM_HINT_T1);
            wv[j] = (__m512bh)_mm512_load_si512((const void*)(w + j * bs + p * 16));
        }
        for (int i = 0; i < M; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(xr[i][p]);
            for (int j = 0; j < NV; j++) a[i][j] = _mm512_dpbf16_ps(a[i][j], xv, wv[j]);
        }
    }
    for (int j = 0; j < NV; j++) {
        const __m512 bb = bias ? vx_ld16_bf16(bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < M; i++)
            _mm256_storeu_si256((__m256i*)(y + i * y_st + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a[i][j], bb)));
    }
}
static void vx_vnni_small(const vx_bf16* x, int64_t x_st, const int M, const uint32_t* wp,
                          const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    const int64_t KP = K / 2, bs = KP * 16, NV = N / 16;
    const int par = N * K >= 262144;
    const int nt = par ? (omp_get_max_threads() < 1 ? 1 : omp_get_max_threads()) : 1;
    /* vectors an item: of those a tile holds (M <= 2: six; else four, so the accumulators
       and weights stay in registers), the one whose busiest thread has the fewest vectors,
       the larger on a tie (more chains in flight) */
    int sv = M <= 2 ? 6 : 4;
    int64_t best = INT64_MAX;
    for (int c = M <= 2 ? 6 : 4; c >= 2; c--) {
        const int64_t items = (NV + c - 1) / c, load = (items + nt - 1) / nt * c;
        if (load < best) { best = load; sv = c; }
    }
    const int64_t nit = (NV + sv - 1) / sv;
    vx_ws ws;
    vx_ws_init(&ws, nit, par);
    _Pragma("omp parallel if (par)")
    for (int64_t it; (it = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
        const int64_t v0 = it * sv;
        const int nv = NV - v0 < sv ? (int)(NV - v0) : sv;
        const uint32_t* w = wp + v0 * bs;
        const vx_bf16* bp = bias ? bias + 16 * v0 : 0;
        vx_bf16* yv = y + 16 * v0;
#define VX_VN_ST(C) vx_vnni_small_tile(x, x_st, M, w, bs, KP, bp, yv, y_st, C)
        switch (nv) {  /* constant trip counts, so the accumulators stay in registers */
        case 6: if (M <= 2) { VX_VN_ST(6); break; } /* fall through - not reached */
        case 5: if (M <= 2) { VX_VN_ST(5); break; } /* fall through - not reached */
        case 4: VX_VN_ST(4); break;
        case 3: VX_VN_ST(3); break;
        case 2: VX_VN_ST(2); break;
        default: VX_VN_ST(1); break;
        }
#undef VX_VN_ST
    }
}
/* Rows up to which vx_gemm_vnni_bf16 takes the small-row loop (the same bits either way):
   `n` >= 0 sets it (at most VX_VN_SMALL; 0: the general loop only, for tests and A/B), and
   the value in force is returned. */
static int vx_vnni_small_rows = VX_VN_SMALL;
int vx_vnni_small_loop(int n) {
    if (n >= 0) vx_vnni_small_rows = n < VX_VN_SMALL ? n : VX_VN_SMALL;
    return vx_vnni_small_rows;
}
int vx_gemm_vnni_bf16(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                      const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    if (M < 1 || N % 16 || N < 16 || K % 2 || K < 2 || x_st % 2 || ((uintptr_t)x & 3))
        return -2;
    switch (M <= vx_vnni_small_rows ? M : 0) {  /* a constant M per case */
    case 1: vx_vnni_small(x, x_st, 1, wp, bias, y, y_st, N, K); return 0;
    case 2: vx_vnni_small(x, x_st, 2, wp, bias, y, y_st, N, K); return 0;
    case 3: vx_vnni_small(x, x_st, 3, wp, bias, y, y_st, N, K); return 0;
    case 4: vx_vnni_small(x, x_st, 4, wp, bias, y, y_st, N, K); return 0;
    default: return vx_vnni_run(x, x_st, M, wp, bias, y, y_st, N, K, 0, 0);
    }
}
/* out[m] = argmax over n of vx_gemm_vnni_bf16's y[m][n] (no bias): the first maximum of the
   bf16 outputs, without forming them (greedy rows from the LM head). -2 as the GEMM, -1 if
   scratch could not be allocated. */
int vx_argmax_vnni_bf16(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp, int64_t N,
                        int64_t K, int64_t* out) {
    if (M < 1 || N % 16 || N < 16 || K % 2 || K < 2 || x_st % 2 || ((uintptr_t)x & 3))
        return -2;
    const int nt = omp_get_max_threads() < 1 ? 1 : omp_get_max_threads();
    float* bvs = (float*)malloc(sizeof(float) * (size_t)nt * (size_t)M);
    int64_t* bis = (int64_t*)malloc(sizeof(int64_t) * (size_t)nt * (size_t)M);
    if (!bvs || !bis) { free(bvs); free(bis); return -1; }
    for (int64_t i = 0; i < (int64_t)nt * M; i++) { bvs[i] = -INFINITY; bis[i] = INT64_MAX; }
    vx_vnni_run(x, x_st, M, wp, 0, 0, 0, N, K, bvs, bis);
    for (int m = 0; m < M; m++) {  /* the threads' bests: the larger, on a tie the first */
        float b = bvs[m];
        int64_t id = bis[m];
        for (int t = 1; t < nt; t++) {
            const float v = bvs[(int64_t)t * M + m];
            const int64_t j = bis[(int64_t)t * M + m];
            if (v > b || (v == b && j < id)) { b = v; id = j; }
        }
        out[m] = id == INT64_MAX ? 0 : id;
    }
    free(bvs);
    free(bis);
    return 0;
}
int vx_has_gemm_vnni(void) { return 1; }
#else
int vx_pack_vnni_bf16(const vx_bf16* w, int64_t N, int64_t K, uint32_t* wp) {
    (void)w; (void)N; (void)K; (void)wp;
    return -2;
}
int vx_gemm_vnni_bf16(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                      const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)wp; (void)bias; (void)y; (void)y_st; (void)N; (void)K;
    return -2;
}
int vx_argmax_vnni_bf16(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp, int64_t N,
                        int64_t K, int64_t* out) {
    (void)x; (void)x_st; (void)M; (void)wp; (void)N; (void)K; (void)out;
    return -2;
}
int vx_vnni_small_loop(int n) {
    (void)n;
    return 0;
}
int vx_has_gemm_vnni(void) { return 0; }
#endif
