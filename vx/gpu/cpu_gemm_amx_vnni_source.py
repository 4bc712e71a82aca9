"""The C source of vx's AMX GEMM over VNNI-packed weights (`vx.gpu.cpu_vnni`'s layout), built
into the same library as the other CPU kernels (`vx.gpu.kv_cache` appends it after
`vx.gpu.cpu_gemm_vnni_source`, whose packer lays the weights out; it uses `vx_ws`,
`vx_amx_load_tiles`, `vx_ld16_bf16` and `VX_GEMV_MAX_K` from the sources before it).

Runs in: the Worker process.
"""

from __future__ import annotations

#: y [M, N] = x [M, K] @ W.T (+ bias), bf16, for M from 1 row, on AMX tiles, computed
#: straight (C = X W^T, no transposes): each A tile is 16 rows of x read in place (row stride
#: x_st), each B tile 32 k x 16 n of the packed weight, which `vx_pack_vnni_bf16` lays out as
#: exactly that tile, 1 KB contiguous ([N / 16][K / 2][16] dwords: tile (nb, kc) at
#: (nb * K / 2 + kc * 16) * 16). Blocking 2 x 2: two A tiles (32 rows) by two B tiles (32
#: columns) into four C tiles, so every tile loaded feeds two products; the 32 columns' B tiles
#: (K / 32 KB each) stay in L1/L2 while the rows of an item's panel pass under them. C tiles go
#: straight to rows of y (two 16-column tiles side by side are one 64-byte row), no transpose.
#:
#: Against `vx_gemm_amx_bf16` (plain weights as the A operand, x packed as B, C^T transposed
#: back), SmolLM2's 120 matrices with cold weights on a 2-core Sapphire Rapids take 0.91-0.97
#: of the time at 8-16 rows, 0.80-0.87 at 32-64 and 0.77-0.82 at 128-192 (a tie at 4 rows):
#: the weights stream from memory as 1 KB
#: sequential tiles, not 16 strided rows, and the epilogue has no transposes. The fp32 sums
#: are the same products in the same order: bit-identical results (tested).
#:
#: No software prefetch: the packed tiles are sequential, and the hardware's prefetchers did
#: better alone (prefetching the next 32 columns' tiles into L2 over a block's passes: 1.08 /
#: 1.00 / 0.97 of the skinny GEMM's time at 8 / 32 / 64 rows, against 0.91 / 0.80 / 0.84).
#:
#: Work: items of (a panel of up to VX_AV_PM 32-row blocks, sized evenly, x a chunk of
#: VX_AV_NC 32-column blocks), panel-major, shared with stealing (`vx_ws`). A last partial
#: 32-row block is read from a zero-padded copy (`vx_av_pad`), a last single 16-column block
#: takes two C tiles. Returns -2 where it does not apply (no AMX, K % 32, N % 16, K too big).
GEMM_AMX_VNNI_SOURCE = r"""
#ifdef VX_HAS_AMX
#define VX_AV_PM 8   /* 32-row blocks a panel holds at most */
#define VX_AV_NC 4   /* 32-column blocks an item takes */
/* The rows the linears route here (`vx.gpu.cpu_vnni.amx_vnni_rows`, and the fused decode
   step's `vx_linear_apply`): from VX_AV_MIN_ROWS, where it overtakes the skinny GEMM, to
   VX_AV_MAX_ROWS, past which oneDNN's gate-up is faster (SmolLM2, 2-core Sapphire Rapids). */
#define VX_AV_MIN_ROWS 8
#define VX_AV_MAX_ROWS 1024
static vx_bf16 vx_av_pad[32 * VX_GEMV_MAX_K] __attribute__((aligned(64)));
/* rows [r0, r0 + rn) of y, columns [n0, n0 + 16 nt) from c [16][32] fp32 (nt: 1 or 2) */
VX_INLINE void vx_av_store(const float* c, vx_bf16* y, int64_t y_st, int r0, int rn,
                           int64_t n0, int nt, const vx_bf16* bias) {
    const __m512 b0 = bias ? vx_ld16_bf16(bias + n0) : _mm512_setzero_ps();
    const __m512 b1 = bias && nt > 1 ? vx_ld16_bf16(bias + n0 + 16) : _mm512_setzero_ps();
    for (int j = 0; j < rn; j++) {
        vx_bf16* dst = y + (int64_t)(r0 + j) * y_st + n0;
        const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + 32 * j), b0);
        if (nt > 1)
            _mm512_storeu_si512((void*)dst, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_add_ps(_mm512_load_ps(c + 32 * j + 16), b1), lo));
        else
            _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(lo));
    }
}
int vx_gemm_amx_vnni(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp,
                     const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K) {
    if (!vx_amx_on || M < 1 || K % 32 || K > VX_GEMV_MAX_K || N % 16 || N < 16) return -2;
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
    const int64_t NN = (NB2 + VX_AV_NC - 1) / VX_AV_NC;
    const int par = (int64_t)M * N * K >= ((int64_t)1 << 20);
    vx_ws ws;
    vx_ws_init(&ws, NP * NN, par);
    _Pragma("omp parallel if (par)") {
        vx_amx_load_tiles(8);  /* 0-3: C, 4, 5: A (x rows 0-15, 16-31), 6, 7: B (columns) */
        float c[16 * 32] __attribute__((aligned(64)));
        for (int64_t it; (it = vx_ws_next(&ws, omp_get_thread_num())) >= 0;) {
            const int mp = (int)(it / NN);
            const int64_t nc = it % NN;
            const int mb2e = (mp + 1) * PS < MB2 ? (mp + 1) * PS : MB2;
            const int64_t nb2e = (nc + 1) * VX_AV_NC < NB2 ? (nc + 1) * VX_AV_NC : NB2;
            for (int64_t nb2 = nc * VX_AV_NC; nb2 < nb2e; nb2++) {
                const int nt = 2 * nb2 + 1 < NB ? 2 : 1;  /* 16-column blocks here */
                const uint32_t* b0 = wp + (2 * nb2) * KC * 256;
                const uint32_t* b1 = b0 + KC * 256;
                for (int mb2 = mp * PS; mb2 < mb2e; mb2++) {
                    const int m0 = mb2 * 32;
                    const int padded = tail && mb2 == MB2 - 1;
                    const vx_bf16* a0 = padded ? vx_av_pad : x + (int64_t)m0 * x_st;
                    const int64_t ast = padded ? K : x_st;
                    const vx_bf16* a1 = a0 + 16 * ast;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    if (nt == 2)
                        for (int64_t kc = 0; kc < KC; kc++) {
                            _tile_loadd(4, a0 + kc * 32, ast * 2);
                            _tile_loadd(6, b0 + kc * 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_loadd(7, b1 + kc * 256, 64);
                            _tile_dpbf16ps(1, 4, 7);
                            _tile_loadd(5, a1 + kc * 32, ast * 2);
                            _tile_dpbf16ps(2, 5, 6);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    else
                        for (int64_t kc = 0; kc < KC; kc++) {
                            _tile_loadd(4, a0 + kc * 32, ast * 2);
                            _tile_loadd(6, b0 + kc * 256, 64);
                            _tile_dpbf16ps(0, 4, 6);
                            _tile_loadd(5, a1 + kc * 32, ast * 2);
                            _tile_dpbf16ps(2, 5, 6);
                        }
                    /* rows m0 .. m0 + 15 from C tiles 0, 1; m0 + 16 .. m0 + 31 from 2, 3 */
                    _tile_stored(0, c, 128);
                    if (nt == 2) _tile_stored(1, c + 16, 128);
                    vx_av_store(c, y, y_st, m0, M - m0 < 16 ? M - m0 : 16, 32 * nb2, nt, bias);
                    if (m0 + 16 < M) {
                        _tile_stored(2, c, 128);
                        if (nt == 2) _tile_stored(3, c + 16, 128);
                        vx_av_store(c, y, y_st, m0 + 16, M - m0 - 16 < 16 ? M - m0 - 16 : 16,
                                    32 * nb2, nt, bias);
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
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
int vx_has_gemm_amx_vnni(void) { return 0; }
#endif
"""
