/* The whole greedy decode step: a decode-only step too small to split, in one
   call on the pool: the embeddings, every layer, the final RMSNorm and the LM head's argmax.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library after the
   split step's source, whose `vx_greedy_tail` and `vx_greedy_inputs` it takes; `vx.gpu.cpu.fused_step.FusedDecode` calls
   `vx_llama_greedy_whole`).

   Why: at one row a SmolLM2 step streams ~240 MB of weights in C, yet a measurable part of
   the step was Python around the C calls while the second core waited (2-core Zen 5, one
   process: the model's forward around the fused layers, the embedding, the final norm and
   the head's screen as separate calls, and `ScreenedHead.argmax`'s torch and numpy glue).
   Here they are one call. AVX2 builds take one-row steps so too (the screen's AVX2 pair:
   `vx_screen_i8_avx2`, the exact rows on `vx_gemm_panels_avx2` where the head has panels, else
   `vx_gemv_bf16_avx2`): on a 2-core Zen 3 the one-row
   step was shorter than through the model's forward and `greedy_ids` in every one of 8
   alternated rounds.

   Invariant: the same kernels on the same rows as `LlamaModel.forward` and `greedy_ids` (the
   embedding rows, `vx_llama_decode_bf16`, `vx_add_rms_norm_bf16`, then `vx_argmax_vnni_bf16` on
   the VNNI copy, or for one row the int8 screen, `vx_screen_i8` (`vx_screen_i8_avx2`) and
   `vx_screen_select`, with each candidate's logit from `vx_gemv_bf16` (`vx_gemv_bf16_avx2`;
   `vx_gemm_amx_bf16` where AMX is on) on its bf16 head row, as `ScreenedHead.argmax` computes them: a row's dot product does not depend
   on the rows computed beside it), so the same tokens. */
#include "vx_kernels.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
/* one row's int8 screen, and one candidate's logit by the bf16 GEMM the logits path takes */
#define VX_SCREEN_ROW(x, H, q, s, a, N) vx_screen_i8(x, H, 1, q, s, a, N, H)
#define VX_EXACT_ROW(x, H, w, y) vx_gemv_bf16(x, H, 1, w, NULL, NULL, y, 1, 1, H)
#define VX_VNNI_HEAD 1  /* whole steps of several rows: the argmax on the head's VNNI copy */
#else  /* AVX2 builds: `ScreenKernels`' AVX2 pair; no VNNI copy, so one screened row only */
#define VX_SCREEN_ROW(x, H, q, s, a, N) vx_screen_i8_avx2(x, H, 1, q, s, a, N, H)
#define VX_EXACT_ROW(x, H, w, y) vx_gemv_bf16_avx2(x, H, 1, w, NULL, y, 1, 1, H)
#define VX_VNNI_HEAD 0
#endif
/* The LM head's int8 screen for one row (`vx.gpu.cpu.screen.ScreenedHead`): its copy, bounds
   and scratch, and the bf16 head the candidates are computed again on. */
typedef struct vx_screen_head {
    const int8_t* q;            /* [vocab, H] */
    const float* s;             /* [vocab] per-row scales */
    const double* bound;        /* [vocab] */
    const vx_bf16* w;           /* [vocab, H] the bf16 head */
    float* a;                   /* scratch [vocab] */
    int64_t* idx;               /* scratch [cap] */
    uint8_t* cand;              /* scratch [cap] */
    int64_t cap;
    int64_t vnni;               /* 1: the candidates by the VNNI GEMM (the head's logits take
                                   its VNNI copy at every row count; AVX2: the panel GEMM, the
                                   head's panels), 0: by VX_EXACT_ROW */
} vx_screen_head;
/* The GEMM a head's logits take at every row count without AMX where its copy is in k-pair
   words, 16 rows a block (`vx_screen_head.vnni`): the VNNI GEMM on AVX512-BF16, the panel
   GEMM on AVX2; none on AVX-512 without BF16. */
#if defined(VX_HAS_FAST_BF16)
#define VX_PAIRED_GEMM vx_gemm_vnni_bf16
#define VX_PAIRED_MAX_K VX_GEMV_MAX_K
#elif !defined(__AVX512F__)
#define VX_PAIRED_GEMM vx_gemm_panels_avx2
#define VX_PAIRED_MAX_K VX_AVX2_MAX_K
#endif
/* The first maximum of one row's bf16 logits over the screen's candidates (ascending), each
   computed by the exact GEMM alone (each output row's sum is over its own weight row in the
   same order whatever rows are computed beside it); -1 where the screen gives no answer (too
   many candidates, x or a logit not finite: the caller forms the logits). */
