/* The bf16 prefill attention for CPUs with AVX2 and no AVX-512.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library, before
   prefill_amx.c, whose `vx_prefill_attention_bf16` hands chunks to it where AMX is
   absent). It uses the AVX2 helpers of eltwise.c (`vx_ld8_bf16`).

   Why it exists: without AMX the prefill chunks went to torch's SDPA, far below the FMA units'
   rate on a 2-core AVX2 EPYC at 128 and 2,048 tokens alike (measured), plus one SDPA (and a
   gather of the cached blocks) per chunk
   per layer. Here every chunk of a step is one call per layer, the products run on an FMA
   register tile (6 rows by 16 columns) like a GEMM's, and the cached prefix is read in place
   through the block table.

   Arguments and layouts: those of `vx_prefill_attention_bf16` (prefill_amx.c):
   q/out [T, Hq, D] with any row strides, chunk i owning rows [starts[i], starts[i] + lens[i]);
   caches [Hkv, NB, BS, D] by strides, the chunk's own K/V already written; bt [nchunks, >=
   ceil(ctx / BS)]; query j of chunk i at position computed[i] + j sees keys [0, computed[i] + j],
   only (computed[i] + j - window, computed[i] + j] with a sliding `window` > 0; with a
   `softcap` > 0 each score s is cap * tanh(s * scale / cap) first. Keys before a chunk's first
   query's window are neither packed nor read.

   Two passes on torch's OpenMP pool:
   1. every (chunk, kv head, 16 keys) is widened to fp32 out of the paged cache: K transposed
      into panels [D][16] (the S tile's B operand), V as rows [16][D]; keys past the context zero;
   2. every (chunk, kv head, up to 16 queries) item takes the kv head's G query heads together
      (rows query-major, G per query), its keys VX_PFA_KC at a time: S = Q K^T (Q pre-scaled by
      scale * log2 e), per row the running max, 2^(s - max) (only for the keys the row sees; the
      rest are exactly 0) and sum, then O = O * 2^(old max - new max) + P V; at the end O / sum,
      rounded once to bf16. fp32 throughout (P is not rounded to bf16, unlike SDPA's and the AMX
      kernel's). Items with the most keys go first (dynamic schedule).
   Returns -2 where it does not apply (D % 8, D > 256, Hq % Hkv, no chunks) before writing
   anything; -1 if scratch could not be allocated (the caller then uses SDPA). */
#include "vx_kernels.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define VX_PFA_AVX2 1
#define VX_PFA_KC 128  /* keys per softmax chunk: the S rows of an item stay in L1/L2 */
#define VX_PFA_QT 16   /* queries per item */
/* 2^x on 8 lanes, x >= -125 after the clamp (so 2^n stays normal): n = round(x), r = x - n in
   [-1/2, 1/2], 2^r by VX_EXP2_POLY (decode_attention.c), 2^n by the exponent. */
static inline __m256 vx_exp2_8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(x, n);
    const __m256 p = VX_EXP2_POLY(_mm256_fmadd_ps, _mm256_set1_ps, r);
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* The register tile both products run on (a GEMM's micro-kernel: 12 accumulators, 8 loads per
   12 FMAs), for NR (<= 6) rows: C[i][0..16) = a[i] C[i][0..16) + sum_{k < K} A[i][k] B[k][0..16),
   with a[i] = 0 where alpha is NULL (C is then only written). S = Q K^T: A = Q, B = the K^T
   panel, K = D. O = alpha O + P V: A = P, B = V rows, K = the chunk's keys. */
static inline __attribute__((always_inline)) void vx_pfa_tile(
        const float* A, int a_ld, const float* B, int b_ld, int K, float* C, int c_ld,
        const float* alpha, const int NR) {
    __m256 c0[6], c1[6];
    for (int i = 0; i < 6; i++)
        if (i < NR) {
            if (alpha) {
                const __m256 a = _mm256_broadcast_ss(alpha + i);
                c0[i] = _mm256_mul_ps(a, _mm256_load_ps(C + i * c_ld));
                c1[i] = _mm256_mul_ps(a, _mm256_load_ps(C + i * c_ld + 8));
            } else {
                c0[i] = c1[i] = _mm256_setzero_ps();
            }
        }
    for (int k = 0; k < K; k++) {
        const __m256 b0 = _mm256_load_ps(B + k * b_ld), b1 = _mm256_load_ps(B + k * b_ld + 8);
        for (int i = 0; i < 6; i++)
            if (i < NR) {
                const __m256 ab = _mm256_broadcast_ss(A + i * a_ld + k);
                c0[i] = _mm256_fmadd_ps(ab, b0, c0[i]);
                c1[i] = _mm256_fmadd_ps(ab, b1, c1[i]);
            }
    }
    for (int i = 0; i < 6; i++)
        if (i < NR) {
            _mm256_store_ps(C + i * c_ld, c0[i]);
            _mm256_store_ps(C + i * c_ld + 8, c1[i]);
        }
}
#define VX_PFA_TILES(CALL)                                   \
    switch (nr) {                                            \
    case 6: CALL(6); break; case 5: CALL(5); break;          \
    case 4: CALL(4); break; case 3: CALL(3); break;          \
    case 2: CALL(2); break; default: CALL(1); break;         \
    }
