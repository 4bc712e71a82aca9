/* The decode attention over the paged KV cache (the portable kernel for fp32 and bf16, the
   AVX512-BF16 one with AMX for q.k where the CPU has it), and the KV write through a slot
   mapping; with the AMX switches (`vx_amx_on`) the later files share.

   Runs in: the Worker process (`vx.gpu.cpu.library` compiles the library once per machine and
   loads it with ctypes). */
/* One decode query per request against its paged K/V, fp32 math, bf16 or fp32 storage.
   Layouts: q/out [B, Hq, D] with any row strides; caches [Hkv, NB, BS, D] (strides given);
   bt [B, >= ceil(len / BS)] int32; lens [B] int32, each >= 1. Work items are (request, kv head)
   pairs (the fast kernel with AMX: (run of a request's rows, kv head)) on the OpenMP pool (torch's own libgomp, so the thread count is torch's); a small
   batch (under 8,192 key positions in all) runs on the calling thread: waking the pool costs
   more than it saves there.
   Every decode kernel also takes `window` (> 0: the query at position len - 1 sees only keys
   [len - window, len), HF's sliding window; <= 0: all) and `softcap` (> 0: each scaled score s
   becomes softcap * tanh(s / softcap) before the softmax, Gemma 2's; <= 0: none). Keys before
   the window are never read, so the blocks that hold only them may be freed and reused. */
