/* The fused CPU step: every decoder layer of a dense model in one call,
   for steps of up to the skinny GEMM's rows (decode rows, and prefill chunks where the C prefill
   attention takes them).

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the same library as the decode
   attention and the skinny GEMM; `vx.gpu.cpu.fused_step` fills its structs and calls it).

   Why it exists: at batch 1 a SmolLM2 step need only stream its weights, yet it took far
   longer: the rest was ~14 Python-level ops per layer (module calls, ctypes argument conversion,
   the rotary's torch ops, tensor allocation) times 30 layers. Here each layer is the same C
   kernels the module path calls (so the results are bit-identical), chained without Python:
   RMSNorm (+ residual) -> QKV GEMM -> rotary on q and k in place -> K/V store at their slots ->
   paged attention (decode rows: the decode kernel; prefill chunks: prefill_amx.c's
   kernel) -> O GEMM -> RMSNorm + residual -> gate-up GEMM -> SiLU-mul -> down GEMM.
   The other dense families' blocks are this one with what their `vx_layer` / `vx_step` fields
   say (fixed at load): q/k RMSNorms per head before the rotary (Qwen3, Gemma 3), a partial
   rotary (R < D: Phi-4-mini), a sliding window and a logit soft-cap per layer (handed to the
   attention kernels), and Gemma's block: (1 + w) norms, the attention's and the MLP's
   outputs normed before their residual adds, GeGLU, and a second rope for the local layers.

   GEMM routing is `vx.gpu.cpu.ops.skinny_gemm`'s: int8 weights (with per-channel scales) up to
   `quant_rows` rows, AMX tiles for 1-192 rows (one call; the AMX VNNI copy where there is one); without AMX,
   VDPBF16PS up to `skinny_rows` (none where the VNNI copies exist: their GEMM takes every
   row count, so a row's bits do not depend on the step's rows) and past them the
   VNNI-layout GEMM (`vx.gpu.cpu.vnni`, the linears' packed copies), any number of rows, as
   the linear's method chain routes them (`vx.gpu.layers.linear_method`). With `skinny_rows` 0
   (`--batch-invariant`) the VNNI or AMX copies take every row count. Built for AVX2 without AVX-512 (`vx_has_decode_step() == 2`), it is the module
   path of `vx.gpu.cpu.widen.WideWeight` for 1-24 rows instead: the AVX2 skinny GEMM on the bf16
   weights (1-4 rows on their compact copy, `vx.gpu.cpu.compact`: the panel GEMM's bits), the AVX2 decode attention (or the portable one), no int8 and no prefill chunks. The rotary has torch's roundings for `x1 * cos - x2 * sin` (three bf16
   roundings per output), as `vx.gpu.layers.rotary.apply_rotary`.

   Structs (mirrored by ctypes in `vx.gpu.cpu.fused_step`): a `vx_linear` per projection, a
   `vx_layer` per decoder layer (fixed at load, plus its K/V cache), a `vx_step` per call (batch
   size, per-step metadata and scratch buffers). */
#include "vx_kernels.h"
/* Rotate-half rotary in place on the first R values of nh heads (each D contiguous values,
   D apart) of each row: x1' = x1 c - x2 s, x2' = x2 c + x1 s over halves of R / 2, each
   product and the sum rounded to bf16 (torch's eager ops); cos/sin [T, R / 2]. R < D is
   Phi-4-mini's partial rotary (the rest of each head passes through). */
