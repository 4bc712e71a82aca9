/* The glue of a mixture-of-experts layer around its experts' GEMMs.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library;
   `vx.gpu.layers.cpu_experts` calls it).

   Why: the experts' own GEMMs are the dense linears' kernels, one call each; what a layer did
   around them (sort the (token, slot) pairs by expert, count them, gather their rows, weigh the
   outputs, scatter them back, add each token's slots) was ~15 torch ops, a tenth of a decode
   step of a 1 B MoE at 32 rows (measured). Here it is two calls, portable C (any x86-64 level).

   Invariants: the results are the torch ops' bit for bit: the grouping is a stable counting
   sort (`argsort(stable=True)`'s order), a weighted row is bf16(y * w) with w fp32 or bf16 (the
   product in fp32, one rounding: torch's `bf16 * fp32 -> fp32 -> bf16` and `bf16 * bf16`), and
   a token's slots are added in slot order with a bf16 rounding after each add. */

/* Groups the T * k (token, slot) pairs of ids [T, k] (int64, each in [0, E)) by expert, in
   pair order within an expert: counts [E] the pairs per expert, pos [T * k] each pair's row
   in the grouped order, and xs [T * k, H] the grouped rows (pair p's token row of x [T, H],
   row stride x_st). Returns 0, or -1 where an id is out of range (nothing written to xs). */
int vx_moe_group_bf16(const vx_bf16* x, int64_t x_st, const int64_t* ids, int64_t T, int64_t k,
                      int64_t E, int64_t H, int64_t* counts, int64_t* pos, vx_bf16* xs) {
    const int64_t n = T * k;
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t p = 0; p < n; p++) {
        if (ids[p] < 0 || ids[p] >= E) return -1;
        counts[ids[p]]++;
    }
    int64_t start[E > 0 ? E : 1];
    int64_t at = 0;
    for (int64_t e = 0; e < E; e++) { start[e] = at; at += counts[e]; }
    for (int64_t p = 0; p < n; p++) pos[p] = start[ids[p]]++;
    _Pragma("omp parallel for schedule(static) if (n * H >= 65536)")
    for (int64_t p = 0; p < n; p++)
        memcpy(xs + pos[p] * H, x + (p / k) * x_st, (size_t)H * sizeof(vx_bf16));
    return 0;
}

/* out [T, H] = for each token, sum over its k slots (in slot order, a bf16 rounding after each
   add) of bf16(ys[pos[t * k + j]] * w[t * k + j]): ys [T * k, H] the grouped experts' outputs
   (`vx_moe_group_bf16`'s order), w [T, k] fp32 (w_f32) or bf16. */
void vx_moe_combine_bf16(const vx_bf16* ys, const int64_t* pos, const void* w, int32_t w_f32,
                         int64_t T, int64_t k, int64_t H, vx_bf16* out) {
    _Pragma("omp parallel for schedule(static) if (T * k * H >= 65536)")
    for (int64_t t = 0; t < T; t++) {
        vx_bf16* o = out + t * H;
        for (int64_t j = 0; j < k; j++) {
            const int64_t p = t * k + j;
            const float wj = w_f32 ? ((const float*)w)[p] : ld_bf16(((const vx_bf16*)w)[p]);
            const vx_bf16* y = ys + pos[p] * H;
            if (j == 0) {
                for (int64_t i = 0; i < H; i++) o[i] = st_bf16v(ld_bf16(y[i]) * wj);
            } else {
                for (int64_t i = 0; i < H; i++)
                    o[i] = st_bf16v(ld_bf16(o[i]) + ld_bf16(st_bf16v(ld_bf16(y[i]) * wj)));
            }
        }
    }
}

/* The router's top-k for bf16 logits [T, E] (row stride l_st): softmax in fp32, the k largest
   probabilities in descending order (equal ones: the lower id first), optionally renormalised
   to sum to 1 (their sum in slot order, then a division), stored as fp32 (w_f32) or rounded to
   bf16 into w [T, k], their ids into ids [T, k]. `select_experts`'s arithmetic up to the last
   bit of the fp32 exp and sum (torch's are vectorised). */
void vx_moe_topk_bf16(const vx_bf16* logits, int64_t l_st, int64_t T, int64_t E, int64_t k,
                      int32_t renorm, int32_t w_f32, void* w, int64_t* ids) {
    for (int64_t t = 0; t < T; t++) {
        const vx_bf16* l = logits + t * l_st;
        float p[E > 0 ? E : 1];
        float mx = ld_bf16(l[0]);
        for (int64_t e = 1; e < E; e++) mx = fmaxf(mx, ld_bf16(l[e]));
        float sum = 0.f;
        for (int64_t e = 0; e < E; e++) { p[e] = expf(ld_bf16(l[e]) - mx); sum += p[e]; }
        const float inv = 1.f / sum;
        for (int64_t e = 0; e < E; e++) p[e] *= inv;
        float top[k > 0 ? k : 1];
        int64_t* id = ids + t * k;
        float wsum = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= id[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            id[j] = best;
            top[j] = p[best];
            wsum += top[j];
        }
        for (int64_t j = 0; j < k; j++) {
            const float v = renorm ? top[j] / wsum : top[j];
            if (w_f32) ((float*)w)[t * k + j] = v;
            else ((vx_bf16*)w)[t * k + j] = st_bf16v(v);
        }
    }
}