#include "vx_kernels.h"
#define DECODE_KERNEL(NAME, T, LD, ST, EXP) \
int NAME(const T* q, int64_t q_st, int64_t q_sh, T* out, int64_t o_st, int64_t o_sh, \
         const T* kc, const T* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss, \
         const int32_t* bt, int64_t bt_s, const int32_t* lens, \
         int B, int Hq, int Hkv, int D, int BS, float scale, int max_len, int window, \
         float softcap) { \
    const int G = Hq / Hkv; int failed = 0; \
    _Pragma("omp parallel if ((int64_t)B * Hkv * max_len >= 8192)") { \
    float* sc = (float*)malloc(sizeof(float) * (size_t)G * (size_t)(max_len > 0 ? max_len : 1)); \
    float* qf = (float*)malloc(sizeof(float) * (size_t)G * D); \
    float* acc = (float*)malloc(sizeof(float) * (size_t)G * D); \
    float* row = (float*)malloc(sizeof(float) * (size_t)D); \
    if (!sc || !qf || !acc || !row) { failed = 1; } else { \
    _Pragma("omp for schedule(static)") \
    for (int64_t w = 0; w < (int64_t)B * Hkv; w++) { \
        const int b = (int)(w / Hkv), h = (int)(w % Hkv), len = lens[b]; \
        const int nblk = (len + BS - 1) / BS; \
        /* keys [lo, len): scores sit at their positions in sc, the rest is never read */ \
        const int lo = window > 0 && len > window ? len - window : 0; \
        for (int g = 0; g < G; g++) { \
            const T* qr = q + b * q_st + (int64_t)(h * G + g) * q_sh; \
            for (int d = 0; d < D; d++) qf[g * D + d] = LD(qr[d]) * scale; \
        } \
        for (int n = lo / BS; n < nblk; n++) { \
            const T* kb = kc + h * c_sh + (int64_t)bt[b * bt_s + n] * c_sb; \
            const int smax = (len - n * BS) < BS ? (len - n * BS) : BS; \
            for (int s = n * BS < lo ? lo - n * BS : 0; s < smax; s++) { \
                for (int d = 0; d < D; d++) row[d] = LD(kb[s * c_ss + d]); \
                for (int g = 0; g < G; g++) { \
                    float dot = 0.f; const float* qg = qf + g * D; \
                    for (int d = 0; d < D; d++) dot += qg[d] * row[d]; \
                    if (softcap > 0.f) dot = softcap * tanhf(dot / softcap); \
                    sc[(int64_t)g * len + n * BS + s] = dot; \
                } \
            } \
        } \
        for (int g = 0; g < G; g++) { \
            float* sg = sc + (int64_t)g * len; float m = sg[lo], sum = 0.f; \
            for (int j = lo + 1; j < len; j++) m = sg[j] > m ? sg[j] : m; \
            for (int j = lo; j < len; j++) { sg[j] = EXP(sg[j] - m); sum += sg[j]; } \
            const float inv = 1.f / sum; \
            for (int j = lo; j < len; j++) sg[j] *= inv; \
        } \
        memset(acc, 0, sizeof(float) * (size_t)G * D); \
        for (int n = lo / BS; n < nblk; n++) { \
            const T* vb = vc + h * c_sh + (int64_t)bt[b * bt_s + n] * c_sb; \
            const int smax = (len - n * BS) < BS ? (len - n * BS) : BS; \
            for (int s = n * BS < lo ? lo - n * BS : 0; s < smax; s++) { \
                for (int d = 0; d < D; d++) row[d] = LD(vb[s * c_ss + d]); \
                for (int g = 0; g < G; g++) { \
                    const float p = sc[(int64_t)g * len + n * BS + s]; float* ag = acc + g * D; \
                    for (int d = 0; d < D; d++) ag[d] += p * row[d]; \
                } \
            } \
        } \
        for (int g = 0; g < G; g++) { \
            T* orow = out + b * o_st + (int64_t)(h * G + g) * o_sh; \
            for (int d = 0; d < D; d++) orow[d] = ST(acc[g * D + d]); \
        } \
    } } \
    free(sc); free(qf); free(acc); free(row); } \
    return failed; \
}
/* Store new K/V rows at their slots (any dtype: byte strides; a negative slot is skipped). */
void vx_write_kv(const char* k, int64_t k_st, int64_t k_sh, const char* v, int64_t v_st,
                 int64_t v_sh, char* kc, char* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss,
                 int64_t row_bytes, const int64_t* slots, int T, int Hkv, int BS,
                 int64_t num_slots) {
    /* A prefill's rows on every thread: its slots are fresh cache lines, each store a miss
       (costly enough at long prompts to be worth splitting). */
    _Pragma("omp parallel for schedule(static) if (T >= 256)")
    for (int t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) continue;
        const int64_t at = (slot / BS) * c_sb + (slot % BS) * c_ss;
        for (int h = 0; h < Hkv; h++) {
            memcpy(kc + h * c_sh + at, k + t * k_st + h * k_sh, (size_t)row_bytes);
            memcpy(vc + h * c_sh + at, v + t * v_st + h * v_sh, (size_t)row_bytes);
        }
    }
}
DECODE_KERNEL(vx_decode_attention_f32, float, ld_f32, st_f32, expf)
DECODE_KERNEL(vx_decode_attention_bf16, vx_bf16, ld_bf16, st_bf16, expf)
/* The same computation for bf16 with AVX512-BF16 (when the compiler targets it), per
   (request, kv head) item in chunks of up to VX_CH keys with an online softmax (running max
   and sum per query head, the accumulator rescaled when the max grows), all scratch on the
   stack. Scores: 16 keys at a time, q.k as `vdpbf16ps` bf16-pair dot products into 16 fp32
   vectors, reduced together by a shuffle-add tree into one vector of 16 scores (the keys fed
   in a 4x4-transposed order so the tree's output lanes come out in key order). The softmax
   exp is vectorised (vx_exp16). p.V: fp32 FMAs, a V row's bf16 pairs split into its even and
   odd dims by a shift and a mask (no shuffle), several query heads' accumulators held in
   registers at once. With AMX (where the CPU, compiler and kernel allow it, `vx_fast_amx`)
   and blocks of a multiple of 16 keys, q.k is instead one tile product per 16 keys and 32
   dims: S^T = K . Q^T for all G query heads at once, K loaded as a tile straight from its block,
   and so is p.V (`vx_pv_tiles`: V tiles straight from the blocks, p rounded to bf16), whose cost
   then no longer grows with the item's columns (a drafting request's rows share an item).
   The K/V rows are prefetched ahead (blocks are scattered, the hardware prefetcher misses
   them), which is most of the gain at large batch, where the step is bound by memory.
   The pool is used from 2,048 key positions in all (the portable kernel: 8,192).
   The results differ from the portable kernel by fp32 summation order (the bf16 outputs
   agree to about one ulp), and with AMX by p's bf16 rounding too (as HF's bf16 attention).
   Returns -2 for a shape it does not handle (D % 32, D > 256, G > 16): the caller falls back. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define VX_HAS_FAST_BF16 1
#define VX_CH 256
#ifndef VX_PF
#define VX_PF 4  /* K prefetch distance in 16-key groups */
#endif
#ifndef VX_PAR_MIN
#define VX_PAR_MIN 2048  /* fewer key positions in all: the calling thread alone */
#endif
#define VX_INLINE static inline __attribute__((always_inline))
static int vx_amx_on = 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define VX_HAS_AMX 1
#include <unistd.h>
#include <sys/syscall.h>
#endif
#ifdef VX_HAS_AMX
/* Configures tiles 0 .. n-1 as 16 rows x 64 bytes on the calling thread (every OpenMP thread
   that uses AMX does this itself; _tile_release() after). */
static inline void vx_amx_load_tiles(int n) {
    struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; }
        cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < n; i++) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
}
#endif
/* AMX for q.k (1: on where the CPU and kernel allow it, which needs the process's permission
   for the tile state; 0: off; -1: leave as is). Returns whether it is on. */