void vx_rotary_part_bf16(vx_bf16* x, int64_t x_st, int64_t T, int64_t nh, int64_t D, int64_t R,
                         const vx_bf16* cos, const vx_bf16* sin) {
    const int64_t h2 = R / 2;
    _Pragma("omp parallel for schedule(static) if (T * nh * D >= 65536)")
    for (int64_t t = 0; t < T; t++) {
        const vx_bf16 *c = cos + t * h2, *s = sin + t * h2;
        for (int64_t hd = 0; hd < nh; hd++) {
            vx_bf16* p = x + t * x_st + hd * D;
            int64_t i = 0;
#if defined(__AVX512BF16__)
            for (; i + 16 <= h2; i += 16) {  /* the loop below on 16 lanes, its roundings */
                vx_rope16(p + i, p + i + h2, vx_ld16_bf16(p + i), vx_ld16_bf16(p + i + h2),
                          vx_ld16_bf16(c + i), vx_ld16_bf16(s + i));
            }
#endif
            for (; i < h2; i++) {
                const float a = ld_bf16(p[i]), b = ld_bf16(p[i + h2]);
                const float ci = ld_bf16(c[i]), si = ld_bf16(s[i]);
                const float ac = ld_bf16(st_bf16v(a * ci)), bs = ld_bf16(st_bf16v(b * si));
                const float bc = ld_bf16(st_bf16v(b * ci)), as = ld_bf16(st_bf16v(a * si));
                p[i] = st_bf16v(ac - bs);
                p[i + h2] = st_bf16v(bc + as);
            }
        }
    }
}
/* vx_rotary_part_bf16 over whole heads (R = D): also the module path's rotary on CPU
   (`vx.gpu.cpu.ops`). */
void vx_rotary_bf16(vx_bf16* x, int64_t x_st, int64_t T, int64_t nh, int64_t D,
                    const vx_bf16* cos, const vx_bf16* sin) {
    vx_rotary_part_bf16(x, x_st, T, nh, D, D, cos, sin);
}
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__) && defined(VX_HAS_AMX)
#define VX_STEP_AMX vx_amx_on
#else
#define VX_STEP_AMX 0
#endif
typedef struct {
    const vx_bf16* w;       /* [n, k] bf16, row-major */
    const int8_t* q;        /* [n, k] int8 or NULL */
    const vx_bf16* scale;   /* [n] per output channel, with q */
    const vx_bf16* bias;    /* [n] or NULL */
    int64_t n, k;
    const uint32_t* vn;     /* w packed for vx_gemm_vnni_bf16, or with AMX vx_gemm_amx_vnni
                               (`vx.gpu.cpu.vnni`), or NULL */
    const uint8_t* q4;      /* AVX2: the int4 weight of `widen.Int4Avx2`, or NULL */
    const float* s4;        /* its scales (times 2^-28) and zeros, with q4 */
    const float* z4;
    const uint8_t* cw;      /* AVX2: the compact copy of w (`compact.CompactWeight`), or NULL */
    const uint8_t* ch;      /* its block bytes and raw blocks, with cw */
    const vx_bf16* craw;
    const uint32_t* panels; /* AVX2: w in bf16 panels (`widen.pack_panels`), or NULL */
    const uint32_t* vs;     /* a gate-up w packed for vx_gemm_amx_vnni_silu (gate and up rows
                               interleaved by 16; then vn is NULL), or NULL */
} vx_linear;
typedef struct vx_layer {
    const vx_bf16* in_norm;
    const vx_bf16* post_norm;
    vx_linear qkv, o, gate_up, down;
    vx_bf16* k_cache;       /* [Hkv, NB, BS, D], strides c_sh, c_sb, D (vx_step's) */
    vx_bf16* v_cache;
    /* The families' differences from the Llama block, fixed at load (NULL / 0: Llama's) */
    const vx_bf16* q_norm;  /* [D]: RMSNorm over each q head after the projection, before the
                               rotary (Qwen3, Gemma 3), or NULL */
    const vx_bf16* k_norm;  /* [D]: the same over each k head, with q_norm */
    const vx_bf16* attn_out_norm;  /* Gemma: the norm of the attention's output before its
                                      residual add (post_norm is then the MLP's input norm) */
    const vx_bf16* mlp_out_norm;   /* Gemma: the norm of the MLP's output, with attn_out_norm */
    int32_t window;         /* sliding window (keys), 0: the whole context */
    int32_t local_rope;     /* 1: turn with the step's cos_l / sin_l (Gemma 3's sliding layers) */
    float softcap;          /* attention logit soft-cap, 0: none */
    int32_t group;          /* its KV-cache group: the index into vx_step.groups (where set) */
    const struct vx_moe* moe;  /* a mixture-of-experts MLP in place of gate_up / down, or NULL */
} vx_layer;
/* A MoE layer's MLP (`vx.gpu.models.mixtral.SparseMoeBlock` with `CpuExperts.grouped` or
   `grouped_vnni`): the router, its softmax top-k, the rows grouped by expert, every touched
   expert's GEMMs in one call (experts_amx.c on AMX, experts_vnni.c on AVX512-BF16 without it),
   the weighted sum of each token's slots: the module path's calls, so its bits. */
