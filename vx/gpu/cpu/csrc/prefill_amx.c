/* The CPU prefill attention (bf16, AMX), built into the same library as the
   decode kernels (vx_kernels.c includes it after decode_attention.c, whose helpers
   it uses: `vx_expf`, `vx_amx_load_tiles`, `vx_amx_on`, `VX_INLINE`, `VX_HAS_AMX`).

   Runs in: the Worker process. Kept apart from the decode kernels so each stays readable. */

/* Causal attention of every prefill chunk of a step in one call, flash style, on AMX tiles.
   Layouts: q/out [T, Hq, D] with any row strides (chunk i owns rows [starts[i], starts[i] +
   lens[i])); caches [Hkv, NB, BS, D] (strides given), the chunk's own K/V already written;
   bt [nchunks, >= ceil(ctx / BS)] int32 (row i: chunk i's blocks); computed[i] cached tokens
   before chunk i, so query j of chunk i sits at position computed[i] + j and sees keys
   [0, computed[i] + j]; with a sliding `window` > 0 only keys (computed[i] + j - window,
   computed[i] + j] (HF's), and with a `softcap` > 0 each score s is cap * tanh(s * scale / cap)
   (Gemma 2's), in natural units, before the softmax. Any block size. Keys before a chunk's
   first query's window are neither packed nor read.

   Two passes, both on torch's OpenMP pool:
   1. each (chunk, kv head, 32 keys) is copied out of the paged cache into the layouts
      tdpbf16ps takes as its B operand: K^T pair-interleaved (row j, column n: key n's dims
      2j, 2j+1) and V pair-interleaved (row j, column d: keys 2j, 2j+1 of dim d); keys past the
      context are zero;
   2. each (chunk, up to 4 query heads of one kv head, 32 queries; one head of 16 where
      D > 64) runs over its keys 256 at a time, each chunk of keys for its heads in turn:
      S = Q K^T into tiles, then per query row the running max, exp (fp32) and sum, the
      probabilities rounded to bf16 (as torch's flash attention does for bf16), then P V
      into tiles, and the running output rescaled in fp32. Within a chunk, items run from the
      most keys down (dynamic schedule), so its long causal rows do not end up last (chunks
      in list order).
   Without AMX, on AVX2 builds, the chunks go to prefill_avx2.c's kernel.
   Returns -2 where it does not apply (no AMX, D % 32, D > 256, Hq % Hkv, no chunks), before
   writing anything; -1 if scratch could not be allocated; the caller then uses SDPA. */
#include "vx_kernels.h"
#ifdef VX_HAS_FAST_BF16  /* AVX512-BF16: the helpers both products' kernels share */
#define VX_PF_512 1
#define VX_PCH 256  /* keys per softmax chunk */
#define VX_PF_GH 4  /* query heads an item takes at most */
/* 2^x on 16 lanes for x <= 0: n = round(x), r = x - n in [-1/2, 1/2] exactly, 2^r by a
   degree-6 polynomial fitted for relative error (9.6e-8 at most in fp32, about an ulp), 2^n by
   scalef. Scores are kept in log2 units (scale * log2(e) folded into one multiply), which saves
   the two-step ln 2 reduction of vx_exp16: the softmax's exps are most of this kernel's work.
   Clamped at -125, so the result stays a normal float (>= 2^-125 ~ 2.4e-38, never a denormal). */
VX_INLINE __m512 vx_exp2_16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    return _mm512_scalef_ps(VX_EXP2_POLY(_mm512_fmadd_ps, _mm512_set1_ps, r), n);
}
/* vx_exp2_16 with a degree-3 polynomial (fitted for relative error on [-1/2, 1/2]: 7.5e-5 at
   most, 50x below the bf16 rounding every probability gets before P V), for the softmax's
   probabilities, whose exps are a large part of this kernel's time (measured shorter than the
   degree-6 one for a 2,048-token prompt). The running-max correction keeps vx_exp2_16 (it
   compounds over the chunks of a row). */
VX_INLINE __m512 vx_exp2_16_p(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(5.5171627551317215e-02f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.426111400127411e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.932609677314758e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999280571937561e-01f));
    return _mm512_scalef_ps(p, n);
}
/* Chunk i's K^T and V tiles for kv head h, keys [32 pg, 32 pg + 32): 2 DV K tiles (two
   groups of 16 keys, DV dim slices of 32) then 2 DV V tiles (D / 16 dim slices of 16). */
