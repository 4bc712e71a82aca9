/* The element-wise CPU kernels: RMSNorm (with the residual add), and SiLU-mul.

   Runs in: the Worker process (`vx.gpu.cpu.library` builds it into the kernel library, before the
   GEMMs; `vx.gpu.cpu.ops` calls them on the module path, the fused step in C).

   Portable C for any x86-64 level (the compiler vectorises the loops for the CPU it builds for),
   with an AVX512-BF16 or an AVX2 body for SiLU-mul's exp, and AVX512-BF16 bodies for RMSNorm (and
   the rotary, decode_step.c): VCVTNEPS2BF16 does their bf16 roundings. Each keeps the roundings of the torch
   ops it replaces: RMSNorm HF Llama's, SiLU-mul bf16(silu) then bf16(product). The AVX2 exp and
   bf16 load (`vx_exp8`, `vx_ld8_bf16`) are shared with the AVX2 decode attention, which comes
   later in the library's source. */
#include "vx_kernels.h"
#include <immintrin.h>
/* The element-wise kernels: portable C (any x86-64 level; the compiler vectorises the loops
   for the CPU it builds for), with an AVX512-BF16 body where the CPU has it. */
/* st_bf16 without the early return, so loops over it vectorise (same results). */
static inline vx_bf16 st_bf16v(float f) {
    union { uint32_t u; float f; } c; c.f = f;
    const uint32_t u = c.u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (vx_bf16)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40 : rounded);
}
#if defined(__AVX512BF16__)
/* bf16 rounding of 16 fp32 lanes, back in fp32 (VCVTNEPS2BF16: round to nearest even, as
   st_bf16v for every normal value; denormals, which activations never reach, become zero) */
