"""The C source of the fused CPU step: every decoder layer of a Llama-family model in one call,
for steps of up to the skinny GEMM's rows (decode rows, and prefill chunks where the C prefill
attention takes them).

Runs in: the Worker process (`vx.gpu.kv_cache` builds it into the same library as the decode
attention and the skinny GEMM; `vx.gpu.cpu_decode` fills its structs and calls it).

Why it exists: at batch 1 a SmolLM2 step streams its weights in ~12 ms, but the same step took
~21 ms: the rest was ~14 Python-level ops per layer (module calls, ctypes argument conversion,
the rotary's torch ops, tensor allocation) times 30 layers. Here each layer is the same C
kernels the module path calls (so the results are bit-identical), chained without Python:
RMSNorm (+ residual) -> QKV GEMM -> rotary on q and k in place -> K/V store at their slots ->
paged attention (decode rows: the decode kernel; prefill chunks: `vx.gpu.cpu_prefill_source`'s
kernel) -> O GEMM -> RMSNorm + residual -> gate-up GEMM -> SiLU-mul -> down GEMM.

GEMM routing is `vx.gpu.cpu_ops.skinny_gemm`'s: int8 weights (with per-channel scales) up to
`quant_rows` rows, VDPBF16PS for 1-2 rows, AMX tiles for 3-192 rows (one call); without AMX,
VDPBF16PS up to `skinny_rows` (one row where the VNNI copies exist) and past them the
VNNI-layout GEMM (`vx.gpu.cpu_vnni`, the linears' packed copies), any number of rows, as
`vx.gpu.quantization.linear` routes them. Built for AVX2 without AVX-512 (`vx_has_decode_step() == 2`), it is the module
path of `vx.gpu.cpu_widen.WideWeight` for 1-24 rows instead: the AVX2 skinny GEMM on the bf16
weights, the AVX2 decode attention (or the portable one), no int8 and no prefill chunks. The rotary has torch's roundings for `x1 * cos - x2 * sin` (three bf16
roundings per output), as `vx.gpu.rotary.apply_rotary`.

Structs (mirrored by ctypes in `vx.gpu.cpu_decode`): a `vx_linear` per projection, a
`vx_layer` per decoder layer (fixed at load, plus its K/V cache), a `vx_step` per call (batch
size, per-step metadata and scratch buffers).
"""

from __future__ import annotations