VX_INLINE void vx_pf_pack(uint32_t* dst, const vx_bf16* kh, const vx_bf16* vh,
                          const int32_t* btr, int64_t c_sb, int64_t c_ss, int BS, int ctx,
                          int pg, int DV, int kfirst) {
    const int D = 32 * DV;
    const vx_bf16* kr[32];
    const vx_bf16* vr[32];
    for (int n = 0; n < 32; n++) {
        const int key = 32 * pg + n;
        if (key < ctx && key >= kfirst) {  /* before kfirst: no query's window (zeros) */
            const int64_t o = (int64_t)btr[key / BS] * c_sb + (int64_t)(key % BS) * c_ss;
            kr[n] = kh + o; vr[n] = vh + o;
        } else {
            kr[n] = vr[n] = 0;
        }
    }
    uint32_t* kt = dst;  /* [2][DV][16][16] */
    for (int g = 0; g < 2; g++)
        for (int s = 0; s < DV; s++) {
            /* 16 keys' dim pairs as rows, transposed in registers (16 scatters a tile were
               a measurable share of the kernel for 128-token prompts) */
            __m512 r[16];
            for (int n = 0; n < 16; n++) {
                const vx_bf16* p = kr[16 * g + n];
                r[n] = p ? _mm512_castsi512_ps(_mm512_loadu_si512((const void*)(p + 32 * s)))
                         : _mm512_setzero_ps();
            }
            vx_transpose16(r);
            uint32_t* t = kt + (int64_t)(g * DV + s) * 256;
            for (int j = 0; j < 16; j++)
                _mm512_store_si512((void*)(t + 16 * j), _mm512_castps_si512(r[j]));
        }
    uint32_t* vt = dst + (int64_t)2 * DV * 256;  /* [D / 16][16][16] */
    const __m512i il = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                        40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                        32, 0);
    for (int c = 0; c < D / 16; c++)
        for (int j = 0; j < 16; j++) {
            const vx_bf16 *a = vr[2 * j], *b = vr[2 * j + 1];
            const __m512i x = a ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + 16 * c)))
                                : _mm512_setzero_si512();
            const __m512i y = b ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(b + 16 * c)))
                                : _mm512_setzero_si512();
            _mm512_store_si512((void*)(vt + (int64_t)c * 256 + 16 * j),
                               _mm512_permutex2var_epi16(x, il, y));
        }
}
/* No window: a row's first valid key far before any chunk. */
#define VX_PF_NO_LO (-(1 << 30))
/* The first 32-key pair a query at position p needs (its window's first key, W > 0), as a key:
   chunks start there. */
VX_INLINE int vx_pf_first(int p, int W) {
    const int f = W > 0 && p - W + 1 > 0 ? p - W + 1 : 0;
    return f & ~31;
}
/* The first key (relative to a chunk at c0, p = the query's position - c0) of a window. */
VX_INLINE int vx_pf_lo(int p, int W) { return W > 0 ? p - W + 1 : VX_PF_NO_LO; }
/* Lane r = op-reduction of v[r] over its 16 lanes, for 16 vectors at once, in
   _mm512_reduce_add_ps's order (GCC's: the 256-bit halves, the 128-bit halves, then lanes
   (0 + 2) + (1 + 3)), so the sums are its bits; max is exact in any order. */
#define VX_PF_REDUCE16(NAME, OP)                                                              \
VX_INLINE __m512 NAME(const __m512* v) {                                                      \
    __m512 s[8], w[4];                                                                        \
    for (int i = 0; i < 8; i++)  /* rows 2i, 2i + 1: blocks (0 op 2, 1 op 3) */               \
        s[i] = OP(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),                         \
                  _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));                        \
    for (int i = 0; i < 4; i++)  /* block k: row 4i + k, (0 op 2) op (1 op 3) */              \
        w[i] = OP(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),                         \
                  _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));                        \
    const __m512 p0 = OP(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));     \
    const __m512 p1 = OP(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));     \
    const __m512 r = OP(_mm512_shuffle_ps(p0, p1, 0x44), _mm512_shuffle_ps(p0, p1, 0xEE));    \
    /* lane 4k + j holds row 4j + k */                                                        \
    return _mm512_permutexvar_ps(                                                             \
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), r);           \
}
VX_PF_REDUCE16(vx_pf_reduce_add16, _mm512_add_ps)
VX_PF_REDUCE16(vx_pf_reduce_max16, _mm512_max_ps)
/* The score mask value: -2^100, so that its product with the scale is exact and a row whose
   first chunk is all masked (a window's start past it) gets max - max = 0 exactly, no NaN;
   the later chunks' correction 2^(that max - the real max) clamps at 2^-125, which removes
   what those masked keys added. In any other row it acts as -inf did (2^-125 after the clamp). */
