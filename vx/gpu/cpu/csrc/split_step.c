/* The split decode step: a decode-only step as independent sub-steps, one per
   thread, each running every layer (decode_step.c's `vx_llama_layers`) for its own
   rows, with the rows a slower thread has not reached handed to a thread that is done.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library after the
   fused step's source; `vx.gpu.cpu.fused_step.FusedDecode` calls `vx_llama_decode_split`).

   Why: two cores meet once a step instead of at each of ~300 parallel regions. The rows are cut
   by each thread's measured speed, but a host process that wakes on a Worker thread's core
   (each step's tokens: the front, the EngineCore, a local load generator) slows that thread's
   part at random: served at c = 64 on two Zen 5 cores, the parts seldom ended together and
   one core sat idle at the step's end. So a thread done with its rows asks the other for
   work, and the other, at its next layer boundary, hands over half of its rows for the rest
   of the layers (rows do not interact in a decode step: each row's state between layers is
   its x and residual rows, and the attention reads only its own request's K/V). */
#include "vx_kernels.h"
/* 1 (the default): a thread done with its part takes rows from the other (two parts); 0: each
   part runs its own rows only (A/B, tests); 2 (tests): as 1, and the thread with more rows
   waits after its first stage until the other asks, so that a hand-over comes whatever the
   threads' timing (on a loaded host the part with fewer rows can end last). */
static int vx_split_steal = 1;
void vx_set_split_steal(int on) { vx_split_steal = on; }
/* The hand-overs in the last split step (tests, profiling). */
static int vx_split_handovers_last;
int vx_split_handovers(void) { return vx_split_handovers_last; }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* The split's row cuts follow each thread's speed: the threads are pinned, one per core, and
   a core shared with the host processes (or slowed by its host) runs its part slower for
   tens of steps at a time (measured on a 2-core Zen 5 at 64 rows: the same side stayed
   behind step after step). vx_split_speed[t]: thread t's cost units a second, smoothed over
   steps (0: not yet measured). */
#define VX_SPLIT_ROW_COST 400  /* a row's GEMM work in keys of attention (the ratio of a row's
                                  GEMM time to a key's attention time over all layers,
                                  measured for SmolLM2 on a 2-core Zen 5) */
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
/* What a greedy decode step adds around the layers (`vx.gpu.sample.greedy`), each part for its own
   rows: before them the embeddings (into s->x) and the rotary's cos and sin (into s->cos and
   s->sin, [T, D / 2] scratch), after them the final RMSNorm (into s->h) and the LM head's
   argmax on its VNNI copy (into out). The same kernels as the module path's embedding
   lookup, `RMSNorm` and `VnniWeight.argmax`, so the same tokens; one parallel region a step
   instead of four (a host process that wakes at a step's start held the second thread out of
   the embedding's, the norm's and the head's regions in turn). */