typedef struct vx_moe {
    vx_linear router;       /* the gate; its n outputs zero-padded to a multiple of 16 where
                               the module path pads them (`PaddedSkinnyLinear`) */
    const uint32_t* const* w13;  /* [E]: each expert's gate-up, packed for the SiLU GEMM (AMX)
                                    or the VNNI GEMM */
    const uint32_t* const* w2;   /* [E]: each expert's down, packed for the AMX or VNNI GEMM */
    int64_t E, k, I;        /* experts, slots a token, an expert's intermediate size */
    int32_t renorm, w_f32;  /* top-k weights renormalised; kept in fp32 (else bf16) */
    int32_t vnni;           /* 1: the VNNI experts' GEMM (vx_moe_experts_vnni), else AMX's */
} vx_moe;
/* One KV-cache group's addressing (vx.gpu.kv_cache.kv_cache_groups): its slots and block
   tables, which a layer of the group reads in place of the step's own. */
typedef struct vx_kv_group {
    const int64_t* slots;   /* [T] */
    const int32_t* bt;      /* [nd, bt_s] */
    int64_t bt_s;
    const int32_t* p_bt;    /* [np, p_bt_s] */
    int64_t p_bt_s;
    int64_t max_len;
} vx_kv_group;
typedef struct vx_step {
    int64_t T, H, Hq, Hkv, D, I, NB, BS;
    int64_t c_sh, c_sb;     /* the caches' head and block strides (elements), K and V alike */
    float eps, scale;
    int32_t max_len, quant_rows, fast;
    int32_t skinny_rows;    /* rows up to which the skinny GEMM runs where a VNNI copy (AVX2:
                               the bf16 panels) exists */
    const vx_bf16* cos;     /* [T, D / 2] */
    const vx_bf16* sin;
    const int64_t* slots;   /* [T] */
    const int32_t* bt;      /* [nd, bt_s] */
    int64_t bt_s;
    const int32_t* lens;    /* [nd] */
    int64_t nd, np;         /* decode rows [0, nd), then np prefill chunks */
    const int32_t* p_starts;   /* [np] the chunks, as `vx_prefill_attention_bf16` takes them */
    const int32_t* p_lens;
    const int32_t* p_computed;
    const int32_t* p_bt;       /* [np, p_bt_s] */
    int64_t p_bt_s;
    vx_bf16* x;             /* [T, H]: in, the embeddings; out, the last layer's MLP output */
    vx_bf16* residual;      /* [T, H]: out */
    vx_bf16* h;             /* scratch [T, H] */
    vx_bf16* qkv;           /* scratch [T, (Hq + 2 Hkv) D] */
    vx_bf16* attn;          /* scratch [T, Hq D] */
    vx_bf16* gu;            /* scratch [T, 2 I] */
    vx_bf16* act;           /* scratch [T, I] */
    const int64_t* keep;    /* NULL, or the rows (ascending, < T) the last layer carries past
                               its attention, as the module path's `keep`: x and residual
                               then hold those rows first, in order */
    int64_t nkeep;
    int64_t R;              /* the leading dims of each q/k head the rotary turns (<= D; Phi-4-
                               mini's partial rotary); cos/sin are [T, R / 2] */
    int32_t gemma;          /* Gemma's block: (1 + w) norms (vx_gemma_rms_norm_bf16, also the q/k
                               norms), GeGLU instead of SiLU-mul */
    int32_t pad;
    const vx_bf16* cos_l;   /* [T, R / 2]: the local rope (layers with local_rope), or NULL */
    const vx_bf16* sin_l;
    const vx_kv_group* groups;  /* NULL: every layer reads slots, bt and p_bt above; else layer
                                   L reads groups[L->group]'s (Gemma 2/3's KV-cache groups) */
    char* moe_scratch;      /* MoE layers: `vx_moe_block`'s buffers (`vx.gpu.cpu.fused_step`
                               sizes them), else NULL */
} vx_step;

