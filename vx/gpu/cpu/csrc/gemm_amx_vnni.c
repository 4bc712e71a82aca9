/* vx's AMX GEMM over VNNI-packed weights (`vx.gpu.cpu.vnni`'s layout), built
   into the same library as the other CPU kernels (vx_kernels.c includes it after
   gemm_vnni.c, whose packer lays the weights out; it uses `vx_ws`,
   `vx_amx_load_tiles`, `vx_ld16_bf16`, `vx_silu_mul16`, `vx_rope16` and `VX_GEMV_MAX_K` from
   the sources before it).

   Runs in: the Worker process. */

/* y [M, N] = x [M, K] @ W.T (+ bias), bf16, for M from 1 row, on AMX tiles, computed
   straight (C = X W^T, no transposes): each A tile is 16 rows of x read in place (row stride
   x_st), each B tile 32 k x 16 n of the packed weight, which `vx_pack_vnni_bf16` lays out as
   exactly that tile, 1 KB contiguous ([N / 16][K / 2][16] dwords: tile (nb, kc) at
   (nb * K / 2 + kc * 16) * 16). Blocking 2 x 2: two A tiles (32 rows) by two B tiles (32
   columns) into four C tiles, so every tile loaded feeds two products. C tiles go straight to
   rows of y (two 16-column tiles side by side are one 64-byte row), no transpose.

   Against `vx_gemm_amx_bf16` (plain weights as the A operand, x packed as B, C^T transposed
   back), SmolLM2's 120 matrices with cold weights on a 2-core Sapphire Rapids take less time
   from 8 to 192 rows, the more so the more rows (a tie at 4 rows):
   the weights stream from memory as 1 KB sequential tiles, not 16 strided rows, and the
   epilogue has no transposes. The fp32 sums are the same products in the same order:
   bit-identical results (tested).

   Where the time went, and what the loops do about it (one hot SmolLM2 weight, 2 threads):
   the tile products ran well below their peak (every operand in L1) with x and the weight
   both streaming, and lower still with the epilogue. So:
   - Row blocks outer within an item: a block's 32 rows of x (K / 16 KB: 36 KB at K = 576)
     stay in L1 while the item's column pairs pass, and the B tiles come with `tileloaddt1`,
     which keeps them from pushing those rows out of L1 (a gain at K = 576 from 256 rows).
     Up to 64 rows (one or two row blocks) plain loads and chunks of 4 column pairs, as
     before: cold weights there lost with the new order.
   - The epilogue of a block (fp32 C to bf16 rows, + bias) runs 4 rows at a time between the
     next block's tile products, from a second C buffer: the vector ports convert while the
     tile unit multiplies.
   - Items: a panel of up to 16 row blocks x up to 8 column pairs, as many as a multiple of
     the threads where the columns allow, shared with stealing (`vx_ws`).
   SmolLM2's 120 matrices (cold, medians): shorter than the layout before at 576 and 2,048
   rows, the same at 8-192 rows. Software prefetch did worse (the next 32 columns' tiles into
   L2 over a block's passes: behind the skinny GEMM at 8 rows and level at 32 and 64, where
   without it the loop is ahead; docs/performance.md, "Measured and dropped"), and so did K
   cut into L1-sized parts with C kept in fp32 scratch between them (down, K = 1,536: no
   change).

   `vx_gemm_amx_vnni_silu` is the same loop over a gate-up weight packed with its gate and up
   rows interleaved by 16, so each 32-column block is 16 gate | 16 up columns of the same
   outputs, and the epilogue writes silu(bf16(gate)) * bf16(up) ([M, I], the bits of the GEMM
   then `vx_silu_and_mul_bf16`). SmolLM2's gate-up was measured ahead of oneDNN's
   GEMM then the SiLU pass at 64, 576 and 2,048 rows (hot weights).

   `vx_gemm_amx_vnni_rope` is the same loop over the fused qkv projection with rotate-half
   rotary in its epilogue on the q and k heads: a head's D / 32 blocks are one unit (an item's
   column chunk holds whole heads), its rows go out once its last block is done, rounded as
   the GEMM's output and then as `vx_rotary_bf16` (the same bits), so no pass reads q and k
   back.

   A last partial 32-row block is read from a zero-padded copy (`vx_av_pad`; of at most 16
   rows, only its first half's products run), a last single 16-column block takes two C
   tiles. Returns -2 where it does not apply (no AMX, K % 32, N % 16, K too big; with the
   SiLU, I % 16). */