/* Columns [16 j, 16 j + 16) of rows' O where D % 16 == 8: the last 8 dims on their own. */
static void vx_pfa_pv8(const float* P, int p_ld, const float* alpha, const float* V, int D,
                       int kn, float* O, int nr) {
    for (int i = 0; i < nr; i++) {
        __m256 c = _mm256_mul_ps(_mm256_broadcast_ss(alpha + i), _mm256_load_ps(O + i * D));
        for (int k = 0; k < kn; k++)
            c = _mm256_fmadd_ps(_mm256_broadcast_ss(P + i * p_ld + k),
                                _mm256_load_ps(V + k * D), c);
        _mm256_store_ps(O + i * D, c);
    }
}
/* One item: R = m * G rows (query t0 + r / G, head hq0 + r % G) over keys [0, nkeys), or
   their window W (> 0); cap2 > 0: the soft-cap in the scores' log2 units (cap * log2 e).
   Kp, Vp: the panels addressed by key from key 0 (those before the first window never read). */
static void vx_pfa_item(const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out,
                        int64_t o_st, int64_t o_sh, const float* Kp, const float* Vp,
                        int computed, int t0, int m, int G, int D, float qscale, float* Q,
                        float* O, float* S, float* mx, float* l, float* alpha, int W,
                        float cap2) {
    const int R = m * G, D16 = D & ~15;
    for (int r = 0; r < R; r++) {
        const vx_bf16* qr = q + (int64_t)(t0 + r / G) * q_st + (int64_t)(r % G) * q_sh;
        for (int d = 0; d < D; d += 8)
            _mm256_store_ps(Q + r * D + d, _mm256_mul_ps(vx_ld8_bf16(qr + d),
                                                         _mm256_set1_ps(qscale)));
        for (int d = 0; d < D; d++) O[r * D + d] = 0.f;
        mx[r] = -INFINITY; l[r] = 0.f;
    }
    const int nkeys = computed + t0 + m;  /* the last query sees keys [0, nkeys) */
    const int first = W > 0 && computed + t0 - W + 1 > 0 ? computed + t0 - W + 1 : 0;
    for (int k0 = first & ~15; k0 < nkeys; k0 += VX_PFA_KC) {
        const int kn = nkeys - k0 < VX_PFA_KC ? nkeys - k0 : VX_PFA_KC;
        const int kn16 = (kn + 15) & ~15;
        /* S = Q K^T over this chunk's panels */
        for (int r0 = 0; r0 < R; r0 += 6) {
            const int nr = R - r0 < 6 ? R - r0 : 6;
            for (int p = 0; p < kn16; p += 16) {
#define VX_PFA_S(N) vx_pfa_tile(Q + r0 * D, D, Kp + (int64_t)(k0 + p) * D, 16, D, \
                                S + r0 * VX_PFA_KC + p, VX_PFA_KC, NULL, N)
                VX_PFA_TILES(VX_PFA_S)
#undef VX_PFA_S
            }
        }
        /* the running softmax: keys past a row's position get p = 0 exactly */
        for (int r = 0; r < R; r++) {
            float* s = S + r * VX_PFA_KC;
            const int see = computed + t0 + r / G - k0 + 1;
            const int kv = see < kn ? see : kn;
            /* the row's window's first key in the chunk: keys before it get p = 0 too */
            const int lw = W > 0 ? see - W : 0, k1 = lw < 0 ? 0 : lw;
            if (kv <= 0 || k1 >= kv) {
                for (int k = 0; k < kn; k++) s[k] = 0.f;
                alpha[r] = 1.f;
                continue;
            }
            if (cap2 > 0.f) vx_softcap_avx2(s + k1, kv - k1, cap2);
            __m256 mv = _mm256_set1_ps(mx[r]);
            int k = k1;
            for (; k + 8 <= kv; k += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + k));
            float t8[8], mnew;
            _mm256_storeu_ps(t8, mv);
            mnew = t8[0];
            for (int i = 1; i < 8; i++) mnew = t8[i] > mnew ? t8[i] : mnew;
            for (; k < kv; k++) mnew = s[k] > mnew ? s[k] : mnew;
            const __m256 mb = _mm256_set1_ps(mnew);
            __m256 sum = _mm256_setzero_ps();
            for (k = 0; k < k1; k++) s[k] = 0.f;
            for (k = k1; k + 8 <= kv; k += 8) {
                const __m256 e = vx_exp2_8(_mm256_sub_ps(_mm256_loadu_ps(s + k), mb));
                _mm256_storeu_ps(s + k, e);
                sum = _mm256_add_ps(sum, e);
            }
            _mm256_storeu_ps(t8, sum);
            float tot = 0.f;
            for (int i = 0; i < 8; i++) tot += t8[i];
            if (k < kv) {  /* the row's last keys: 8 lanes, those past kv zeroed */
                float tail[8];
                for (int i = 0; i < 8; i++) tail[i] = k + i < kv ? s[k + i] - mnew : -200.f;
                _mm256_storeu_ps(tail, vx_exp2_8(_mm256_loadu_ps(tail)));
                for (int i = 0; k + i < kv; i++) { s[k + i] = tail[i]; tot += tail[i]; }
                k = kv;
            }
            for (; k < kn; k++) s[k] = 0.f;
            /* mx = -inf before the first chunk: 2^-inf would be clamped, so alpha is 0 */
            const float a = mx[r] == -INFINITY ? 0.f : vx_exp2_8(_mm256_set1_ps(mx[r] - mnew))[0];
            alpha[r] = a;
            l[r] = l[r] * a + tot;
            mx[r] = mnew;
        }
        /* O = alpha O + P V */
        for (int r0 = 0; r0 < R; r0 += 6) {
            const int nr = R - r0 < 6 ? R - r0 : 6;
            for (int d0 = 0; d0 < D16; d0 += 16) {
#define VX_PFA_PV(N) vx_pfa_tile(S + r0 * VX_PFA_KC, VX_PFA_KC, \
                                 Vp + (int64_t)k0 * D + d0, D, kn, O + r0 * D + d0, D, \
                                 alpha + r0, N)
                VX_PFA_TILES(VX_PFA_PV)
#undef VX_PFA_PV
            }
            if (D16 < D)
                vx_pfa_pv8(S + r0 * VX_PFA_KC, VX_PFA_KC, alpha + r0, Vp + (int64_t)k0 * D + D16,
                           D, kn, O + r0 * D + D16, nr);
        }
    }
    for (int r = 0; r < R; r++) {
        vx_bf16* orow = out + (int64_t)(t0 + r / G) * o_st + (int64_t)(r % G) * o_sh;
        const float inv = 1.f / l[r];
        for (int d = 0; d < D; d++) orow[d] = st_bf16(O[r * D + d] * inv);
    }
}
int vx_prefill_attention_bf16_avx2(
        const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh,
        const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss,
        const int32_t* bt, int64_t bt_s, const int32_t* starts, const int32_t* lens,
        const int32_t* computed, int nchunks, int Hq, int Hkv, int D, int BS, float scale,
        int window, float softcap) {
    if (D % 8 || D > 256 || Hkv < 1 || Hq % Hkv || nchunks < 1) return -2;
    const int G = Hq / Hkv;
    /* chunk i's first panel: the one its first query's window starts in */
#define VX_PFA_P0(i) (window > 0 && computed[i] - window + 1 > 0 ? (computed[i] - window + 1) / 16 : 0)
    /* per chunk: first packed panel (of Hkv * panels), first work item */
    int64_t* pn0 = (int64_t*)malloc(sizeof(int64_t) * (size_t)(2 * nchunks + 2));
    if (!pn0) return -1;
    int64_t* it0 = pn0 + nchunks + 1;
    pn0[0] = it0[0] = 0;
    for (int i = 0; i < nchunks; i++) {
        pn0[i + 1] = pn0[i] + (int64_t)Hkv * ((computed[i] + lens[i] + 15) / 16 - VX_PFA_P0(i));
        it0[i + 1] = it0[i] + (int64_t)Hkv * ((lens[i] + VX_PFA_QT - 1) / VX_PFA_QT);
    }
    const int64_t npn = pn0[nchunks], nit = it0[nchunks], panel = (int64_t)16 * D;
    /* K panels [D][16], then V rows [16][D], for every (chunk, kv head, 16 keys) */
    float* packed = (float*)aligned_alloc(32, (size_t)(2 * npn * panel) * sizeof(float) + 32);
    if (!packed) { free(pn0); return -1; }
    float* vpacked = packed + npn * panel;
    int failed = 0;
    _Pragma("omp parallel reduction(| : failed)") {
    _Pragma("omp for schedule(static)")
    for (int64_t w = 0; w < npn; w++) {
        int i = 0;
        while (pn0[i + 1] <= w) i++;
        const int ctx = computed[i] + lens[i], p0 = VX_PFA_P0(i), per = (ctx + 15) / 16 - p0;
        const int h = (int)((w - pn0[i]) / per), pn = p0 + (int)((w - pn0[i]) % per);
        const int kfirst = window > 0 && computed[i] - window + 1 > 0 ? computed[i] - window + 1 : 0;
        float* kt = packed + w * panel;
        float* vr = vpacked + w * panel;
        for (int n = 0; n < 16; n++) {
            const int key = 16 * pn + n;
            if (key < ctx && key >= kfirst) {  /* before kfirst: no query's window (zeros) */
                const int64_t o = (int64_t)h * c_sh + (int64_t)bt[i * bt_s + key / BS] * c_sb
                                  + (int64_t)(key % BS) * c_ss;
                for (int d = 0; d < D; d += 8) {
                    const __m256 kv8 = vx_ld8_bf16(kc + o + d);
                    float t8[8];
                    _mm256_storeu_ps(t8, kv8);
                    for (int j = 0; j < 8; j++) kt[(d + j) * 16 + n] = t8[j];
                    _mm256_store_ps(vr + n * D + d, vx_ld8_bf16(vc + o + d));
                }
            } else {
                for (int d = 0; d < D; d++) { kt[d * 16 + n] = 0.f; vr[n * D + d] = 0.f; }
            }
        }
    }
    const int RM = VX_PFA_QT * G;
    float* Q = (float*)aligned_alloc(  /* a size that is a multiple of the alignment (C11) */
        32, sizeof(float) * (((size_t)(2 * RM * D + RM * VX_PFA_KC + 3 * RM) + 7) & ~(size_t)7));
    float* O = Q + RM * D;
    float* S = O + RM * D;
    float* mx = S + RM * VX_PFA_KC;
    /* every thread reaches the loop (a worksharing construct), with scratch or not */
    _Pragma("omp for schedule(dynamic, 1)")
    for (int64_t w = 0; w < nit; w++) {
        if (!Q) { failed = 1; continue; }
        int i = 0;
        while (it0[i + 1] <= w) i++;
        const int nq = (lens[i] + VX_PFA_QT - 1) / VX_PFA_QT;
        /* the last query tile (most keys) of each kv head first */
        const int qt = nq - 1 - (int)((w - it0[i]) / Hkv), h = (int)((w - it0[i]) % Hkv);
        const int t0 = VX_PFA_QT * qt;
        const int m = lens[i] - t0 < VX_PFA_QT ? lens[i] - t0 : VX_PFA_QT;
        const int p0 = VX_PFA_P0(i);
        /* addressed by absolute panel index (the item indexes panels by key / 16) */
        const int64_t pw = pn0[i] + (int64_t)h * ((computed[i] + lens[i] + 15) / 16 - p0) - p0;
        vx_pfa_item(q + (int64_t)starts[i] * q_st + (int64_t)h * G * q_sh, q_st, q_sh,
                    out + (int64_t)starts[i] * o_st + (int64_t)h * G * o_sh, o_st, o_sh,
                    packed + pw * panel, vpacked + pw * panel, computed[i], t0, m, G, D,
                    scale * 1.4426950408889634f, Q, O, S, mx, mx + RM, mx + 2 * RM, window,
                    softcap > 0.f ? softcap * 1.4426950408889634f : 0.f);
    }
    free(Q);
    }
    free(packed);
    free(pn0);
#undef VX_PFA_P0
    return failed ? -1 : 0;
}
#endif