int vx_fast_amx(int enable) {
    if (enable < 0) return vx_amx_on;
#ifdef VX_HAS_AMX
    static int allowed = -1;
    if (enable && allowed < 0)  /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA */
        allowed = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    vx_amx_on = enable && allowed > 0;
#else
    (void)enable;
#endif
    return vx_amx_on;
}
VX_INLINE __m512 vx_exp16(__m512 x) {  /* vx_expf on 16 lanes; 2^n by scalef */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(VX_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(VX_LN2_LO), r);
    return _mm512_scalef_ps(VX_EXP_POLY(_mm512_fmadd_ps, _mm512_set1_ps, r), n);
}
/* tanh on 16 lanes, from vx_exp16: (1 - e^-2|x|) / (1 + e^-2|x|) with x's sign (no overflow;
   within a few 1e-7 of tanhf, below the bf16 rounding of everything downstream). */
VX_INLINE __m512 vx_tanh16(__m512 x) {
    const __m512 e = vx_exp16(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.f)));
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), e),
                                   _mm512_add_ps(_mm512_set1_ps(1.f), e));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(
        _mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}
/* Gemma 2's logit soft-cap, cap * tanh(s / cap), on 16 scores; cap <= 0: s as it is. */
VX_INLINE __m512 vx_softcap16(__m512 s, float cap) {
    if (cap <= 0.f) return s;
    return _mm512_mul_ps(vx_tanh16(_mm512_div_ps(s, _mm512_set1_ps(cap))), _mm512_set1_ps(cap));
}
/* The lanes of 16 keys that count: [skip, left) (left: keys left in the chunk from the first
   lane; skip: the keys before a window's first, only in a chunk's first group). */
VX_INLINE __mmask16 vx_keys16(int left, int skip) {
    const __mmask16 v = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    return (__mmask16)(v & (0xFFFFu << skip));
}
/* Rows of n keys into L1 ahead of use: blocks are scattered, so the hardware prefetcher,
   which follows sequential lines within a page, does not see them coming. */
VX_INLINE void vx_prefetch_rows(const vx_bf16* base, const int64_t* off, int n, int DV) {
    for (int i = 0; i < n; i++)
        for (int v = 0; v < DV; v++) _mm_prefetch((const char*)(base + off[i] + 32 * v), _MM_HINT_T0);
}
/* a[i] holds 16 partial sums of input i; lane 4k+j of the result is the total of input 4j+k. */
VX_INLINE __m512 vx_hsum16(const __m512* a) {
    __m512 b[8], c[4], f[2];
    for (int j = 0; j < 8; j++)
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
    for (int m = 0; m < 4; m++)
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
    for (int m = 0; m < 2; m++)
        f[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], 0x88), _mm512_shuffle_ps(f[0], f[1], 0xDD));
}
/* The next (request, kv head) item's K and V blocks, fetched into L2 a few lines at a time
   while the current item computes: issued all at once, the prefetches filled the core's miss
   queue and stalled it until they had all landed, so memory and compute took turns. The
   same held for bursts: issued during head 0's q.k only (and p.V), most lines came early in
   the item while heads 1 .. G-1 ran with memory idle. They are now spread evenly over every
   head's q.k and p.V (measured shorter at 64 requests x 192 keys, 30 layers, one thread,
   blocks in DRAM, in alternated runs). */
#define VX_PF_BLOCKS 64  /* at most 64 blocks (1,024 keys of blocks of 16) */
typedef struct {
    const char* k[VX_PF_BLOCKS];
    const char* v[VX_PF_BLOCKS];
    int nblk, blk, line, lines;  /* lines: 64-byte lines per block (of K, and of V) */
    int credit;  /* steps owed, in 1/256 steps (a step: one line of K and one of V) */
} vx_pf_cursor;
/* Owes n/256 more steps and issues the whole ones. */
VX_INLINE void vx_pf_step(vx_pf_cursor* c, int n) {
    c->credit += n;
    n = c->credit >> 8;
    c->credit &= 255;
    for (; n > 0 && c->blk < c->nblk; n--) {
        _mm_prefetch(c->k[c->blk] + 64 * c->line, _MM_HINT_T1);
        _mm_prefetch(c->v[c->blk] + 64 * c->line, _MM_HINT_T1);
        if (++c->line == c->lines) { c->line = 0; c->blk++; }
    }
}
#ifdef VX_HAS_AMX
/* p.V of one chunk on AMX, every column of an item at once, no V copy: a tile of 16 keys' V
   rows is loaded straight from its block (B: a row's 32 dims as 16 bf16 pairs), and P enters
   twice, each key's p in the even slot of its pair (A_even: out[n][j] += p V[k][2j], the even
   dims) and in the odd slot (A_odd: the odd dims), the other slot 0. So `acc` keeps its even /
   odd layout. P is rounded to bf16 (as HF's bf16 attention does). A column's sums depend only
   on its own row of P, and keys past its count have p = 0 and add exact zeros: the same bits
   as in an item of its row alone. The chunk's last group, when partial, is copied with zero
   rows after its keys (a block's rows past them may hold anything). Then acc[n] = acc[n] *
   cor[n] + chunk (acc[n] = chunk on the first), for columns with keys here. Tiles 0-3: out
   (even, odd, of two 32-dim halves), 4, 5: A_even, A_odd, 6, 7: V; DV / 2 passes. Up to 8
   columns, A_odd is rows NC .. 2 NC - 1 of A_even's tile (and the odd sums those rows of the
   even tile), so a plain decode item (G columns) takes one A tile and half the products
   (docs/performance.md has the kernel's times against the vector p.V). */