#define VX_PF_MASKED (-1.2676506002282294e30f)
/* Gemma 2's soft-cap on raw scores (unscaled q.k): s -> (cap / scale) tanh(s scale / cap), so
   that the softmax's scale gives cap * tanh(s scale / cap); cin = scale / cap, cout = cap /
   scale. */
VX_INLINE __m512 vx_pf_cap16(__m512 s, float cin, float cout) {
    return _mm512_mul_ps(vx_tanh16(_mm512_mul_ps(s, _mm512_set1_ps(cin))), _mm512_set1_ps(cout));
}
/* One chunk's softmax for 16 rows of an item (sb, pb, mx, sum and corr point at the first of
   them; row r's valid keys in the chunk are [lo0 + r, nv0 + r): lo0 from the window, very
   negative without one), soft-capped first where cin > 0, the rows interleaved (one row at a time is a
   chain of dependent max, reduce, exp and sum steps that leaves the core idle). Keys past a
   row's own position, and past the chunk up to its last 32-key pair, get -inf first: exp gives
   ~2.4e-38 for them (vx_exp2_16 clamps at -125), nothing next to the row's max term of 1. Rows
   past the item's queries (zero queries) too: no stale reads. Then the running max and its
   correction, the probabilities (rounded to bf16, into pb) and the running sums. */
VX_INLINE void vx_pf_softmax16(float (*sb)[VX_PCH], vx_bf16 (*pb)[VX_PCH], float* mx, float* sum,
                               float* corr, int nv0, int lo0, int cnt, int np, __m512 sv,
                               float cin, float cout) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), masked = _mm512_set1_ps(VX_PF_MASKED);
    if (cin > 0.f)
        for (int r = 0; r < 16; r++)
            for (int t = 0; t < 2 * np; t++)
                _mm512_store_ps(&sb[r][16 * t], vx_pf_cap16(_mm512_load_ps(&sb[r][16 * t]), cin, cout));
    for (int r = 0; r < 16; r++) {
        int nv = nv0 + r;
        nv = nv < 0 ? 0 : nv > cnt ? cnt : nv;
        for (int t = nv / 16; t < 2 * np; t++) {
            const int left = nv - 16 * t;
            const __mmask16 k = left <= 0 ? (__mmask16)0xFFFF : (__mmask16)(0xFFFFu << left);
            _mm512_mask_store_ps(&sb[r][16 * t], k, masked);
        }
        int lo = lo0 + r;  /* keys before the window */
        lo = lo < 0 ? 0 : lo > nv ? nv : lo;
        for (int t = 0; 16 * t < lo; t++) {
            const int left = lo - 16 * t;
            const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            _mm512_mask_store_ps(&sb[r][16 * t], k, masked);
        }
    }
    __m512 run[16];
    for (int r = 0; r < 16; r++) run[r] = ninf;
    for (int t = 0; t < 2 * np; t++)
        for (int r = 0; r < 16; r++) run[r] = _mm512_max_ps(run[r], _mm512_load_ps(&sb[r][16 * t]));
    {
        const __m512 mo = _mm512_load_ps(mx);
        const __m512 mn = _mm512_max_ps(mo, _mm512_mul_ps(vx_pf_reduce_max16(run), sv));
        _mm512_store_ps(corr, vx_exp2_16(_mm512_sub_ps(mo, mn)));  /* ~0 on the first chunk */
        _mm512_store_ps(mx, mn);
    }
    __m512 rs[16];
    for (int r = 0; r < 16; r++) {  /* keys within a row are independent: row by row */
        const __m512 mv = _mm512_set1_ps(mx[r]);
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
        for (int t = 0; t < np; t++) {
            const __m512 e0 = vx_exp2_16_p(_mm512_fmsub_ps(_mm512_load_ps(&sb[r][32 * t]), sv, mv));
            const __m512 e1 = vx_exp2_16_p(_mm512_fmsub_ps(_mm512_load_ps(&sb[r][32 * t + 16]), sv, mv));
            s0 = _mm512_add_ps(s0, e0); s1 = _mm512_add_ps(s1, e1);
            _mm512_store_si512((void*)&pb[r][32 * t], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        rs[r] = _mm512_add_ps(s0, s1);
    }
    /* the 16 rows' sums at once (one reduction a row was a chain of ~25 cycles each):
       sum * corr + the chunk's, fused, as the compiler contracted the scalar form */
    _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), _mm512_load_ps(corr),
                                          vx_pf_reduce_add16(rs)));
}
/* An item's state before its first chunk: R query rows copied in (rows past m zero, row
   stride ldq), the output accumulators (stride lda) at 0, no max, no sum. */