static int64_t vx_screen_argmax(const vx_bf16* x, int64_t H, int64_t vocab,
                                const vx_screen_head* sh) {
    if (VX_SCREEN_ROW(x, H, sh->q, sh->s, sh->a, vocab)) return -1;
    const int64_t u = vx_screen_select(sh->a, 1, vocab, sh->bound, x, H, H, sh->idx, sh->cand,
                                       sh->cap);
    int64_t arg = -1;
    float best = 0.f;
#if defined(VX_HAS_AMX)
    /* with AMX on, the logits path's GEMM is the AMX one at every row count: the candidates'
       weight rows gathered 16 a block (zero rows past u), each output the full product's */
    static vx_bf16 rows[16 * VX_GEMV_MAX_K] __attribute__((aligned(64)));
    vx_bf16 ys[16];
    if (vx_amx_on && H <= VX_GEMV_MAX_K) {
        for (int64_t j0 = 0; j0 < u; j0 += 16) {
            const int64_t nj = u - j0 < 16 ? u - j0 : 16;
            for (int64_t j = 0; j < 16; j++) {
                if (j < nj) memcpy(rows + j * H, sh->w + sh->idx[j0 + j] * H, (size_t)H * 2);
                else memset(rows + j * H, 0, (size_t)H * 2);
            }
            if (vx_gemm_amx_bf16(x, H, 1, rows, NULL, ys, 16, 16, H)) return -1;
            for (int64_t j = 0; j < nj; j++) {
                const float v = ld_bf16(ys[j]);
                if (!isfinite(v)) return -1;
                if (arg < 0 || v > best) { best = v; arg = sh->idx[j0 + j]; }
            }
        }
        return arg;
    }
#endif
#if defined(VX_PAIRED_GEMM)
    /* without AMX, a head whose logits take the paired GEMM at every row count: the
       candidates' weight rows in k-pair words 16 a block (zero rows past u), as
       `vx_pack_vnni_bf16` and `pack_panels` pack them, each output that GEMM's sum */
    static uint32_t packed[8 * VX_PAIRED_MAX_K] __attribute__((aligned(64)));
    vx_bf16 yv[16];
    if (sh->vnni && H % 2 == 0 && H <= VX_PAIRED_MAX_K) {
        const uint32_t* w32 = (const uint32_t*)sh->w;
        const int64_t KP = H / 2;
        for (int64_t j0 = 0; j0 < u; j0 += 16) {
            const int64_t nj = u - j0 < 16 ? u - j0 : 16;
            for (int64_t j = 0; j < 16; j++)
                for (int64_t p = 0; p < KP; p++)
                    packed[p * 16 + j] = j < nj ? w32[sh->idx[j0 + j] * KP + p] : 0;
            if (VX_PAIRED_GEMM(x, H, 1, packed, NULL, yv, 16, 16, H)) return -1;
            for (int64_t j = 0; j < nj; j++) {
                const float v = ld_bf16(yv[j]);
                if (!isfinite(v)) return -1;
                if (arg < 0 || v > best) { best = v; arg = sh->idx[j0 + j]; }
            }
        }
        return arg;
    }
#endif
    for (int64_t j = 0; j < u; j++) {
        vx_bf16 y;
        if (VX_EXACT_ROW(x, H, sh->w + sh->idx[j] * H, &y)) return -1;
        const float v = ld_bf16(y);
        if (!isfinite(v)) return -1;
        if (arg < 0 || v > best) { best = v; arg = sh->idx[j]; }
    }
    return arg;
}
/* A decode-only step of s->T rows on the pool: embeddings (into s->x) and the rotary's cos and
   sin (into s->cos and s->sin) from g, every layer (vx_llama_decode_bf16), the final RMSNorm
   into s->h, and each row's first maximum into g->out: on the VNNI copy g->head (AVX-512
   builds), or with sh (one row) by the int8 screen. Returns 0; 1 where the layers ran and s->h
   holds the final states but no token was found (the screen declined, the head refused the
   shape: the caller forms the logits from s->h); -2 for a step it does not take, before
   anything is written; else the first kernel's error. */
int vx_llama_greedy_whole(const vx_layer* layers, int n_layers, const vx_step* s,
                          const vx_greedy_tail* g, const vx_screen_head* sh) {
    const int64_t T = s->T, H = s->H;
    if (T < 1 || s->np || s->nd != T || s->keep || (sh ? T != 1 : !VX_VNNI_HEAD || !g->head))
        return -2;
    vx_greedy_inputs(s, g, 0, T);
    int rc = vx_llama_decode_bf16(layers, n_layers, s);  /* -2: before anything is written */
    if (rc) return rc;
    vx_add_rms_norm_bf16(s->x, H, s->residual, s->residual, g->norm, s->h, T, H, s->eps);
    if (sh) {
        const int64_t id = vx_screen_argmax(s->h, H, g->vocab, sh);
        if (id < 0) return 1;
        g->out[0] = id;
        return 0;
    }
#if VX_VNNI_HEAD
    rc = vx_argmax_vnni_bf16(s->h, H, (int)T, g->head, g->vocab, H, g->out);
    return rc == -2 ? 1 : rc;
#else
    return 1;  /* not reached: without a VNNI copy only screened rows are taken (above) */
#endif
}
#else
int vx_llama_greedy_whole(const vx_layer* layers, int n_layers, const vx_step* s,
                          const vx_greedy_tail* g, const vx_screen_head* sh) {
    (void)layers; (void)n_layers; (void)s; (void)g; (void)sh;
    return -2;
}
#endif