/* Whether the AMX VNNI copies take T rows: the rows the linears route to them, or every row
   count where skinny_rows is 0 (`--batch-invariant`: one GEMM for every row count). */
#define VX_AV_TAKES(T, skinny_rows) \
    ((skinny_rows) == 0 || ((T) >= vx_amx_vnni_rows(0) && (T) <= vx_amx_vnni_rows(1)))
static int vx_linear_apply(const vx_linear* L, const vx_bf16* x, int64_t T, int quant_rows,
                           int skinny_rows, vx_bf16* y) {
#if defined(__AVX512F__)
    if (L->q && T <= quant_rows)
        return vx_gemv_int8(x, L->k, (int)T, L->q, L->scale, L->bias, y, L->n, L->n, L->k);
    if (L->vn && VX_STEP_AMX && VX_AV_TAKES(T, skinny_rows))
        return vx_gemm_amx_vnni(x, L->k, (int)T, L->vn, L->bias, y, L->n, L->n, L->k);
    if (VX_STEP_AMX)  /* from one row: the AMX bits whatever the rows */
        return vx_gemm_amx_bf16(x, L->k, (int)T, L->w, L->bias, y, L->n, L->n, L->k);
    /* past the skinny GEMM's rows, as `linear` routes them; or AMX switched off since the
       caller counted the rows: an AMX VNNI copy has the same layout */
    if (L->vn && (T > skinny_rows || (T > 2 && T > vx_gemv_bf16_max_rows())))
        return vx_gemm_vnni_bf16(x, L->k, (int)T, L->vn, L->bias, y, L->n, L->n, L->k);
    return vx_gemv_bf16(x, L->k, (int)T, L->w, NULL, L->bias, y, L->n, L->n, L->k);
#else  /* AVX2: `QuantizedWeight`'s int4 or int8 kernel, else `WideWeight`'s skinny or panel GEMM */
    if (L->q4 && T <= quant_rows)
        return vx_gemv_int4_avx2(x, L->k, (int)T, L->q4, L->s4, L->z4, L->bias, y, L->n, L->n,
                                 L->k);
    if (L->q && T <= quant_rows)
        return vx_gemv_int8_avx2(x, L->k, (int)T, L->q, L->scale, L->bias, y, L->n, L->n, L->k);
    /* as `WideWeight` routes: the compact copy up to its rows, else the panels at every row
       count (one order of sums for all of them) */
    (void)skinny_rows;
    if (L->panels && !(L->cw && T <= VX_COMPACT_MAX_ROWS))
        return vx_gemm_panels_avx2(x, L->k, (int)T, L->panels, L->bias, y, L->n, L->n, L->k);
    if (L->cw && T <= VX_COMPACT_MAX_ROWS)  /* the panels' outputs from a quarter fewer bytes */
        return vx_gemv_compact_avx2(x, L->k, (int)T, L->cw, L->ch, L->craw, L->bias, y, L->n,
                                    L->n, L->k);
    return vx_gemv_bf16_avx2(x, L->k, (int)T, L->w, L->bias, y, L->n, L->n, L->k);
#endif
}
#define VX_MOE_AL(n) (((n) + 63) & ~(int64_t)63)
/* out [T, H] = the MoE MLP of h [T, H] (s->H wide): the router's GEMM as `vx_linear_apply`
   routes it, `vx_moe_topk_bf16`, `vx_moe_group_bf16`, `vx_moe_experts_amx` (-2 where AMX is
   off: the caller checked it is on) or `vx_moe_experts_vnni`, `vx_moe_combine_bf16`. Scratch
   from s->moe_scratch, in this order, each 64-byte aligned: logits [T, router n] bf16, weights
   [T k] (4 bytes each), ids, pos [T k] int64, counts [E] int64, xs [T k + 32, H] and act
   [T k + 32, I] bf16 (the AMX experts' GEMM reads whole 32-row blocks), ys [T k, H] bf16, gu
   [T k, 2 I] bf16 (the VNNI experts' gate-ups). */