static inline __m512 vx_round16_bf16(__m512 v) {
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
}
static inline __m512 vx_ld16_bf16(const vx_bf16* p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void vx_st16_bf16(vx_bf16* p, __m512 v) {
    const __m256bh b = _mm512_cvtneps_pbh(v);
    _mm256_storeu_si256((__m256i*)p, (__m256i)b);
}
#endif
/* One row of RMSNorm with the residual add fused, bf16 in and out: r = bf16(x + res) into rr
   (when res), h = fp32(r), then with HF Llama's roundings out = bf16(w * bf16(h / rms(h))), or
   with `gemma` HF Gemma's, out = bf16((h / rms(h)) * (1 + w)), both products in fp32 and nothing
   rounded between them. o may be xr (each element is read before it is written). */
static inline void vx_rms_row(const vx_bf16* xr, const vx_bf16* res, vx_bf16* rr,
                              const vx_bf16* w, vx_bf16* o, int64_t H, float eps, int gemma) {
    float ss = 0.f;
#if defined(__AVX512BF16__)
    /* 16 lanes, the same roundings as the loops below; only the sum's order differs */
    if (H % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        if (res) {
            for (int64_t i = 0; i < H; i += 16) {
                const __m512 v = vx_round16_bf16(
                    _mm512_add_ps(vx_ld16_bf16(xr + i), vx_ld16_bf16(res + i)));
                vx_st16_bf16(rr + i, v);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
            xr = rr;
        } else {
            for (int64_t i = 0; i < H; i += 16) {
                const __m512 v = vx_ld16_bf16(xr + i);
                acc = _mm512_fmadd_ps(v, v, acc);
            }
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(acc) / (float)H + eps));
        if (gemma) {
            const __m512 one = _mm512_set1_ps(1.f);
            for (int64_t i = 0; i < H; i += 16)
                vx_st16_bf16(o + i, _mm512_mul_ps(_mm512_mul_ps(vx_ld16_bf16(xr + i), inv),
                                                  _mm512_add_ps(one, vx_ld16_bf16(w + i))));
        } else {
            for (int64_t i = 0; i < H; i += 16)
                vx_st16_bf16(o + i, _mm512_mul_ps(vx_ld16_bf16(w + i),
                                                  vx_round16_bf16(_mm512_mul_ps(vx_ld16_bf16(xr + i), inv))));
        }
        return;
    }
#endif
    if (res) {
        for (int64_t i = 0; i < H; i++) {
            const vx_bf16 v = st_bf16v(ld_bf16(xr[i]) + ld_bf16(res[i]));
            rr[i] = v;
            const float f = ld_bf16(v);
            ss += f * f;
        }
        xr = rr;
    } else {
        for (int64_t i = 0; i < H; i++) { const float f = ld_bf16(xr[i]); ss += f * f; }
    }
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    if (gemma) {
        for (int64_t i = 0; i < H; i++) {
            const float h = ld_bf16(xr[i]) * inv;
            o[i] = st_bf16v(h * (1.f + ld_bf16(w[i])));
        }
    } else {
        for (int64_t i = 0; i < H; i++)
            o[i] = st_bf16v(ld_bf16(w[i]) * ld_bf16(st_bf16v(ld_bf16(xr[i]) * inv)));
    }
}
/* RMSNorm with the residual add fused, bf16 in and out, with HF Llama's roundings
   (`vx_rms_row`). x, residual, r_out, out: [T, H] with row strides x_st (residual, r_out, out:
   H). */
void vx_add_rms_norm_bf16(const vx_bf16* x, int64_t x_st, const vx_bf16* residual,
                          vx_bf16* r_out, const vx_bf16* w, vx_bf16* out, int64_t T, int64_t H,
                          float eps) {
    _Pragma("omp parallel for schedule(static) if (T * H >= 65536)")
    for (int64_t t = 0; t < T; t++)
        vx_rms_row(x + t * x_st, residual ? residual + t * H : NULL, r_out ? r_out + t * H : NULL,
                   w, out + t * H, H, eps, 0);
}
/* Gemma's RMSNorm (HF's Gemma2RMSNorm: (1 + w) in fp32, `vx_rms_row`), arguments as
   vx_add_rms_norm_bf16's; out may be x. */
void vx_gemma_rms_norm_bf16(const vx_bf16* x, int64_t x_st, const vx_bf16* residual,
                            vx_bf16* r_out, const vx_bf16* w, vx_bf16* out, int64_t T,
                            int64_t H, float eps) {
    _Pragma("omp parallel for schedule(static) if (T * H >= 65536)")
    for (int64_t t = 0; t < T; t++)
        vx_rms_row(x + t * x_st, residual ? residual + t * H : NULL, r_out ? r_out + t * H : NULL,
                   w, out + t * H, H, eps, 1);
}
/* RMSNorm over each of nh heads (D values, D apart) of each of T rows (row stride x_st), in
   place: Qwen3's and Gemma 3's q/k norms (`gemma`: Gemma's roundings, else Llama's), each head
   as a row of the module path's [T * nh, D] norm (the same bits): one call for all the step's
   heads, parallel over them where they are many (prompt steps). */
void vx_head_rms_norm_bf16(vx_bf16* x, int64_t x_st, int64_t T, int64_t nh, int64_t D,
                           const vx_bf16* w, float eps, int gemma) {
    _Pragma("omp parallel for schedule(static) if (T * nh * D >= 65536)")
    for (int64_t i = 0; i < T * nh; i++) {
        vx_bf16* r = x + (i / nh) * x_st + (i % nh) * D;
        vx_rms_row(r, NULL, NULL, w, r, D, eps, gemma);
    }
}
/* gelu_tanh(gate) * up for gate_up [T, 2I] (row stride gu_st) -> out [T, I], bf16: GeGLU
   (HF's gelu_pytorch_tanh), torch's formula 0.5 g (1 + tanh(b (g + k g^3))) in fp32, tanh as
   (1 - e) / (1 + e) with e = exp(-2|u|) and u's sign (vx_expf, or vx_tanh16: within a few
   1e-7 of tanhf), then bf16(gelu) and bf16(product) as torch's two ops round. */
static inline float vx_gelu_tanh(float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
    const float e = vx_expf(-2.f * fabsf(u));
    const float th = (1.f - e) / (1.f + e);
    return 0.5f * g * (1.f + (u >= 0.f ? th : -th));
}
void vx_gelu_tanh_and_mul_bf16(const vx_bf16* gu, int64_t gu_st, vx_bf16* out, int64_t T,
                               int64_t I) {
    _Pragma("omp parallel for schedule(static) if (T * I >= 65536)")
    for (int64_t t = 0; t < T; t++) {
        const vx_bf16* g = gu + t * gu_st;
        const vx_bf16* u = g + I;
        vx_bf16* o = out + t * I;
        int64_t i = 0;
#if defined(__AVX512BF16__)
        const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f);
        const __m512 b = _mm512_set1_ps(0.7978845608028654f), k = _mm512_set1_ps(0.044715f);
        for (; i + 16 <= I; i += 16) {  /* the scalar loop's operations, lane by lane */
            const __m512 gv = vx_ld16_bf16(g + i);
            const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(gv, gv), gv);
            const __m512 uu = _mm512_mul_ps(b, _mm512_add_ps(gv, _mm512_mul_ps(k, g3)));
            const __m512 th = vx_tanh16(uu);
            const __m512 ge = _mm512_mul_ps(_mm512_mul_ps(half, gv), _mm512_add_ps(one, th));
            vx_st16_bf16(o + i, _mm512_mul_ps(vx_round16_bf16(ge), vx_ld16_bf16(u + i)));
        }
#endif
        for (; i < I; i++)
            o[i] = st_bf16v(ld_bf16(st_bf16v(vx_gelu_tanh(ld_bf16(g[i])))) * ld_bf16(u[i]));
    }
}
/* silu(gate) * up for gate_up [T, 2I] (row stride gu_st) -> out [T, I], bf16 with torch's
   roundings: bf16(silu) then bf16(product). */