#include "vx_kernels.h"
#ifdef VX_HAS_AMX
#define VX_AV_PM 16  /* 32-row blocks a panel holds at most */
#define VX_AV_NC 8   /* 32-column blocks an item takes at most */
/* The rows the linears route here (`vx.gpu.cpu.vnni.amx_vnni_rows`, and the fused decode
   step's `vx_linear_apply`): from VX_AV_MIN_ROWS, one (so a row's bits never depend on the
   rows beside it; `vx_av_small` level with the VDPBF16PS GEMV at 1-2 rows), to
   VX_AV_MAX_ROWS; past that, and for some shapes past 192 rows, oneDNN's GEMM is weighed
   against it at load (`vx.gpu.cpu.row_plan.tune_vnni`). The gate-up GEMM with its SiLU
   (`vx_gemm_amx_vnni_silu`) takes every row count from VX_AV_MIN_ROWS. */
#define VX_AV_MIN_ROWS 1
#define VX_AV_STREAM 2    /* past this many 32-row blocks: B tiles by tileloaddt1, and */
#define VX_AV_NC_SMALL 4  /* up to it, items of at most this many column pairs */
#define VX_AV_RG 4        /* 32-column blocks a rotated head may take (D <= 128) */
#define VX_AV_MAX_ROWS 2048
static vx_bf16 vx_av_pad[32 * VX_GEMV_MAX_K] __attribute__((aligned(64)));
/* Rows [j0, j1) of a finished 32 x 32 block (c: 32 rows of 32 fp32; rows past M skipped) to
   y at row m0, column n0: nt 16-column halves, + bias; or with silu (nt 2: gate | up
   columns) silu(bf16(gate)) * bf16(up) at column n0 / 2, vx_silu_and_mul_bf16's bits. */
VX_INLINE void vx_av_rows(const float* c, vx_bf16* y, int64_t y_st, int m0, int M, int64_t n0,
                          int nt, const vx_bf16* bias, int silu, int j0, int j1) {
    const __m512 b0 = bias ? vx_ld16_bf16(bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias && nt > 1 ? vx_ld16_bf16(bias + n0 + 16) : _mm512_setzero_ps();
    if (j1 > M - m0) j1 = M - m0;
    for (int j = j0; j < j1; j++) {
        vx_bf16* dst = y + (int64_t)(m0 + j) * y_st + (silu ? n0 / 2 : n0);
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + 32 * j), b0);
        if (silu) {
            const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + 32 * j + 16), b1);
            _mm256_storeu_si256((__m256i*)dst, (__m256i)vx_silu_mul16(
                _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(lo)), _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(hi))));
        } else if (nt > 1)
            _mm512_storeu_si512((void*)dst, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_add_ps(_mm512_load_ps(c + 32 * j + 16), b1), lo));
        else
            _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(lo));
    }
}
/* Rows [j0, j1) of a finished head of D columns (D / 32 blocks of 32 x 32 fp32, 1,024 floats
   apart) at row m0, column n0 of y: each value + bias rounded to bf16 (the GEMM's output),
   then rotate-half rotary with cos/sin [M, D / 2] (row t for row t of y), vx_rotary_bf16's
   roundings: the bits of the GEMM then the rotary pass. */