typedef struct vx_greedy_tail {
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
/* Rows [r0, r0 + n) of the step's inputs from g: the embeddings into s->x, the rotary's cos
   and sin at their positions into s->cos and s->sin (scratch here). */
static void vx_greedy_inputs(const vx_step* s, const vx_greedy_tail* g, int64_t r0, int64_t n) {
    const int64_t H = s->H, h2 = s->R / 2;
    vx_bf16 *cs = (vx_bf16*)s->cos, *sn = (vx_bf16*)s->sin;
    for (int64_t r = r0; r < r0 + n; r++) {
        const int64_t pos = g->positions[r];
        memcpy(s->x + r * H, g->embed + g->ids[r] * H, (size_t)H * sizeof(vx_bf16));
        memcpy(cs + r * h2, g->cos_table + pos * h2, (size_t)h2 * sizeof(vx_bf16));
        memcpy(sn + r * h2, g->sin_table + pos * h2, (size_t)h2 * sizeof(vx_bf16));
    }
}
/* Rows [a, e) of a split step from stage l on: stages 0 .. n_layers - 1 are the layers, stage
   n_layers the greedy tail where there is one. */
typedef struct { int64_t a, e; int l; } vx_unit;
/* One a thread. Invariants: only the other thread sets req (to 1) and clears resp (to 0),
   and only while it waits on this box; only this thread clears req, and it does so before
   it publishes its answer (given, then resp: 1 given, -1 declined), so a cleared req never
   overwrites a later request. done: this thread takes and gives no more work. */
typedef struct {
    int req, resp, done;
    int hold;                   /* vx_split_steal 2: wait after stage 0 for a request */
    const int* peer_done;       /* the other box's done (ends such a wait) */
    vx_unit given;
    char pad[64];
} vx_mbox;
static inline int vx_ld_acq(const int* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void vx_st_rel(int* p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
/* This thread's answer to a pending request: half of u's rows from its next stage on, or a
   decline (u NULL, or too few rows or stages left to be worth a hand-over). */
static void vx_split_answer(vx_mbox* mine, vx_unit* u, int64_t min_rows) {
    if (!vx_ld_acq(&mine->req)) return;
    vx_st_rel(&mine->req, 0);
    const int64_t n = u ? u->e - u->a : 0, give = n / 2;
    if (u && give > min_rows && n - give > min_rows) {
        mine->given.a = u->e - give;
        mine->given.e = u->e;
        mine->given.l = u->l;
        u->e -= give;
        __atomic_add_fetch(&vx_split_handovers_last, 1, __ATOMIC_RELAXED);
        vx_st_rel(&mine->resp, 1);
    } else {
        vx_st_rel(&mine->resp, -1);
    }
}
/* Runs unit u to its end on this thread (answering the other's requests at each stage
   boundary when `box` is not NULL); adds its work to *cost and its time to *secs. */
static int vx_split_run(const vx_layer* layers, int n_layers, const vx_step* s,
                        const vx_greedy_tail* g, vx_unit* u, vx_mbox* box, int64_t min_rows,
                        double* cost, double* secs) {
    const int64_t H = s->H, D = s->D, qkv_n = (s->Hq + 2 * s->Hkv) * D;
    const int stages = n_layers + (g ? 1 : 0);
    while (u->l < stages) {
        if (box && box->hold && u->l == 1) {
            while (!vx_ld_acq(&box->req) && !vx_ld_acq(box->peer_done)) _mm_pause();
            box->hold = 0;
        }
        if (box) vx_split_answer(box, u, min_rows);
        const int64_t r0 = u->a, n = u->e - u->a;
        vx_step v = *s;  /* the step's view of rows [r0, r0 + n): every buffer is by row */
        v.T = v.nd = n;
        v.cos += r0 * (s->R / 2); v.sin += r0 * (s->R / 2);
        if (v.cos_l) { v.cos_l += r0 * (s->R / 2); v.sin_l += r0 * (s->R / 2); }
        v.slots += r0; v.bt += r0 * s->bt_s; v.lens += r0;
        v.x += r0 * H; v.residual += r0 * H; v.h += r0 * H;
        v.qkv += r0 * qkv_n; v.attn += r0 * s->Hq * D;
        v.gu += r0 * 2 * s->I; v.act += r0 * s->I;
        const double t0 = omp_get_wtime();
        int rc;
        if (u->l < n_layers) {
            rc = vx_llama_layers(layers, u->l, u->l + 1, n_layers, &v);
        } else {
            vx_add_rms_norm_bf16(v.x, H, v.residual, v.residual, g->norm, v.h, n, H, s->eps);
            rc = vx_argmax_vnni_bf16(v.h, H, (int)n, g->head, g->vocab, H, g->out + r0);
        }
        *secs += omp_get_wtime() - t0;
        if (rc) return rc;
        double c = 0;
        for (int64_t i = r0; i < u->e; i++) c += VX_SPLIT_ROW_COST + s->lens[i];
        *cost += c / stages;
        u->l++;
    }
    return 0;
}
/* A decode-only step (s->np == 0) as up to `parts` independent sub-steps, one per thread of
   the pool: thread t runs every layer for its rows with the kernels single-threaded (rows cut
   by vx_split_cut). With two parts on two threads, a thread done with its rows asks the
   other for half of the rows it has left, from its next layer on (`vx_split_answer`), until
   the other declines or is done. Same kernels per row, and each row's kernels do not depend
   on the rows beside it, so the same bits as vx_llama_decode_bf16 on the whole step. With `g`
   (not NULL), each part also runs the greedy tail above for its rows (`vx_greedy_tail`).
   Returns as vx_llama_decode_bf16, or -2 for a step it does not take (prefill chunks, a part
   too small to route its GEMMs as the whole step does), before anything is written. */
int vx_llama_decode_split(const vx_layer* layers, int n_layers, const vx_step* s, int parts,
                          const vx_greedy_tail* g) {
    const int64_t T = s->T;
    /* a row range of several KV-cache groups' tables is not cut here: the whole step runs */
    if (s->np || s->nd != T || parts < 2 || s->keep || s->groups) return -2;
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
    /* every part, and every hand-over, must route its GEMMs as the whole step does (int8 up
       to quant_rows, the skinny GEMM up to skinny_rows, AMX from 3 rows) */
    int64_t route = s->quant_rows > s->skinny_rows ? s->quant_rows : s->skinny_rows;
    route = route > 2 ? route : 2;
    for (int p = 0; p < parts; p++)
        if (cut[p + 1] - cut[p] <= route) return -2;
    int rcs[VX_WS_MAX];
    double secs[VX_WS_MAX], cost[VX_WS_MAX];
    vx_mbox box[2];
    memset(box, 0, sizeof(box));
    for (int t = 0; t < 2 && parts == 2; t++) {
        box[t].peer_done = &box[1 - t].done;
        box[t].hold = vx_split_steal == 2 && cut[t + 1] - cut[t] > cut[2 - t] - cut[1 - t];
    }
    vx_split_handovers_last = 0;
    _Pragma("omp parallel num_threads(parts)") {
        /* Load-bearing: with nesting inactive the inner regions run on this thread alone,
           but omp_get_max_threads() would still say 2, and vx_ws_init would make ranges for
           a partner that never comes (taken only by stealing). Scoped to this implicit
           task: the caller's later regions keep the pool. */
        omp_set_num_threads(1);
        const int nth = omp_get_num_threads();  /* fewer than asked (OMP_DYNAMIC): loop */
        const int steal = parts == 2 && nth == 2 && vx_split_steal;
        for (int t = omp_get_thread_num(); t < parts; t += nth) {
            const int64_t r0 = cut[t], n = cut[t + 1] - cut[t];
            secs[t] = cost[t] = 0;
            const double t0 = omp_get_wtime();
            if (g) vx_greedy_inputs(s, g, r0, n);
            secs[t] = omp_get_wtime() - t0;
            vx_unit u = {r0, r0 + n, 0};
            vx_mbox *mine = steal ? &box[t] : 0, *other = steal ? &box[1 - t] : 0;
            rcs[t] = vx_split_run(layers, n_layers, s, g, &u, mine, route, &cost[t], &secs[t]);
            while (steal && !rcs[t]) {  /* done: ask the other thread for rows it has left */
                vx_split_answer(mine, 0, route);
                if (vx_ld_acq(&other->done)) break;
                vx_st_rel(&other->resp, 0);
                vx_st_rel(&other->req, 1);
                int r;
                while (!(r = vx_ld_acq(&other->resp)) && !vx_ld_acq(&other->done)) {
                    vx_split_answer(mine, 0, route);  /* both asking: each declines */
                    _mm_pause();
                }
                if (r != 1) break;
                vx_unit w = other->given;
                rcs[t] = vx_split_run(layers, n_layers, s, g, &w, mine, route, &cost[t],
                                      &secs[t]);
            }
            if (steal) {
                vx_st_rel(&box[t].done, 1);
                vx_split_answer(&box[t], 0, route);
            }
        }
    }
    /* Nothing is left for a part to decline (checked above), and after another part has
       written, a decline could not be taken back: any failure is an error here. */
    for (int t = 0; t < parts; t++)
        if (rcs[t]) return rcs[t] == -2 ? -1 : rcs[t];
    if (vx_split_adapt)
        for (int t = 0; t < parts; t++) {
            if (secs[t] <= 0 || cost[t] <= 0) continue;
            const double v = cost[t] / secs[t];
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