static inline float vx_silu_round(float g, float u) {
    const float e = vx_expf(-fabsf(g));  /* vx_expf takes x <= 0: sigmoid from exp(-|g|) */
    const float s = ld_bf16(st_bf16v(g * ((g >= 0.f ? 1.f : e) / (1.f + e))));
    return s * u;
}
#if defined(__AVX512BF16__)
/* Rotate-half rotary on 16 lanes: pa = a c - b s, pb = b c + a s, each product and the sum
   rounded to bf16 (torch's eager ops; vx_rotary_bf16's, and the AMX qkv GEMM's epilogue) */
static inline void vx_rope16(vx_bf16* pa, vx_bf16* pb, __m512 a, __m512 b, __m512 ci,
                             __m512 si) {
    const __m512 ac = vx_round16_bf16(_mm512_mul_ps(a, ci));
    const __m512 bs = vx_round16_bf16(_mm512_mul_ps(b, si));
    const __m512 bc = vx_round16_bf16(_mm512_mul_ps(b, ci));
    const __m512 as = vx_round16_bf16(_mm512_mul_ps(a, si));
    vx_st16_bf16(pa, _mm512_sub_ps(ac, bs));
    vx_st16_bf16(pb, _mm512_add_ps(bc, as));
}
/* 16 lanes of vx_silu_round: gate and up values (bf16 values widened) -> bf16 (also the AMX
   gate-up GEMM's epilogue, gemm_amx_vnni.c: the same bits either way) */
static inline __m256bh vx_silu_mul16(__m512 gv, __m512 uv) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 e = vx_exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));
    const __mmask16 pos = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_GE_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(pos, e, one), _mm512_add_ps(one, e));
    const __m512 s = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_mul_ps(gv, sig)));
    return _mm512_cvtneps_pbh(_mm512_mul_ps(s, uv));
}
#endif
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VX_SILU_AVX2 1
static inline __m256 vx_ld8_bf16(const vx_bf16* p) {  /* 8 bf16 -> 8 fp32, exact */
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
/* vx_expf on 8 lanes (x <= 0), its roundings step by step. */
static inline __m256 vx_exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256i ni = _mm256_cvttps_epi32(_mm256_sub_ps(t, _mm256_set1_ps(0.5f)));
    const __m256 n = _mm256_cvtepi32_ps(ni);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(VX_LN2_HI))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(VX_LN2_LO)));
    const __m256 p = VX_EXP_POLY(_mm256_fmadd_ps, _mm256_set1_ps, r);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
/* st_bf16v on 8 finite lanes, left in the high halves (the low halves zero): fp32 values */
static inline __m256 vx_round8_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline void vx_st8_bf16(vx_bf16* p, __m256 rounded) {  /* rounded: vx_round8_bf16's */
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h),
                                            _mm256_extracti128_si256(h, 1));
    _mm_storeu_si128((__m128i*)p, packed);
}
#endif
void vx_silu_and_mul_bf16(const vx_bf16* gu, int64_t gu_st, vx_bf16* out, int64_t T, int64_t I) {
    _Pragma("omp parallel for schedule(static) if (T * I >= 65536)")
    for (int64_t t = 0; t < T; t++) {
        const vx_bf16* g = gu + t * gu_st;
        const vx_bf16* u = g + I;
        vx_bf16* o = out + t * I;
        int64_t i = 0;
#if defined(__AVX512BF16__)
        for (; i + 16 <= I; i += 16)
            _mm256_storeu_si256((__m256i*)(o + i),
                                (__m256i)vx_silu_mul16(vx_ld16_bf16(g + i), vx_ld16_bf16(u + i)));
#elif defined(VX_SILU_AVX2)
        /* non-finite gate or up values take the scalar tail's NaN handling */
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        const __m256 big = _mm256_set1_ps(3.0e38f);
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = vx_ld8_bf16(g + i), uv = vx_ld8_bf16(u + i);
            const __m256 ag = _mm256_andnot_ps(_mm256_set1_ps(-0.f), gv);
            const __m256 au = _mm256_andnot_ps(_mm256_set1_ps(-0.f), uv);
            if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(ag, big, _CMP_NLE_UQ),
                                                _mm256_cmp_ps(au, big, _CMP_NLE_UQ))))
                break;
            const __m256 e = vx_exp8(_mm256_sub_ps(zero, ag));
            const __m256 pos = _mm256_cmp_ps(gv, zero, _CMP_GE_OQ);
            const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), _mm256_add_ps(one, e));
            const __m256 sv = vx_round8_bf16(_mm256_mul_ps(gv, sig));
            vx_st8_bf16(o + i, vx_round8_bf16(_mm256_mul_ps(sv, uv)));
        }
#endif
        for (; i < I; i++) o[i] = st_bf16v(vx_silu_round(ld_bf16(g[i]), ld_bf16(u[i])));
    }
}
/* Whether vx_silu_and_mul_bf16 has a vector body here (else it is scalar, and torch's two
   vectorised ops are faster past a few rows). */
int vx_silu_simd(void) {
#if defined(__AVX512BF16__) || defined(VX_SILU_AVX2)
    return 1;
#else
    return 0;
#endif
}