static int vx_moe_block(const vx_moe* M, const vx_bf16* h, int64_t T, const vx_step* s,
                        vx_bf16* out) {
    const int64_t H = s->H, n = T * M->k, R = M->router.n;
    char* p = s->moe_scratch;
    vx_bf16* logits = (vx_bf16*)p; p += VX_MOE_AL(T * R * 2);
    void* w = p; p += VX_MOE_AL(n * 4);
    int64_t* ids = (int64_t*)p; p += VX_MOE_AL(n * 8);
    int64_t* pos = (int64_t*)p; p += VX_MOE_AL(n * 8);
    int64_t* counts = (int64_t*)p; p += VX_MOE_AL(M->E * 8);
    vx_bf16* xs = (vx_bf16*)p; p += VX_MOE_AL((n + 32) * H * 2);
    vx_bf16* act = (vx_bf16*)p; p += VX_MOE_AL((n + 32) * M->I * 2);
    vx_bf16* ys = (vx_bf16*)p; p += VX_MOE_AL(n * H * 2);
    vx_bf16* gu = (vx_bf16*)p;
    int rc = vx_linear_apply(&M->router, h, T, 0, s->skinny_rows, logits);
    if (rc) return rc;
    vx_moe_topk_bf16(logits, R, T, M->E, M->k, M->renorm, M->w_f32, w, ids);
    if (vx_moe_group_bf16(h, H, ids, T, M->k, M->E, H, counts, pos, xs)) return -1;
    rc = M->vnni ? vx_moe_experts_vnni(xs, counts, M->E, M->w13, M->w2, H, M->I, gu, act, ys)
                 : vx_moe_experts_amx(xs, counts, M->E, M->w13, M->w2, H, M->I, act, ys);
    if (rc) return rc;
    vx_moe_combine_bf16(ys, pos, w, M->w_f32, T, M->k, H, out);
    return 0;
}
/* Decoder layers [l0, l1) of n_layers for s->T rows (layer 0 takes s->x as the embeddings;
   past it s->x and s->residual hold the previous layer's output). No checks: the callers'
   (vx_llama_decode_bf16's, the split's). Returns 0 or the first kernel's error. */