VX_INLINE void vx_av_rope_rows(const float* c, vx_bf16* y, int64_t y_st, int m0, int M,
                               int64_t n0, const vx_bf16* bias, const vx_bf16* rcos,
                               const vx_bf16* rsin, int D, int j0, int j1) {
    const int h2 = D / 2;
    if (j1 > M - m0) j1 = M - m0;
    for (int j = j0; j < j1; j++) {
        const int64_t t = m0 + j;
        const vx_bf16 *cs = rcos + t * h2, *sn = rsin + t * h2;
        vx_bf16* dst = y + t * y_st + n0;
        for (int i = 0; i < h2; i += 16) {
            const int ib = i + h2;
            __m512 a = _mm512_load_ps(c + (i / 32) * 1024 + 32 * j + i % 32);
            __m512 b = _mm512_load_ps(c + (ib / 32) * 1024 + 32 * j + ib % 32);
            if (bias) {
                a = _mm512_add_ps(a, vx_ld16_bf16(bias + n0 + i));
                b = _mm512_add_ps(b, vx_ld16_bf16(bias + n0 + ib));
            }
            vx_rope16(dst + i, dst + ib, vx_round16_bf16(a), vx_round16_bf16(b),
                      vx_ld16_bf16(cs + i), vx_ld16_bf16(sn + i));
        }
    }
}
/* The epilogue of the unit waiting at c: a head of the rotated columns, or one block */
typedef struct {
    const vx_bf16 *bias, *rcos, *rsin;
    int64_t rope_n;
    int silu, D;
} vx_av_epi;
VX_INLINE void vx_av_emit(const float* c, vx_bf16* y, int64_t y_st, int m0, int M, int64_t n0,
                          int nt, const vx_av_epi* e, int j0, int j1) {
    if (n0 < e->rope_n)
        vx_av_rope_rows(c, y, y_st, m0, M, n0, e->bias, e->rcos, e->rsin, e->D, j0, j1);
    else
        vx_av_rows(c, y, y_st, m0, M, n0, nt, e->bias, e->silu, j0, j1);
}
/* Up to 16 rows (a decode step's): the tiles hold only x's M rows (A and C tiles configured M
   rows high: no padded copy, no products of zero rows), and an item's 16-column blocks, four
   at a time, each have a C tile, so their products overlap; the B tiles stream 1 KB at a
   time. An item is a rotated head (D / 16 blocks), or up to four blocks past the rotated
   columns. Each output is the products of `vx_av_run`'s general loop summed in its order (C
   zeroed, k tiles in order; a C row depends on its A row only) with its epilogue: its bits,
   whatever M. */
#define VX_AV_SMALL_ROWS 16
#define VX_AV_SMALL_NB 4  /* 16-column blocks an item past the rotated columns takes */
#define VX_AV_PF 4  /* k tiles ahead each block's stream is prefetched, into L1 */
/* the 16 lines of block J's k tile VX_AV_PF ahead; past the block's end, the same k tile of
   the item after (its blocks follow these: a thread's items are mostly consecutive). Other
   distances and levels: docs/performance.md, "Measured and dropped". */
#define VX_AV_PREF(J) { \
        const char* pf_ = (const char*)(b + (J) * KC * 256 + (kc + VX_AV_PF < KC \
            ? (kc + VX_AV_PF) * 256 : nbn * KC * 256 + (kc + VX_AV_PF - KC) * 256)); \
        for (int l_ = 0; l_ < 16; l_++) _mm_prefetch(pf_ + 64 * l_, _MM_HINT_T0); \
    }
#define VX_AV_B(TC, TB, J) \
    VX_AV_PREF(J) _tile_loadd(TB, b + (J) * KC * 256 + kc * 256, 64); _tile_dpbf16ps(TC, 4, TB);