VX_INLINE void vx_pf_init(vx_bf16* qb, int ldq, float* acc, int lda, float* mx, float* sum,
                          int R, const vx_bf16* q, int64_t q_st, int t0, int m, int D) {
    for (int r = 0; r < R; r++) {
        if (r < m) memcpy(qb + r * ldq, q + (int64_t)(t0 + r) * q_st, (size_t)D * 2);
        else memset(qb + r * ldq, 0, (size_t)D * 2);
        memset(acc + r * lda, 0, sizeof(float) * D);
        mx[r] = -INFINITY; sum[r] = 0.f;
    }
}
/* After a chunk's P V: acc = acc * corr + ob for rows [0, m) (row strides in floats). */
VX_INLINE void vx_pf_rescale(float* acc, int lda, const float* ob, int ldo, const float* corr,
                             int m, int D) {
    for (int r = 0; r < m; r++) {
        const __m512 cv = _mm512_set1_ps(corr[r]);
        for (int d = 0; d < D; d += 16)
            _mm512_store_ps(acc + r * lda + d, _mm512_fmadd_ps(_mm512_load_ps(acc + r * lda + d),
                                                               cv, _mm512_load_ps(ob + r * ldo + d)));
    }
}
/* Rows [t0, t0 + m) of out = acc / sum in bf16 (divided, not times 1 / sum: torch's rounding). */
VX_INLINE void vx_pf_store(const float* acc, int lda, const float* sum, vx_bf16* out,
                           int64_t o_st, int t0, int m, int D) {
    for (int r = 0; r < m; r++) {
        const __m512 sv = _mm512_set1_ps(sum[r]);
        vx_bf16* o = out + (int64_t)(t0 + r) * o_st;
        for (int d = 0; d < D; d += 32)
            _mm512_storeu_si512((void*)(o + d), (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_div_ps(_mm512_load_ps(acc + r * lda + d + 16), sv),
                _mm512_div_ps(_mm512_load_ps(acc + r * lda + d), sv)));
    }
}
#endif
#ifdef VX_HAS_AMX
/* One (chunk, query head, 16 queries) item, rows [t0, t0 + m) of the chunk, for D > 64 (DV > 2:
   the Q tiles do not stay in tile registers; vx_pf_item32 takes D <= 64). */