static int vx_llama_layers(const vx_layer* layers, int l0, int l1, int n_layers,
                           const vx_step* s) {
    const int64_t T = s->T, H = s->H, D = s->D, Hq = s->Hq, Hkv = s->Hkv;
    const int64_t qkv_n = (Hq + 2 * Hkv) * D, e = sizeof(vx_bf16);
    const int64_t c_sh = s->c_sh, c_sb = s->c_sb;
    int rc;
    /* the block's norm: Gemma's (1 + w) in fp32, or Llama's */
    void (*norm)(const vx_bf16*, int64_t, const vx_bf16*, vx_bf16*, const vx_bf16*, vx_bf16*,
                 int64_t, int64_t, float) =
        s->gemma ? vx_gemma_rms_norm_bf16 : vx_add_rms_norm_bf16;
    for (int l = l0; l < l1; l++) {
        const vx_layer* L = layers + l;
        if (l == 0) {  /* the embeddings are the first residual */
            norm(s->x, H, NULL, NULL, L->in_norm, s->h, T, H, s->eps);
            memcpy(s->residual, s->x, (size_t)(T * H) * e);
        } else {
            norm(s->x, H, s->residual, s->residual, L->in_norm, s->h, T, H, s->eps);
        }
        const vx_bf16* cs = L->local_rope ? s->cos_l : s->cos;
        const vx_bf16* sn = L->local_rope ? s->sin_l : s->sin;
        rc = -2;
#if defined(__AVX512F__)
        /* the rotary in the GEMM's epilogue (whole heads, no q/k norm before it): the same
           bits, no pass over q and k */
        if (L->qkv.vn && VX_STEP_AMX && VX_AV_TAKES(T, s->skinny_rows) && !L->q_norm
            && s->R == D)
            rc = vx_gemm_amx_vnni_rope(s->h, H, (int)T, L->qkv.vn, L->qkv.bias, s->qkv, qkv_n,
                                       qkv_n, H, cs, sn, (Hq + Hkv) * D, (int)D);
#endif
        if (rc == -2) {
            rc = vx_linear_apply(&L->qkv, s->h, T, s->quant_rows, s->skinny_rows, s->qkv);
            if (rc) return rc;
            if (L->q_norm) {  /* per head, as the module path's [T * H, D] rows */
                vx_head_rms_norm_bf16(s->qkv, qkv_n, T, Hq, D, L->q_norm, s->eps, s->gemma);
                vx_head_rms_norm_bf16(s->qkv + Hq * D, qkv_n, T, Hkv, D, L->k_norm, s->eps,
                                      s->gemma);
            }
            vx_rotary_part_bf16(s->qkv, qkv_n, T, Hq + Hkv, D, s->R, cs, sn);
        } else if (rc) {
            return rc;
        }
        /* the layer's KV-cache group's slots and tables (one group: the step's) */
        const int64_t* slots = s->slots;
        const int32_t *bt = s->bt, *p_bt = s->p_bt;
        int64_t bt_s = s->bt_s, p_bt_s = s->p_bt_s;
        int32_t max_len = s->max_len;
        if (s->groups) {
            const vx_kv_group* G = s->groups + L->group;
            slots = G->slots; bt = G->bt; bt_s = G->bt_s; p_bt = G->p_bt; p_bt_s = G->p_bt_s;
            max_len = (int32_t)G->max_len;
        }
        vx_write_kv((const char*)(s->qkv + Hq * D), qkv_n * e, D * e,
                    (const char*)(s->qkv + (Hq + Hkv) * D), qkv_n * e, D * e,
                    (char*)L->k_cache, (char*)L->v_cache, c_sh * e, c_sb * e, D * e, D * e,
                    slots, (int)T, (int)Hkv, (int)s->BS, s->NB * s->BS);
        rc = 0;
        if (s->nd) {
            rc = -2;
#if defined(VX_HAS_FAST_BF16)
            if (s->fast)
                rc = vx_decode_attention_bf16_fast(
                    s->qkv, qkv_n, D, s->attn, Hq * D, D, L->k_cache, L->v_cache, c_sh,
                    c_sb, D, bt, bt_s, s->lens, (int)s->nd, (int)Hq, (int)Hkv,
                    (int)D, (int)s->BS, s->scale, max_len, L->window, L->softcap);
#elif !defined(__AVX512F__)
            if (s->fast)
                rc = vx_decode_attention_bf16_avx2(
                    s->qkv, qkv_n, D, s->attn, Hq * D, D, L->k_cache, L->v_cache, c_sh,
                    c_sb, D, bt, bt_s, s->lens, (int)s->nd, (int)Hq, (int)Hkv,
                    (int)D, (int)s->BS, s->scale, max_len, L->window, L->softcap);
#endif
            if (rc == -2)
                rc = vx_decode_attention_bf16(
                    s->qkv, qkv_n, D, s->attn, Hq * D, D, L->k_cache, L->v_cache, c_sh,
                    c_sb, D, bt, bt_s, s->lens, (int)s->nd, (int)Hq, (int)Hkv,
                    (int)D, (int)s->BS, s->scale, max_len, L->window, L->softcap);
        }
        if (!rc && s->np)  /* the caller checked the kernel takes them (D % 32 == 0) */
            rc = vx_prefill_attention_bf16(
                s->qkv, qkv_n, D, s->attn, Hq * D, D, L->k_cache, L->v_cache, c_sh, c_sb,
                D, p_bt, p_bt_s, s->p_starts, s->p_lens, s->p_computed, (int)s->np,
                (int)Hq, (int)Hkv, (int)D, (int)s->BS, s->scale, L->window, L->softcap);
        if (rc) return rc;
        int64_t Tl = T;  /* the rows past the attention */
        if (s->keep && l == n_layers - 1) {
            /* Only the kept rows go on (a prompt chunk's last row, the decodes): the rest of
               the last layer is ~1/30 of a prompt row's work. Moved down in order (keep is
               ascending, so no row is overwritten before it is read). */
            const int64_t ar = Hq * D;
            for (int64_t i = 0; i < s->nkeep; i++) {
                const int64_t k = s->keep[i];
                if (k == i) continue;
                memcpy(s->attn + i * ar, s->attn + k * ar, (size_t)ar * e);
                memcpy(s->residual + i * H, s->residual + k * H, (size_t)H * e);
            }
            Tl = s->nkeep;
            if (!Tl) break;
        }
        rc = vx_linear_apply(&L->o, s->attn, Tl, s->quant_rows, s->skinny_rows, s->x);
        if (rc) return rc;
        if (L->attn_out_norm)  /* Gemma: the attention's output normed before its residual add */
            norm(s->x, H, NULL, NULL, L->attn_out_norm, s->x, Tl, H, s->eps);
        norm(s->x, H, s->residual, s->residual, L->post_norm, s->h, Tl, H, s->eps);
        if (L->moe) {  /* the experts' MLP is the layer's last op (no Gemma norm after it) */
            rc = vx_moe_block(L->moe, s->h, Tl, s, s->x);
            if (rc) return rc;
            continue;
        }
        if (s->gemma) {  /* GeGLU */
            rc = vx_linear_apply(&L->gate_up, s->h, Tl, s->quant_rows, s->skinny_rows, s->gu);
            if (rc) return rc;
            vx_gelu_tanh_and_mul_bf16(s->gu, 2 * s->I, s->act, Tl, s->I);
        } else
#if defined(__AVX512F__)
        if (L->gate_up.vs && VX_STEP_AMX && Tl >= vx_amx_vnni_rows(0)) {
            /* the GEMM with the SiLU-mul in its epilogue: the same bits, no [T, 2 I] pass */
            rc = vx_gemm_amx_vnni_silu(s->h, H, (int)Tl, L->gate_up.vs, NULL, s->act, s->I,
                                       s->I, H);  /* SiLU copies have no bias (`vnni`) */
            if (rc) return rc;
        } else
#endif
        {
            rc = vx_linear_apply(&L->gate_up, s->h, Tl, s->quant_rows, s->skinny_rows, s->gu);
            if (rc) return rc;
            vx_silu_and_mul_bf16(s->gu, 2 * s->I, s->act, Tl, s->I);
        }
        rc = vx_linear_apply(&L->down, s->act, Tl, s->quant_rows, s->skinny_rows, s->x);
        if (rc) return rc;
        if (L->mlp_out_norm)
            norm(s->x, H, NULL, NULL, L->mlp_out_norm, s->x, Tl, H, s->eps);
    }
    return 0;
}
/* Every decoder layer for s->T rows: s->nd decodes, then s->np prefill chunks. Returns 0, -2
   (nothing done: prefill chunks the C kernel would decline), or the first kernel's error (the
   caller validated the shapes, so an error means scratch could not be allocated). */