static void vx_av_small(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                        const vx_av_epi* epi, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    const int64_t KC = K / 32, NB = N / 16;
    const int64_t hb = epi->rope_n ? epi->D / 16 : 1;  /* 16-column blocks a rotated head takes */
    const int64_t rb = epi->rope_n / 16;  /* the rotated columns' blocks */
    const int64_t NH = rb / hb;  /* items 0 .. NH - 1: the rotated heads */
    const int64_t NI = NH + (NB - rb + VX_AV_SMALL_NB - 1) / VX_AV_SMALL_NB;
    const int par = (int64_t)M * N * K >= ((int64_t)1 << 20) || N * K >= 262144;
    vx_ws ws;
    vx_ws_init(&ws, NI, par);
    _Pragma("omp parallel if (par)") {
        struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; }
            cfg __attribute__((aligned(64)));
        memset(&cfg, 0, sizeof(cfg));
        cfg.palette = 1;
        for (int i = 0; i < 8; i++) {  /* 0-3: C, 4: A (x), 5-7: B: M rows, or 16 (B) */
            cfg.colsb[i] = 64;
            cfg.rows[i] = (uint8_t)(i < 5 ? M : 16);
        }
        _tile_loadconfig(&cfg);
        /* 32-column blocks of M rows, 1,024 floats apart (as vx_av_rope_rows reads them) */
        float cb[VX_AV_RG][32 * 32] __attribute__((aligned(64)));
        for (int64_t it; (it = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
            const int64_t nb0 = it < NH ? it * hb : rb + (it - NH) * VX_AV_SMALL_NB;
            const int64_t left = it < NH ? hb : NB - nb0;
            const int nbi = left < VX_AV_SMALL_NB || it < NH ? (int)left : VX_AV_SMALL_NB;
            for (int g0 = 0; g0 < nbi; g0 += 4) {  /* four C tiles at a time */
                const uint32_t* b = wp + (nb0 + g0) * KC * 256;
                const int nbn = nbi - g0 < 4 ? nbi - g0 : 4;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                if (nbn == 4) {
                    for (int64_t kc = 0; kc < KC; kc++) {
                        _tile_loadd(4, x + kc * 32, x_st * 2);
                        VX_AV_B(0, 5, 0) VX_AV_B(1, 6, 1) VX_AV_B(2, 7, 2) VX_AV_B(3, 5, 3)
                    }
                } else {
                    for (int64_t kc = 0; kc < KC; kc++) {
                        _tile_loadd(4, x + kc * 32, x_st * 2);
                        VX_AV_B(0, 5, 0)
                        if (nbn > 1) { VX_AV_B(1, 6, 1) }
                        if (nbn > 2) { VX_AV_B(2, 7, 2) }
                    }
                }
                float* c = cb[g0 / 2];  /* blocks (0, 1) and (2, 3): M rows of 32 columns */
                _tile_stored(0, c, 128);
                if (nbn > 1) _tile_stored(1, c + 16, 128);
                if (nbn > 2) _tile_stored(2, c + 1024, 128);
                if (nbn > 3) _tile_stored(3, c + 1040, 128);
            }
            if (it < NH) {
                vx_av_emit(cb[0], y, y_st, 0, M, nb0 * 16, 2, epi, 0, M);
            } else {
                vx_av_emit(cb[0], y, y_st, 0, M, nb0 * 16, nbi > 1 ? 2 : 1, epi, 0, M);
                if (nbi > 2)
                    vx_av_emit(cb[1], y, y_st, 0, M, nb0 * 16 + 32, nbi > 3 ? 2 : 1, epi, 0, M);
            }
        }
        _tile_release();
    }
}
/* rope_n > 0: columns [0, rope_n) are heads of D columns to rotate (D % 32 == 0, D <=
   32 VX_AV_RG, rope_n % D == 0), with cos/sin [M, D / 2] */