VX_INLINE void vx_pf_item(const vx_bf16* q, int64_t q_st, vx_bf16* out, int64_t o_st,
                          const uint32_t* packed, int nc, int t0, int m, float scale, int DV,
                          int W, float cin, float cout) {
    const int D = 32 * DV, ND = D / 16;
    vx_bf16 qb[16][256] __attribute__((aligned(64)));
    float sb[16][VX_PCH] __attribute__((aligned(64)));
    vx_bf16 pb[16][VX_PCH] __attribute__((aligned(64)));
    float ob[16][256] __attribute__((aligned(64)));
    float acc[16][256] __attribute__((aligned(64)));
    float mx[16] __attribute__((aligned(64))), sum[16], corr[16] __attribute__((aligned(64)));
    vx_pf_init(&qb[0][0], 256, &acc[0][0], 256, mx, sum, 16, q, q_st, t0, m, D);
    const int kv_end = nc + t0 + m;
    const int64_t pair_dw = (int64_t)4 * DV * 256;  /* dwords per 32 packed keys */
    for (int c0 = vx_pf_first(nc + t0, W); c0 < kv_end; c0 += VX_PCH) {
        const int cnt = kv_end - c0 < VX_PCH ? kv_end - c0 : VX_PCH;
        const int ng = (cnt + 15) / 16, np = (cnt + 31) / 32;
        for (int g = 0; g < ng; g++) {  /* S = Q K^T, 16 keys a tile, DV dim slices */
            const int kb = c0 / 16 + g;
            const uint32_t* kt = packed + (kb / 2) * pair_dw + (int64_t)(kb % 2) * DV * 256;
            _tile_zero(0);
            for (int s = 0; s < DV; s++) {
                _tile_loadd(2, kt + s * 256, 64); _tile_loadd(6, &qb[0][32 * s], 512);
                _tile_dpbf16ps(0, 6, 2);
            }
            _tile_stored(0, &sb[0][16 * g], VX_PCH * 4);
        }
        const __m512 sv = _mm512_set1_ps(scale * 1.44269504088896341f);
        vx_pf_softmax16(sb, pb, mx, sum, corr, nc + t0 + 1 - c0, vx_pf_lo(nc + t0 - c0, W), cnt,
                        np, sv, cin, cout);
        /* O_chunk = P V, four 16-dim tiles at a time */
        for (int d0 = 0; d0 < ND; d0 += 4) {
            const int nt = ND - d0 < 4 ? ND - d0 : 4;
            _tile_zero(0);
            if (nt > 1) _tile_zero(1);
            if (nt > 2) _tile_zero(2);
            if (nt > 3) _tile_zero(3);
            for (int p = 0; p < np; p++) {
                const uint32_t* vt = packed + (c0 / 32 + p) * pair_dw + (int64_t)2 * DV * 256
                                     + (int64_t)d0 * 256;
                _tile_loadd(4, &pb[0][32 * p], VX_PCH * 2);  /* V in tiles 5, 6, 7 in turn */
                _tile_loadd(5, vt, 64); _tile_dpbf16ps(0, 4, 5);
                if (nt > 1) { _tile_loadd(6, vt + 256, 64); _tile_dpbf16ps(1, 4, 6); }
                if (nt > 2) { _tile_loadd(7, vt + 512, 64); _tile_dpbf16ps(2, 4, 7); }
                if (nt > 3) { _tile_loadd(5, vt + 768, 64); _tile_dpbf16ps(3, 4, 5); }
            }
            _tile_stored(0, &ob[0][16 * d0], 1024);
            if (nt > 1) _tile_stored(1, &ob[0][16 * d0 + 16], 1024);
            if (nt > 2) _tile_stored(2, &ob[0][16 * d0 + 32], 1024);
            if (nt > 3) _tile_stored(3, &ob[0][16 * d0 + 48], 1024);
        }
        vx_pf_rescale(&acc[0][0], 256, &ob[0][0], 256, corr, m, D);
    }
    vx_pf_store(&acc[0][0], 256, sum, out, o_st, t0, m, D);
}
/* Two query tiles (32 rows, [t0, t0 + m), m <= 32) of GH <= VX_PF_GH query heads that share
   one kv head (q and out: head g at g * q_sh, g * o_sh), for D <= 64 (DV <= 2): each K and V
   tile, loaded once, serves both row tiles (the 16-row item loads each once per 16 rows, and
   those loads from L2 were what its tile products waited on), and each 256-key chunk of packed
   K and V (64 KB at D = 64) serves the GH heads in turn while it is in L1/L2, where one head
   per item streamed its kv head's whole packed context from L2 or L3 once per query head.
   The same arithmetic as vx_pf_item, row by row, head by head. Tiles: S phase 0, 1 (S of rows
   0-15, 16-31), 2, 3 (K), 4, 5 (Q rows 0-15, dims 0-31, 32-63), 6, 7 (Q rows 16-31); P V phase
   0-3 (O of row tile i, dim tile j of the pass: 2 i + j), 4, 5 (P of rows 0-15, 16-31), 6, 7
   (V). */