#ifndef VX_PV_PF
#define VX_PV_PF 2  /* V rows into L1 this many 16-key groups ahead (p.V's first pass) */
#endif
VX_INLINE void vx_pv_tiles(const vx_bf16* vh, const int64_t* off, int cnt, int64_t c_ss,
                           float sc[16][VX_CH], const int* ncnt, const float* cor, int fold,
                           int NC, const int DV, __m512 acc[16][16], vx_pf_cursor* pf, int pq) {
    uint32_t pa[VX_CH / 16][2][16][16] __attribute__((aligned(64)));
    vx_bf16 vz[16][256] __attribute__((aligned(64)));
    float pv[4][16][16] __attribute__((aligned(64)));
    const int ng = (cnt + 15) / 16, part = cnt % 16, np = (DV + 1) / 2;
    const int merged = NC <= 8;  /* A_odd in rows NC .. 2 NC - 1 of A_even's tile */
    for (int n = 0; n < NC; n++) {  /* rows past NC: whatever the stack holds (their sums
                                       land in rows of out never read) */
        const int valid = (ncnt[n] + 15) / 16;
        for (int t = 0; t < ng; t++) {
            __m512i w = _mm512_setzero_si512();
            if (t < valid)
                w = _mm512_cvtepu16_epi32(
                    (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&sc[n][16 * t])));
            _mm512_store_si512((void*)pa[t][0][n], w);
            _mm512_store_si512(merged ? (void*)pa[t][0][NC + n] : (void*)pa[t][1][n],
                               _mm512_slli_epi32(w, 16));
        }
    }
    if (part)
        for (int i = 0; i < 16; i++) {
            const vx_bf16* src = vh + off[16 * (ng - 1) + i];
            for (int v = 0; v < DV; v++)
                _mm512_store_si512((void*)(vz[i] + 32 * v), i < part
                    ? _mm512_loadu_si512((const void*)(src + 32 * v)) : _mm512_setzero_si512());
        }
    for (int p = 0; p < np; p++) {  /* dims [64p, 64p + 64) */
        const int two = DV - 2 * p >= 2;
        _tile_zero(0); _tile_zero(1);
        if (two) { _tile_zero(2); _tile_zero(3); }
        for (int t = 0; t < ng; t++) {
            const int last = part && t == ng - 1;
            const vx_bf16* vr = (last ? vz[0] : vh + off[16 * t]) + 64 * p;
            const int64_t st = last ? 2 * 256 : 2 * c_ss;
            if (p == 0 && 16 * (t + VX_PV_PF) < cnt) {
                const int m = cnt - 16 * (t + VX_PV_PF);
                vx_prefetch_rows(vh, off + 16 * (t + VX_PV_PF), m < 16 ? m : 16, DV);
            }
            vx_pf_step(pf, 16 * NC * pq / np);
            _tile_loadd(4, pa[t][0], 64);
            _tile_loadd(6, vr, st);
            if (two) _tile_loadd(7, vr + 32, st);
            _tile_dpbf16ps(0, 4, 6);
            if (two) _tile_dpbf16ps(2, 4, 7);
            if (!merged) {
                _tile_loadd(5, pa[t][1], 64);
                _tile_dpbf16ps(1, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, pv[0], 64);
        if (!merged) _tile_stored(1, pv[1], 64);
        if (two) {
            _tile_stored(2, pv[2], 64);
            if (!merged) _tile_stored(3, pv[3], 64);
        }
        const int nt = two ? 4 : 2;
        for (int n = 0; n < NC; n++) {
            if (!ncnt[n]) continue;
            const __m512 cv = _mm512_set1_ps(cor[n]);
            for (int t = 0; t < nt; t++) {  /* t: even, odd (of half 0), even, odd (half 1) */
                const float* row = merged ? pv[t & ~1][(t & 1) * NC + n] : pv[t][n];
                const __m512 c = _mm512_load_ps(row);
                acc[n][4 * p + t] = fold ? _mm512_fmadd_ps(acc[n][4 * p + t], cv, c) : c;
            }
        }
    }
}
#endif
/* One item: R consecutive decode rows of one request (the same blocks: the 1 + k rows of a
   drafting request, each one position further) and one kv head. Its R x G query heads are the
   item's columns, column n = row n / G's head n % G; each row has its own length lens[r] and
   all share the keys' window start `lo`. Every column sees exactly the operations, in the same
   order, that it sees in an item of its row alone: AMX computes each column of S^T on its own
   (tdpbf16ps's sums do not depend on the other columns), the softmax runs per column over that
   row's keys only, and p.V per column too (the vector loop over that row's keys; AMX's
   products per row of P, with p = 0 past the row's keys). So a row's output has the same
   bits in any run, and a verify step's rows those of the plain decode step. DV = D / 32 is a
   compile-time constant at each call site. */
VX_INLINE void vx_fast_item(
        const vx_bf16* qr, int64_t q_st, int64_t q_sh, vx_bf16* orow, int64_t o_st, int64_t o_sh,
        const vx_bf16* kh, const vx_bf16* vh, int64_t c_sb, int64_t c_ss, const int32_t* btr,
        const int32_t* lens, int R, int G, int BS, float scale, const int DV, const int amx,
        vx_pf_cursor* pf, int lo, float softcap) {
    enum { GB_MAX = 4 };
    const int GB = (16 / (2 * DV)) < GB_MAX ? (16 / (2 * DV)) : GB_MAX;
    const int NC = R * G;  /* at most 16 (the caller's runs) */
    float sc[16][VX_CH] __attribute__((aligned(64)));
    __m512 acc[16][16];
    int64_t off[VX_CH];
    float mx[16], sum[16];
#ifdef VX_HAS_AMX
    float cor[16];  /* each column's rescale of this chunk, for the tile p.V's fold */
#endif
    int len = 0;
    for (int r = 0; r < R; r++) len = lens[r] > len ? lens[r] : len;
    /* The next item's lines spread over this item's work, per (key, head) of q.k and of p.V
       (the two passes cost about the same): pq/256 steps each, rounded up. */
    /* Keys [lo, len) (the window); chunks from `start`, which AMX needs at a multiple of 16
       (its tiles are 16 rows of one block), the keys before lo masked out. */
    const int start = amx ? lo & ~15 : lo, nk = len - start;
    const int pq = (int)(((int64_t)pf->nblk * pf->lines * 256 + 2 * NC * nk - 1)
                         / (nk > 0 ? 2 * NC * nk : 1));
    for (int n = 0; n < NC; n++) {
        mx[n] = -INFINITY; sum[n] = 0.f;
        for (int j = 0; j < 2 * DV; j++) acc[n][j] = _mm512_setzero_ps();
    }
#define VX_QCOL(n) (qr + (int64_t)((n) / G) * q_st + (int64_t)((n) % G) * q_sh)
#ifndef VX_HAS_AMX
    (void)amx;  /* built without AMX (Zen 4 and 5): the q.k tiles are not compiled in */
#endif
#ifdef VX_HAS_AMX
    /* AMX: S^T[16 keys][16 columns] = K[16 keys][32 dims] . Q^T, Q^T in the pair-interleaved
       layout tdpbf16ps takes (row r, column n: query column n's dims 2r, 2r+1; columns >= NC
       zero) */
    uint32_t qt[8][16][16] __attribute__((aligned(64)));
    float ct[VX_CH / 16][16][16] __attribute__((aligned(64)));
    float cmax[16];
    if (amx) {
        memset(qt, 0, sizeof(uint32_t) * 256 * DV);
        for (int n = 0; n < NC; n++) {
            const uint32_t* qw = (const uint32_t*)VX_QCOL(n);
            for (int v = 0; v < DV; v++)
                for (int r = 0; r < 16; r++) qt[v][r][n] = qw[16 * v + r];
        }
    }
#endif
    for (int c0 = start; c0 < len; c0 += VX_CH) {
        const int cnt = (len - c0) < VX_CH ? (len - c0) : VX_CH, ng = (cnt + 15) / 16;
        const int skip = c0 == start ? lo - start : 0;  /* group 0's keys before the window */
        /* each column's keys in this chunk (0: its row has ended) */
        int ncnt[16];
        for (int n = 0; n < NC; n++) {
            const int left = lens[n / G] - c0;
            ncnt[n] = left <= 0 ? 0 : left < VX_CH ? left : VX_CH;
        }
        {  /* block by block, no division per key (a runtime BS made it a costly part of an
              item) */
            int blk = c0 / BS, r = c0 % BS;
            int64_t base = (int64_t)btr[blk] * c_sb;
            for (int i = 0; i < cnt; i++) {
                off[i] = base + (int64_t)r * c_ss;
                if (++r == BS && i + 1 < cnt) { r = 0; base = (int64_t)btr[++blk] * c_sb; }
            }
            for (int i = cnt; i < ng * 16; i++) off[i] = off[0];  /* past len: the first row */
        }
        vx_prefetch_rows(kh, off, cnt < 16 * VX_PF ? cnt : 16 * VX_PF, DV);
#ifdef VX_HAS_AMX
        if (amx) {  /* 16 keys of one block per step (BS % 16 == 0): one tile row each */
            /* First every group's tile product, into two accumulators in turn (the next
               product runs while the last one is stored), then the scores out of the stored
               tiles: done group by group, each product waited on its store and gathers. */
            int t = 0;
            if (DV <= 2) {  /* Q^T in tiles 5 (and 6) for the chunk's q.k (p.V takes them) */
                _tile_loadd(5, qt[0], 64);
                if (DV == 2) _tile_loadd(6, qt[1], 64);
            }
#define VX_QK_GROUP(T, ACC, KT) do { \
                const vx_bf16* kr = kh + off[(T) * 16]; \
                if ((T) + VX_PF < ng) vx_prefetch_rows(kh, off + ((T) + VX_PF) * 16, 16, DV); \
                vx_pf_step(pf, 16 * NC * pq); \
                _tile_zero(ACC); \
                if (DV <= 2) { \
                    _tile_loadd(KT, kr, c_ss * 2); _tile_dpbf16ps(ACC, KT, 5); \
                    if (DV == 2) { _tile_loadd(KT, kr + 32, c_ss * 2); _tile_dpbf16ps(ACC, KT, 6); } \
                } else { \
                    for (int v = 0; v < DV; v++) { \
                        _tile_loadd(KT, kr + 32 * v, c_ss * 2); _tile_loadd(2, qt[v], 64); \
                        _tile_dpbf16ps(ACC, KT, 2); \
                    } \
                } \
                _tile_stored(ACC, ct[T], 64); \
            } while (0)
            for (; t + 1 < ng; t += 2) { VX_QK_GROUP(t, 0, 1); VX_QK_GROUP(t + 1, 3, 4); }
            if (t < ng) VX_QK_GROUP(t, 0, 1);
#undef VX_QK_GROUP
            /* V rows go to L1 only now, for p.V's first keys (p.V fetches the rest 32 keys
               ahead): fetched during q.k as well, a chunk's V (up to 32 KB) and K pushed each
               other out of L1 before use (measured at 64 requests x 1,024 keys). */
            vx_prefetch_rows(vh, off, cnt < 32 ? cnt : 32, DV);
            const __m512i rows = _mm512_mullo_epi32(
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                _mm512_set1_epi32(16));
            for (int n = 0; n < NC; n++) {
                if (!ncnt[n]) continue;
                const int ngn = (ncnt[n] + 15) / 16;
                __m512 run = _mm512_set1_ps(-INFINITY);
                for (t = 0; t < ngn; t++) {
                    const __mmask16 valid = vx_keys16(ncnt[n] - t * 16, t ? 0 : skip);
                    const __m512 r = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                        vx_softcap16(_mm512_mul_ps(_mm512_i32gather_ps(rows, &ct[t][0][n], 4),
                                                   _mm512_set1_ps(scale)), softcap));
                    _mm512_store_ps(&sc[n][t * 16], r);
                    run = _mm512_max_ps(run, r);
                }
                cmax[n] = _mm512_reduce_max_ps(run);
            }
        }
#endif
        for (int n = 0; n < NC; n++) {
            const int cn = ncnt[n], ngn = (cn + 15) / 16;
            if (!cn) continue;
            float cm;
#ifdef VX_HAS_AMX
            if (amx) { cm = cmax[n]; } else
#endif
            {
            __m512i qv[8];
            for (int v = 0; v < DV; v++)
                qv[v] = _mm512_loadu_si512((const void*)(VX_QCOL(n) + 32 * v));
            __m512 run = _mm512_set1_ps(-INFINITY);
            for (int t = 0; t < ngn; t++) {
                __m512 a[16];
                if (n == 0 && t + VX_PF < ngn) vx_prefetch_rows(kh, off + (t + VX_PF) * 16, 16, DV);
                vx_pf_step(pf, 16 * pq);
                for (int i = 0; i < 16; i++) {  /* input i is key 4 (i % 4) + i / 4 */
                    const vx_bf16* kr = kh + off[t * 16 + 4 * (i & 3) + (i >> 2)];
                    __m512 s = _mm512_setzero_ps();
                    for (int v = 0; v < DV; v++)
                        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512((const void*)(kr + 32 * v)),
                                             (__m512bh)qv[v]);
                    a[i] = s;
                }
                const __m512 r = _mm512_mask_mov_ps(
                    _mm512_set1_ps(-INFINITY), vx_keys16(cn - t * 16, t ? 0 : skip),
                    vx_softcap16(_mm512_mul_ps(vx_hsum16(a), _mm512_set1_ps(scale)), softcap));
                _mm512_store_ps(&sc[n][t * 16], r);
                run = _mm512_max_ps(run, r);
            }
            cm = _mm512_reduce_max_ps(run);
            }
            const float m_new = fmaxf(mx[n], cm);
            const float corr = vx_expf(mx[n] - m_new);  /* ~0 on the first chunk */
            __m512 s = _mm512_setzero_ps();
            const __m512 mv = _mm512_set1_ps(m_new);
            for (int t = 0; t < ngn; t++) {
                const __mmask16 valid = vx_keys16(cn - t * 16, t ? 0 : skip);
                const __m512 e = _mm512_maskz_mov_ps(
                    valid, vx_exp16(_mm512_sub_ps(_mm512_load_ps(&sc[n][t * 16]), mv)));
                _mm512_store_ps(&sc[n][t * 16], e);
                s = _mm512_add_ps(s, e);
            }
            sum[n] = sum[n] * corr + _mm512_reduce_add_ps(s);
            mx[n] = m_new;
#ifdef VX_HAS_AMX
            cor[n] = corr;
            if (amx) continue;  /* the tile p.V folds its chunk in with corr */
#endif
            if (c0 != start) {
                const __m512 cv = _mm512_set1_ps(corr);
                for (int j = 0; j < 2 * DV; j++) acc[n][j] = _mm512_mul_ps(acc[n][j], cv);
            }
        }