int vx_llama_decode_bf16(const vx_layer* layers, int n_layers, const vx_step* s) {
    const int64_t T = s->T, D = s->D, Hq = s->Hq, Hkv = s->Hkv;
    (void)T; (void)D; (void)Hq; (void)Hkv;  /* each check uses some of them, per build */
    /* the prefill kernel would decline them (AVX2 builds; shapes the caller checked): -2
       before anything is written, and the caller takes the module path */
#if defined(VX_PF_512)
    if (s->np && (D % 32 || D > 256 || Hq % Hkv)) return -2;
#else
    if (s->np) return -2;
#endif
    /* MoE layers built for AMX's experts' GEMM (experts_amx.c) need it on: else -2, before
       anything is written (AMX switched off since the step was built) */
    for (int l = 0; l < n_layers; l++)
        if (layers[l].moe && !layers[l].moe->vnni && !VX_STEP_AMX) return -2;
#if defined(__AVX512F__)
    /* rows past what the skinny GEMM takes without AMX (AMX switched off since the caller
       counted the rows) need every linear's VNNI copy: else -2, before anything is written */
    if (T > 2 && !VX_STEP_AMX && T > vx_gemv_bf16_max_rows())
        for (int l = 0; l < n_layers; l++)
            if (!layers[l].qkv.vn || !layers[l].o.vn || !layers[l].gate_up.vn
                || !layers[l].down.vn)
                return -2;
#endif
    return vx_llama_layers(layers, 0, n_layers, n_layers, s);
}
#endif