VX_INLINE void vx_pf_item32(const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out,
                            int64_t o_st, int64_t o_sh, int GH, const uint32_t* packed, int nc,
                            int t0, int m, float scale, int DV, int W, float cin, float cout) {
    const int D = 32 * DV, ND = D / 16;
    vx_bf16 qb[VX_PF_GH][32][64] __attribute__((aligned(64)));
    float sb[32][VX_PCH] __attribute__((aligned(64)));
    vx_bf16 pb[32][VX_PCH] __attribute__((aligned(64)));
    float ob[32][64] __attribute__((aligned(64)));
    float acc[VX_PF_GH][32][64] __attribute__((aligned(64)));
    float mx[VX_PF_GH][32] __attribute__((aligned(64))), sum[VX_PF_GH][32];
    float corr[32] __attribute__((aligned(64)));
    for (int g = 0; g < GH; g++)
        vx_pf_init(&qb[g][0][0], 64, &acc[g][0][0], 64, mx[g], sum[g], 32, q + g * q_sh, q_st,
                   t0, m, D);
    const int kv_end = nc + t0 + m;
    const int64_t pair_dw = (int64_t)4 * DV * 256;  /* dwords per 32 packed keys */
    const __m512 sv = _mm512_set1_ps(scale * 1.44269504088896341f);
    for (int c0 = vx_pf_first(nc + t0, W); c0 < kv_end; c0 += VX_PCH) {
        const int cnt = kv_end - c0 < VX_PCH ? kv_end - c0 : VX_PCH;
        const int ng = (cnt + 15) / 16, np = (cnt + 31) / 32;
        for (int hg = 0; hg < GH; hg++) {
            _tile_loadd(4, &qb[hg][0][0], 128);
            _tile_loadd(6, &qb[hg][16][0], 128);
            if (DV == 2) {
                _tile_loadd(5, &qb[hg][0][32], 128);
                _tile_loadd(7, &qb[hg][16][32], 128);
            }
            for (int g = 0; g < ng; g++) {  /* S = Q K^T, 16 keys a step, both row tiles */
                const int kb = c0 / 16 + g;
                const uint32_t* kt = packed + (kb / 2) * pair_dw + (int64_t)(kb % 2) * DV * 256;
                _tile_zero(0); _tile_zero(1);
                _tile_loadd(2, kt, 64);
                if (DV == 2) _tile_loadd(3, kt + 256, 64);
                _tile_dpbf16ps(0, 4, 2); _tile_dpbf16ps(1, 6, 2);
                if (DV == 2) { _tile_dpbf16ps(0, 5, 3); _tile_dpbf16ps(1, 7, 3); }
                _tile_stored(0, &sb[0][16 * g], VX_PCH * 4);
                _tile_stored(1, &sb[16][16 * g], VX_PCH * 4);
            }
            for (int h = 0; h < 32; h += 16)
                vx_pf_softmax16(sb + h, pb + h, mx[hg] + h, sum[hg] + h, corr + h,
                                nc + t0 + h + 1 - c0, vx_pf_lo(nc + t0 + h - c0, W), cnt, np,
                                sv, cin, cout);
            for (int d0 = 0; d0 < ND; d0 += 2) {  /* O_chunk = P V, two 16-dim tiles a pass */
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int p = 0; p < np; p++) {
                    const uint32_t* vt = packed + (c0 / 32 + p) * pair_dw + (int64_t)2 * DV * 256
                                         + (int64_t)d0 * 256;
                    _tile_loadd(4, &pb[0][32 * p], VX_PCH * 2);
                    _tile_loadd(5, &pb[16][32 * p], VX_PCH * 2);
                    _tile_loadd(6, vt, 64);
                    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(2, 5, 6);
                    _tile_loadd(7, vt + 256, 64);
                    _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, &ob[0][16 * d0], 256);
                _tile_stored(1, &ob[0][16 * d0 + 16], 256);
                _tile_stored(2, &ob[16][16 * d0], 256);
                _tile_stored(3, &ob[16][16 * d0 + 16], 256);
            }
            vx_pf_rescale(&acc[hg][0][0], 64, &ob[0][0], 64, corr, m, D);
        }
    }
    for (int g = 0; g < GH; g++)
        vx_pf_store(&acc[g][0][0], 64, sum[g], out + g * o_sh, o_st, t0, m, D);
}
#endif