static int vx_av_run(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                     const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K,
                     int silu, const vx_bf16* rcos, const vx_bf16* rsin, int64_t rope_n, int D) {
    if (!vx_amx_on || M < 1 || K % 32 || K > VX_GEMV_MAX_K || N % 16 || N < 16) return -2;
    if (silu && N % 32) return -2;
    if (rope_n && (silu || D < 32 || D % 32 || D > 32 * VX_AV_RG || rope_n % D || rope_n > N
                   || !rcos || !rsin))
        return -2;
    const vx_av_epi epi = {bias, rcos, rsin, rope_n, silu, D};
    if (M <= VX_AV_SMALL_ROWS) {
        vx_av_small(x, x_st, M, wp, &epi, y, y_st, N, K);
        return 0;
    }
    const int g = rope_n ? D / 32 : 1;  /* 32-column blocks a rotated head takes */
    const int64_t rope_b = rope_n / 32;  /* the blocks of the rotated columns */
    const int64_t KC = K / 32, NB = N / 16, NB2 = (NB + 1) / 2;
    const int MB2 = (M + 31) / 32, tail = M % 32;
    if (tail) {  /* the last 32-row block, zero-padded */
        memset(vx_av_pad, 0, (size_t)32 * K * sizeof(vx_bf16));
        for (int r = 0; r < tail; r++)
            memcpy(vx_av_pad + (int64_t)r * K, x + (int64_t)(M - tail + r) * x_st,
                   (size_t)K * sizeof(vx_bf16));
    }
    int NP = (MB2 + VX_AV_PM - 1) / VX_AV_PM;
    const int PS = (MB2 + NP - 1) / NP;  /* 32-row blocks per panel, even sizes */
    NP = (MB2 + PS - 1) / PS;
    const int par = (int64_t)M * N * K >= ((int64_t)1 << 20);
    const int nth = par ? omp_get_max_threads() : 1;
    /* column chunks: at most VX_AV_NC blocks, and as many items as a multiple of the threads
       where the blocks allow (o at 64 rows: 18 blocks in 4 items, not 3 of which one thread
       would take two) */
    const int stream = MB2 > VX_AV_STREAM;
    const int64_t nc_max = stream ? VX_AV_NC : VX_AV_NC_SMALL;
    int64_t NN = (NB2 + nc_max - 1) / nc_max;
    while ((NP * NN) % nth && NN < NB2) NN++;
    int64_t NC = (NB2 + NN - 1) / NN;
    NC = (NC + g - 1) / g * g;  /* an item's chunk holds whole rotated heads */
    NN = (NB2 + NC - 1) / NC;
    vx_ws ws;
    vx_ws_init(&ws, NP * NN, par);
    _Pragma("omp parallel if (par)") {
        vx_amx_load_tiles(8);  /* 0-3: C, 4, 5: A (x rows 0-15, 16-31), 6, 7: B (columns) */
        /* two C buffers: a unit's rows go out while the next block's products run (a unit:
           a block, or a rotated head's g blocks) */
        float cb[2][VX_AV_RG][32 * 32] __attribute__((aligned(64)));
        int pm0 = -1, pnt = 0, cur = 0;  /* the unit waiting in cb[cur ^ 1] */
        int64_t pn0 = 0;
        for (int64_t it; (it = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
            const int mp = (int)(it / NN);
            const int64_t nc = it % NN;
            const int mb2e = (mp + 1) * PS < MB2 ? (mp + 1) * PS : MB2;
            const int64_t nb2e = (nc + 1) * NC < NB2 ? (nc + 1) * NC : NB2;
            /* row blocks outer: a block's 32 rows of x (K / 16 KB) stay in L1 while the
               item's columns pass; the B tiles stream through L2 (tileloaddt1: they do not
               push the rows out of L1) */
            for (int mb2 = mp * PS; mb2 < mb2e; mb2++) {
                const int m0 = mb2 * 32;
                const int padded = tail && mb2 == MB2 - 1;
                /* a last block of at most 16 rows: its second half's products are of zero
                   rows, skipped (the first half's rows get the same products either way) */
                const int half = padded && tail <= 16;
                const vx_bf16* a0 = padded ? vx_av_pad : x + (int64_t)m0 * x_st;
                const int64_t ast = padded ? K : x_st;
                const vx_bf16* a1 = a0 + 16 * ast;
                for (int64_t nb2 = nc * NC; nb2 < nb2e; nb2++) {
                    const int nt = 2 * nb2 + 1 < NB ? 2 : 1;  /* 16-column blocks here */
                    const uint32_t* b0 = wp + (2 * nb2) * KC * 256;
                    const uint32_t* b1 = b0 + KC * 256;
                    const float* pc = &cb[cur ^ 1][0][0];
                    const int j = nb2 < rope_b ? (int)(nb2 % g) : 0;  /* block of its unit */
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    if (nt == 2) {
                        for (int64_t kc = 0; kc < KC; kc++) {
                            _tile_loadd(4, a0 + kc * 32, ast * 2);
                            if (stream) _tile_stream_loadd(6, b0 + kc * 256, 64);
                            else _tile_loadd(6, b0 + kc * 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            if (stream) _tile_stream_loadd(7, b1 + kc * 256, 64);
                            else _tile_loadd(7, b1 + kc * 256, 64);
                            _tile_dpbf16ps(1, 4, 7);
                            if (!half) {
                                _tile_loadd(5, a1 + kc * 32, ast * 2);
                                _tile_dpbf16ps(2, 5, 6);
                                _tile_dpbf16ps(3, 5, 7);
                            }
                            /* the last block's rows, 4 a step, between the tile products */
                            if (pm0 >= 0 && kc < 8)
                                vx_av_emit(pc, y, y_st, pm0, M, pn0, pnt, &epi, 4 * (int)kc,
                                           4 * (int)kc + 4);
                        }
                        if (pm0 >= 0 && KC < 8)
                            vx_av_emit(pc, y, y_st, pm0, M, pn0, pnt, &epi, 4 * (int)KC, 32);
                    } else {
                        if (pm0 >= 0) vx_av_emit(pc, y, y_st, pm0, M, pn0, pnt, &epi, 0, 32);
                        for (int64_t kc = 0; kc < KC; kc++) {
                            _tile_loadd(4, a0 + kc * 32, ast * 2);
                            _tile_stream_loadd(6, b0 + kc * 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            if (!half) {
                                _tile_loadd(5, a1 + kc * 32, ast * 2);
                                _tile_dpbf16ps(2, 5, 6);
                            }
                        }
                    }
                    pm0 = -1;  /* the waiting unit is out */
                    float* c = cb[cur][j];  /* rows m0 .. m0 + 15 from tiles 0, 1; then 2, 3 */
                    _tile_stored(0, c, 128);
                    if (nt == 2) _tile_stored(1, c + 16, 128);
                    if (m0 + 16 < M) {  /* rows past M are never read */
                        _tile_stored(2, c + 512, 128);
                        if (nt == 2) _tile_stored(3, c + 528, 128);
                    }
                    if (j == g - 1 || nb2 >= rope_b)  /* a whole unit: it waits */
                        pm0 = m0, pn0 = 32 * (nb2 - j), pnt = nt, cur ^= 1;
                }
            }
        }
        if (pm0 >= 0) vx_av_emit(&cb[cur ^ 1][0][0], y, y_st, pm0, M, pn0, pnt, &epi, 0, 32);
        _tile_release();
    }
    return 0;
}
int vx_gemm_amx_vnni(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                     const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    return vx_av_run(x, x_st, M, wp, bias, y, y_st, N, K, 0, NULL, NULL, 0, 0);
}
/* vx_gemm_amx_vnni with rotate-half rotary in its epilogue on columns [0, rope_n), heads of D
   (the fused qkv projection's q and k heads), cos/sin [M, D / 2]: the bits of the GEMM then
   vx_rotary_bf16. -2 where it does not apply (D % 32, D > 128, rope_n % D, rope_n > N). */
int vx_gemm_amx_vnni_rope(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                          const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K,
                          const vx_bf16* rcos, const vx_bf16* rsin, int64_t rope_n, int D) {
    return vx_av_run(x, x_st, M, wp, bias, y, y_st, N, K, 0, rcos, rsin, rope_n, D);
}
/* y [M, I] = silu(x Wg^T + bg) * (x Wu^T + bu), each rounded to bf16 first (torch's
   roundings, as the GEMM then vx_silu_and_mul_bf16: the same bits), for a gate-up weight
   whose rows were interleaved by 16 before packing (gate 0-15, up 0-15, gate 16-31, ...;
   `vx.gpu.cpu.vnni.VnniWeight(silu=True)`); bias likewise interleaved, or NULL. */
int vx_gemm_amx_vnni_silu(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                          const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t I, int64_t K) {
    return vx_av_run(x, x_st, M, wp, bias, y, y_st, 2 * I, K, 1, NULL, NULL, 0, 0);
}
int vx_has_gemm_amx_vnni(void) { return vx_amx_on; }
#endif
/* which 0: the first row count the linears route to vx_gemm_amx_vnni; 1: the last */
int vx_amx_vnni_rows(int which) {
#ifdef VX_HAS_AMX
    return which ? VX_AV_MAX_ROWS : VX_AV_MIN_ROWS;
#else
    (void)which;
    return 0;
#endif
}
#ifndef VX_HAS_AMX
int vx_gemm_amx_vnni(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                     const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)wp; (void)bias; (void)y; (void)y_st; (void)N; (void)K;
    return -2;
}
int vx_gemm_amx_vnni_silu(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                          const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t I, int64_t K) {
    (void)x; (void)x_st; (void)M; (void)wp; (void)bias; (void)y; (void)y_st; (void)I; (void)K;
    return -2;
}
int vx_gemm_amx_vnni_rope(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                          const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K,
                          const vx_bf16* rcos, const vx_bf16* rsin, int64_t rope_n, int D) {
    (void)x; (void)x_st; (void)M; (void)wp; (void)bias; (void)y; (void)y_st; (void)N; (void)K;
    (void)rcos; (void)rsin; (void)rope_n; (void)D;
    return -2;
}
int vx_has_gemm_amx_vnni(void) { return 0; }
#endif