DECODE_STEP_SOURCE = r"""
/* Rotate-half rotary in place on nh heads (each D contiguous values) of each row:
   x1' = x1 c - x2 s, x2' = x2 c + x1 s, each product and the sum rounded to bf16 (torch's eager
   ops); cos/sin [T, D / 2]. Also the module path's rotary on CPU (`vx.gpu.cpu_ops`). */
void vx_rotary_bf16(vx_bf16* x, int64_t x_st, int64_t T, int64_t nh, int64_t D,
                    const vx_bf16* cos, const vx_bf16* sin) {
    const int64_t h2 = D / 2;
    _Pragma("omp parallel for schedule(static) if (T * nh * D >= 65536)")
    for (int64_t t = 0; t < T; t++) {
        const vx_bf16 *c = cos + t * h2, *s = sin + t * h2;
        for (int64_t hd = 0; hd < nh; hd++) {
            vx_bf16* p = x + t * x_st + hd * D;
            for (int64_t i = 0; i < h2; i++) {
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
    const uint32_t* vn;     /* w packed for vx_gemm_vnni_bf16 (`vx.gpu.cpu_vnni`), or NULL */
} vx_linear;
typedef struct {
    const vx_bf16* in_norm;
    const vx_bf16* post_norm;
    vx_linear qkv, o, gate_up, down;
    vx_bf16* k_cache;       /* [Hkv, NB, BS, D], strides c_sh, c_sb, D (vx_step's) */
    vx_bf16* v_cache;
} vx_layer;
typedef struct {
    int64_t T, H, Hq, Hkv, D, I, NB, BS;
    int64_t c_sh, c_sb;     /* the caches' head and block strides (elements), K and V alike */
    float eps, scale;
    int32_t max_len, quant_rows, fast;
    int32_t skinny_rows;    /* rows up to which the skinny GEMM runs where a VNNI copy exists */
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
} vx_step;

static int vx_linear_apply(const vx_linear* L, const vx_bf16* x, int64_t T, int quant_rows,
                           int skinny_rows, vx_bf16* y) {
#if defined(__AVX512F__)
    if (L->q && T <= quant_rows)
        return vx_gemv_int8(x, L->k, (int)T, L->q, L->scale, L->bias, y, L->n, L->n, L->k);
    if (T > 2 && VX_STEP_AMX)
        return vx_gemm_amx_bf16(x, L->k, (int)T, L->w, L->bias, y, L->n, L->n, L->k);
    if (L->vn && T > skinny_rows)  /* past the skinny GEMM's rows: as `linear` routes them */
        return vx_gemm_vnni_bf16(x, L->k, (int)T, L->vn, L->bias, y, L->n, L->n, L->k);
    return vx_gemv_bf16(x, L->k, (int)T, L->w, NULL, L->bias, y, L->n, L->n, L->k);
#else  /* AVX2: the skinny GEMM of `WideWeight._skinny` (no int8 here: the caller checked) */
    (void)quant_rows; (void)skinny_rows;
    return vx_gemv_bf16_avx2(x, L->k, (int)T, L->w, L->bias, y, L->n, L->n, L->k);
#endif
}
/* Every decoder layer for s->T rows: s->nd decodes, then s->np prefill chunks. Returns 0, -2
   (nothing done: prefill chunks the C kernel would decline), or the first kernel's error (the
   caller validated the shapes, so an error means scratch could not be allocated). */
int vx_llama_decode_bf16(const vx_layer* layers, int n_layers, const vx_step* s) {
    const int64_t T = s->T, H = s->H, D = s->D, Hq = s->Hq, Hkv = s->Hkv;
    const int64_t qkv_n = (Hq + 2 * Hkv) * D, e = sizeof(vx_bf16);
    const int64_t c_sh = s->c_sh, c_sb = s->c_sb;
    int rc;
    /* the prefill kernel would decline them (AVX2 builds; shapes the caller checked): -2
       before anything is written, and the caller takes the module path */
#if defined(VX_PF_512)
    if (s->np && (D % 32 || D > 256 || Hq % Hkv)) return -2;
#else
    if (s->np) return -2;
#endif
#if defined(__AVX512F__)
    /* rows past what the skinny GEMM takes without AMX (AMX switched off since the caller
       counted the rows) need every linear's VNNI copy: else -2, before anything is written */
    if (T > 2 && !VX_STEP_AMX && T > vx_gemv_bf16_max_rows())
        for (int l = 0; l < n_layers; l++)
            if (!layers[l].qkv.vn || !layers[l].o.vn || !layers[l].gate_up.vn
                || !layers[l].down.vn)
                return -2;
#endif
    for (int l = 0; l < n_layers; l++) {
        const vx_layer* L = layers + l;
        if (l == 0) {  /* the embeddings are the first residual */
            vx_add_rms_norm_bf16(s->x, H, NULL, NULL, L->in_norm, s->h, T, H, s->eps);
            memcpy(s->residual, s->x, (size_t)(T * H) * e);
        } else {
            vx_add_rms_norm_bf16(s->x, H, s->residual, s->residual, L->in_norm, s->h, T, H, s->eps);
        }
        rc = vx_linear_apply(&L->qkv, s->h, T, s->quant_rows, s->skinny_rows, s->qkv);
        if (rc) return rc;
        vx_rotary_bf16(s->qkv, qkv_n, T, Hq + Hkv, D, s->cos, s->sin);
        vx_write_kv((const char*)(s->qkv + Hq * D), qkv_n * e, D * e,
                    (const char*)(s->qkv + (Hq + Hkv) * D), qkv_n * e, D * e,
                    (char*)L->k_cache, (char*)L->v_cache, c_sh * e, c_sb * e, D * e, D * e,
                    s->slots, (int)T, (int)Hkv, (int)s->BS, s->NB * s->BS);
        rc = 0;
        if (s->nd) {
            rc = -2;
#if defined(VX_HAS_FAST_BF16)
            if (s->fast)
                rc = vx_decode_attention_bf16_fast(
                    s->qkv, qkv_n, D, s->attn, Hq * D, D, L->k_cache, L->v_cache, c_sh,
                    c_sb, D, s->bt, s->bt_s, s->lens, (int)s->nd, (int)Hq, (int)Hkv,
                    (int)D, (int)s->BS, s->scale, s->max_len);
#elif !defined(__AVX512F__)
            if (s->fast)
                rc = vx_decode_attention_bf16_avx2(
                    s->qkv, qkv_n, D, s->attn, Hq * D, D, L->k_cache, L->v_cache, c_sh,
                    c_sb, D, s->bt, s->bt_s, s->lens, (int)s->nd, (int)Hq, (int)Hkv,
                    (int)D, (int)s->BS, s->scale, s->max_len);
#endif
            if (rc == -2)
                rc = vx_decode_attention_bf16(
                    s->qkv, qkv_n, D, s->attn, Hq * D, D, L->k_cache, L->v_cache, c_sh,
                    c_sb, D, s->bt, s->bt_s, s->lens, (int)s->nd, (int)Hq, (int)Hkv,
                    (int)D, (int)s->BS, s->scale, s->max_len);
        }
        if (!rc && s->np)  /* the caller checked the kernel takes them (D % 32 == 0) */
            rc = vx_prefill_attention_bf16(
                s->qkv, qkv_n, D, s->attn, Hq * D, D, L->k_cache, L->v_cache, c_sh, c_sb,
                D, s->p_bt, s->p_bt_s, s->p_starts, s->p_lens, s->p_computed, (int)s->np,
                (int)Hq, (int)Hkv, (int)D, (int)s->BS, s->scale);
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
        vx_add_rms_norm_bf16(s->x, H, s->residual, s->residual, L->post_norm, s->h, Tl, H, s->eps);
        rc = vx_linear_apply(&L->gate_up, s->h, Tl, s->quant_rows, s->skinny_rows, s->gu);
        if (rc) return rc;
        vx_silu_and_mul_bf16(s->gu, 2 * s->I, s->act, Tl, s->I);
        rc = vx_linear_apply(&L->down, s->act, Tl, s->quant_rows, s->skinny_rows, s->x);
        if (rc) return rc;
    }
    return 0;
}
/* The split's row cuts follow each thread's speed: the threads are pinned, one per core, and
   a core shared with the host processes (or slowed by its host) runs its part 5-30% slower for
   tens of steps at a time (2-core Zen 5, 64 rows: the parts' times differed by a median 1.6-3.3
   ms a step, one side for runs of 10-40 steps). vx_split_speed[t]: thread t's cost units a
   second, smoothed over steps (0: not yet measured). */
#define VX_SPLIT_ROW_COST 400  /* a row's GEMM work in keys of attention (SmolLM2 on 2-core
                                  Zen 5: 0.7 ms of GEMMs a row, 1.7 us a key over all layers) */
static double vx_split_speed[VX_WS_MAX];
static int vx_split_adapt = 1;
/* 1: cuts follow the measured speeds (the default); 0: even cuts. Either way the speeds
   measured so far are dropped. */
void vx_set_split_adapt(int on) {
    vx_split_adapt = on;
    for (int t = 0; t < VX_WS_MAX; t++) vx_split_speed[t] = 0;
}
void vx_split_set_speeds(const double* v, int n) {  /* tests */
    for (int t = 0; t < VX_WS_MAX; t++) vx_split_speed[t] = t < n ? v[t] : 0;
}
/* Cuts T rows of keys lens into parts: cut[0] = 0 <= cut[p] <= cut[parts] = T, part p's cost
   (rows x VX_SPLIT_ROW_COST + keys) in proportion to thread p's speed (even while any is
   unmeasured, or adaptation is off), each share within [1 / (2 parts), 3 / (2 parts)]
   before it is normalised. */
void vx_split_cut(const int32_t* lens, int64_t T, int parts, int64_t* cut) {
    double w[VX_WS_MAX], wsum = 0;
    parts = parts < 1 ? 1 : parts > VX_WS_MAX ? VX_WS_MAX : parts;
    int known = vx_split_adapt;
    for (int p = 0; p < parts; p++)
        known = known && vx_split_speed[p] > 0 && isfinite(vx_split_speed[p]);
    for (int p = 0; p < parts; p++) {
        w[p] = known ? vx_split_speed[p] : 1.0;
        wsum += w[p];
    }
    double fsum = 0;
    for (int p = 0; p < parts; p++) {  /* bound each share: a bad spell must not swing it */
        const double f = w[p] / wsum, lo = 0.5 / parts, hi = 1.5 / parts;
        w[p] = f < lo ? lo : f > hi ? hi : f;
        fsum += w[p];
    }
    wsum = fsum;
    int64_t total = 0;
    for (int64_t i = 0; i < T; i++) total += VX_SPLIT_ROW_COST + lens[i];
    cut[0] = 0;
    double goal = total * w[0] / wsum;
    int64_t acc = 0, p = 1;
    for (int64_t i = 0; i < T && p < parts; i++) {
        const int64_t c = VX_SPLIT_ROW_COST + lens[i];
        /* the row goes to part p - 1 if that leaves its total nearer the goal */
        if (acc + c / 2 > goal) {
            cut[p] = i;
            goal += total * w[p] / wsum;
            p++;
        }
        acc += c;
    }
    for (; p <= parts; p++) cut[p] = T;
}
/* What a greedy decode step adds around the layers (`vx.gpu.greedy`), each part for its own
   rows: before them the embeddings (into s->x) and the rotary's cos and sin (into s->cos and
   s->sin, [T, D / 2] scratch), after them the final RMSNorm (into s->h) and the LM head's
   argmax on its VNNI copy (into out). The same kernels as the module path's embedding
   lookup, `RMSNorm` and `VnniWeight.argmax`, so the same tokens; one parallel region a step
   instead of four (a host process that wakes at a step's start held the second thread out of
   the embedding's, the norm's and the head's regions in turn). */
typedef struct {
    const int64_t* ids;         /* [T] input tokens */
    const int64_t* positions;   /* [T] */
    const vx_bf16* embed;       /* [vocab rows, H] */
    const vx_bf16* cos_table;   /* [max position, D / 2] */
    const vx_bf16* sin_table;
    const vx_bf16* norm;        /* [H] the final RMSNorm's weight */
    const uint32_t* head;       /* the LM head packed for vx_argmax_vnni_bf16 */
    int64_t vocab;              /* its rows (N) */
    int64_t* out;               /* [T] each row's first maximum */
} vx_greedy_tail;
/* A decode-only step (s->np == 0) as up to `parts` independent sub-steps, one per thread of
   the pool: thread t runs every layer for its rows with the kernels single-threaded, so the
   two cores meet once per step instead of at each of ~300 parallel regions, and one core's
   memory-bound attention may run beside the other's compute-bound GEMMs. Rows are cut by
   vx_split_cut. Same kernels per row, so the same bits as vx_llama_decode_bf16 on the whole
   step. With `g` (not NULL), each part also runs the greedy tail above for its rows. Returns
   as vx_llama_decode_bf16, or -2 for a step it does not take (prefill chunks, a part too
   small to route its GEMMs as the whole step does), before anything is written. */
int vx_llama_decode_split(const vx_layer* layers, int n_layers, const vx_step* s, int parts,
                          const vx_greedy_tail* g) {
    const int64_t T = s->T;
    if (s->np || s->nd != T || parts < 2 || s->keep) return -2;
#if defined(__AVX512F__)
    /* Only on every linear's VNNI copy: the parts then route as the whole step does (the
       skinny GEMM's row cap would split the routing), nothing is left for a part to decline
       after another has written, and no kernel they run keeps scratch between calls (the AMX
       GEMM's re-laid x and the skinny GEMM's widened x are static: two parts at once would
       share them). */
    if (VX_STEP_AMX) return -2;
    for (int l = 0; l < n_layers; l++)
        if (!layers[l].qkv.vn || !layers[l].o.vn || !layers[l].gate_up.vn || !layers[l].down.vn)
            return -2;
#else
    return -2;  /* AVX2: steps of up to 24 rows, bound by the weights' stream */
#endif
    if (parts > omp_get_max_threads()) parts = omp_get_max_threads();
    if (parts > VX_WS_MAX) parts = VX_WS_MAX;
    if (parts < 2 || T < 2 * parts) return -2;
    int64_t cut[VX_WS_MAX + 1];
    vx_split_cut(s->lens, T, parts, cut);
    /* every part must route its GEMMs as the whole step does (int8 up to quant_rows, the
       skinny GEMM up to skinny_rows, AMX from 3 rows) */
    const int64_t route = s->quant_rows > s->skinny_rows ? s->quant_rows : s->skinny_rows;
    for (int p = 0; p < parts; p++)
        if (cut[p + 1] - cut[p] <= (route > 2 ? route : 2)) return -2;
    int rcs[VX_WS_MAX];
    double secs[VX_WS_MAX];
    const int64_t H = s->H, D = s->D, qkv_n = (s->Hq + 2 * s->Hkv) * D;
    _Pragma("omp parallel num_threads(parts)") {
        /* Load-bearing: with nesting inactive the inner regions run on this thread alone,
           but omp_get_max_threads() would still say 2, and vx_ws_init would make ranges for
           a partner that never comes (taken only by stealing). Scoped to this implicit
           task: the caller's later regions keep the pool. */
        omp_set_num_threads(1);
        const int nth = omp_get_num_threads();  /* fewer than asked (OMP_DYNAMIC): loop */
        for (int t = omp_get_thread_num(); t < parts; t += nth) {
            const int64_t r0 = cut[t], n = cut[t + 1] - cut[t];
            vx_step u = *s;
            u.T = u.nd = n;
            u.cos += r0 * (D / 2); u.sin += r0 * (D / 2);
            u.slots += r0; u.bt += r0 * s->bt_s; u.lens += r0;
            u.x += r0 * H; u.residual += r0 * H; u.h += r0 * H;
            u.qkv += r0 * qkv_n; u.attn += r0 * s->Hq * D;
            u.gu += r0 * 2 * s->I; u.act += r0 * s->I;
            const double t0 = omp_get_wtime();
            if (g) {
                const int64_t h2 = D / 2;
                for (int64_t i = 0; i < n; i++) {
                    const int64_t r = r0 + i, pos = g->positions[r];
                    memcpy(u.x + i * H, g->embed + g->ids[r] * H, (size_t)H * sizeof(vx_bf16));
                    memcpy((vx_bf16*)u.cos + i * h2, g->cos_table + pos * h2, (size_t)h2 * sizeof(vx_bf16));
                    memcpy((vx_bf16*)u.sin + i * h2, g->sin_table + pos * h2, (size_t)h2 * sizeof(vx_bf16));
                }
            }
            rcs[t] = vx_llama_decode_bf16(layers, n_layers, &u);
            if (g && !rcs[t]) {
                vx_add_rms_norm_bf16(u.x, H, u.residual, u.residual, g->norm, u.h, n, H, s->eps);
                rcs[t] = vx_argmax_vnni_bf16(u.h, H, (int)n, g->head, g->vocab, H, g->out + r0);
            }
            secs[t] = omp_get_wtime() - t0;
        }
    }
    /* Nothing is left for a part to decline (checked above), and after another part has
       written, a decline could not be taken back: any failure is an error here. */
    for (int t = 0; t < parts; t++)
        if (rcs[t]) return rcs[t] == -2 ? -1 : rcs[t];
    if (vx_split_adapt)
        for (int t = 0; t < parts; t++) {
            int64_t c = 0;
            for (int64_t i = cut[t]; i < cut[t + 1]; i++) c += VX_SPLIT_ROW_COST + s->lens[i];
            if (secs[t] <= 0) continue;
            const double v = c / secs[t];
            /* smoothed: the slow spells last tens of steps, a preempted step one */
            vx_split_speed[t] = vx_split_speed[t] > 0 ? 0.7 * vx_split_speed[t] + 0.3 * v : v;
        }
    return 0;
}
#if defined(__AVX512F__)
int vx_has_decode_step(void) { return 1; }
#else
int vx_has_decode_step(void) { return 2; }  /* AVX2: up to vx_gemv_avx2_max_rows() rows */
#endif
#else
int vx_has_decode_step(void) { return 0; }
#endif
"""