#ifdef VX_HAS_AMX
        if (amx) {
            vx_pv_tiles(vh, off, cnt, c_ss, sc, ncnt, cor, c0 != start, NC, DV, acc, pf, pq);
            continue;
        }
#endif
        const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
        /* p.V a row at a time (its columns see keys [c0, c0 + its count)), GB columns a pass */
        for (int r = 0; r < R; r++) {
            const int cr = ncnt[r * G];
            if (!cr) continue;
            for (int g0 = 0; g0 < G; g0 += GB) {
                const int gn = (G - g0) < GB ? (G - g0) : GB, n0 = r * G + g0;
                __m512 ac[GB_MAX][16];
                for (int gg = 0; gg < GB; gg++)
                    for (int j = 0; j < 2 * DV; j++) ac[gg][j] = gg < gn ? acc[n0 + gg][j] : _mm512_setzero_ps();
                const int first = r == 0 && g0 == 0;
                if (first) vx_prefetch_rows(vh, off, cr < 32 ? cr : 32, DV);
                for (int i = 0; i < cr; i++) {
                    const vx_bf16* vr = vh + off[i];
                    if (first && i + 32 < cr) vx_prefetch_rows(vh, off + i + 32, 1, DV);
                    if ((i & 7) == 0) vx_pf_step(pf, 8 * gn * pq);
                    __m512 vf[16];
                    for (int v = 0; v < DV; v++) {  /* even dims 32v+2j, odd dims 32v+2j+1 */
                        const __m512i x = _mm512_loadu_si512((const void*)(vr + 32 * v));
                        vf[2 * v] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
                        vf[2 * v + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
                    }
                    for (int gg = 0; gg < GB; gg++) {
                        if (gg >= gn) break;
                        const __m512 p = _mm512_set1_ps(sc[n0 + gg][i]);
                        for (int j = 0; j < 2 * DV; j++) ac[gg][j] = _mm512_fmadd_ps(p, vf[j], ac[gg][j]);
                    }
                }
                for (int gg = 0; gg < gn; gg++)
                    for (int j = 0; j < 2 * DV; j++) acc[n0 + gg][j] = ac[gg][j];
            }
        }
    }
    for (int n = 0; n < NC; n++) {
        const __m512 inv = _mm512_set1_ps(1.f / sum[n]);
        vx_bf16* o = orow + (int64_t)(n / G) * o_st + (int64_t)(n % G) * o_sh;
        for (int v = 0; v < DV; v++) {  /* even and odd dims, rounded (RNE), interleaved */
            const __m256i e = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[n][2 * v], inv));
            const __m256i d = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[n][2 * v + 1], inv));
            const __m256i lo = _mm256_unpacklo_epi16(e, d), hi = _mm256_unpackhi_epi16(e, d);
            _mm256_storeu_si256((__m256i*)(o + 32 * v), _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256((__m256i*)(o + 32 * v + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
    }
#undef VX_QCOL
}
int vx_decode_attention_bf16_fast(
        const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh,
        const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss,
        const int32_t* bt, int64_t bt_s, const int32_t* lens,
        int B, int Hq, int Hkv, int D, int BS, float scale, int max_len, int window,
        float softcap) {
    const int G = Hq / Hkv;
    if (D % 32 || D > 256 || G > 16 || G < 1) return -2;
    const int amx = vx_amx_on && BS % 16 == 0;
    const int par = (int64_t)B * Hkv * max_len >= VX_PAR_MIN;
    /* Runs of rows that read the same keys (the same blocks as far as each one reads, the
       same window start) share an item, up to AMX's 16 columns: a drafting request's 1 + k
       rows read their K and V once. Without AMX a row is an item of its own. */
    int32_t runs_local[257];
    int32_t* runs = B < 256 ? runs_local : (int32_t*)malloc(sizeof(int32_t) * ((size_t)B + 1));
    if (!runs) return -1;
    const int rmax = amx ? 16 / G : 1;
    int nr = 0;
    for (int b = 0; b < B;) {
        const int lo = window > 0 && lens[b] > window ? lens[b] - window : 0;
        int e = b + 1;
        for (; e < B && e - b < rmax; e++) {
            const int lo_e = window > 0 && lens[e] > window ? lens[e] - window : 0;
            if (lo_e != lo || memcmp(bt + (int64_t)e * bt_s, bt + (int64_t)b * bt_s,
                                     sizeof(int32_t) * (size_t)((lens[e] + BS - 1) / BS)))
                break;
        }
        runs[nr++] = b;
        b = e;
    }
    runs[nr] = B;
    vx_ws ws;
    vx_ws_init(&ws, (int64_t)nr * Hkv, par);
    _Pragma("omp parallel if (par)") {
#ifdef VX_HAS_AMX
    if (amx) vx_amx_load_tiles(8);  /* per thread: q.k 0, 3: S^T; 1, 4: K; 2, 5, 6: Q^T;
                                       p.V 0-3: out, 4, 5: P, 6, 7: V */
#endif
    const int tid = omp_get_thread_num();
    for (int64_t w; (w = vx_ws_next(&ws, tid)) >= 0;) {
        const int ri = (int)(w / Hkv), h = (int)(w % Hkv);
        const int b = runs[ri], R = runs[ri + 1] - b;
        const vx_bf16* qr = q + b * q_st + (int64_t)h * G * q_sh;
        vx_bf16* orow = out + b * o_st + (int64_t)h * G * o_sh;
        const vx_bf16 *kh = kc + h * c_sh, *vh = vc + h * c_sh;
        const int32_t* btr = bt + b * bt_s;
        vx_pf_cursor pf;
        pf.nblk = pf.blk = pf.line = pf.credit = 0;
        pf.lines = (int)(((int64_t)BS * c_ss * 2 + 63) / 64);
        if (w + 1 < (int64_t)nr * Hkv) {  /* the next item's K and V: up to 1,024 keys */
            const int r1 = (int)((w + 1) / Hkv), h1 = (int)((w + 1) % Hkv);
            const int b1 = runs[r1], l1 = lens[runs[r1 + 1] - 1];
            const int lo1 = window > 0 && l1 > window ? l1 - window : 0;
            const int n1 = l1 - lo1 < 16 * VX_PF_BLOCKS ? l1 : lo1 + 16 * VX_PF_BLOCKS;
            for (int p = lo1 - lo1 % BS; p < n1 && pf.nblk < VX_PF_BLOCKS; p += BS, pf.nblk++) {
                const int64_t blk = (int64_t)bt[b1 * bt_s + p / BS] * c_sb + h1 * c_sh;
                pf.k[pf.nblk] = (const char*)(kc + blk);
                pf.v[pf.nblk] = (const char*)(vc + blk);
            }
        }
        const int lo = window > 0 && lens[b] > window ? lens[b] - window : 0;
#define VX_ITEM(DV) vx_fast_item(qr, q_st, q_sh, orow, o_st, o_sh, kh, vh, c_sb, c_ss, btr, \
                                lens + b, R, G, BS, scale, DV, amx, &pf, lo, softcap)
        switch (D / 32) {  /* one specialisation per D, so loops over D unroll */
        case 1: VX_ITEM(1); break; case 2: VX_ITEM(2); break; case 3: VX_ITEM(3); break;
        case 4: VX_ITEM(4); break; case 5: VX_ITEM(5); break; case 6: VX_ITEM(6); break;
        case 7: VX_ITEM(7); break; default: VX_ITEM(8); break;
        }
    }
#ifdef VX_HAS_AMX
    if (amx) _tile_release();
#endif
    }
    if (runs != runs_local) free(runs);
    return 0;
}
#endif
int vx_has_fast_bf16(void) {
#ifdef VX_HAS_FAST_BF16
    return 1;
#else
    return 0;
#endif
}
