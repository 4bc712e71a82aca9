/* vx's CPU kernel library: the helpers every kernel file shares, and the exported functions.

   Built as one translation unit (vx_kernels.c includes each kernel file in a fixed order);
   `vx.gpu.cpu.library` compiles it and `vx.gpu.cpu.abi` binds the functions declared below with
   ctypes (a test checks that table against these prototypes).

   Invariants: every exported symbol is a `vx_*` function declared here, with the C types its
   ctypes binding names (pointers as `void*`, int64_t as c_int64, int as c_int, float as
   c_float); a function that exists only on some ISAs is declared here all the same, and its
   callers first ask the library's `vx_has_*` query. bf16 values travel as their bits
   (`vx_bf16`), rounded to nearest even as torch rounds. */
#ifndef VX_KERNELS_H
#define VX_KERNELS_H
#define _GNU_SOURCE  /* sched_setaffinity, CPU_SET (parallel.c): before any system header */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
typedef uint16_t vx_bf16;
static inline float ld_f32(float x) { return x; }
static inline float st_f32(float x) { return x; }
static inline float ld_bf16(vx_bf16 x) {
    union { uint32_t u; float f; } c; c.u = (uint32_t)x << 16; return c.f;
}
static inline vx_bf16 st_bf16(float f) {
    union { uint32_t u; float f; } c; c.f = f;
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (vx_bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);  /* round to nearest even, as torch */
    return (vx_bf16)(u >> 16);
}
/* exp(x) for x <= 0 without a libm call, so the softmax loop vectorises: x = n ln2 + r with
   |r| <= ln2/2 (ln2 split in two for an exact n ln2), exp(r) by its degree-7 Taylor polynomial
   (truncation < 1e-8 relative), 2^n by building the exponent bits. Within 2 ulp of expf. */
#define VX_LN2_HI 0.693145751953125f  /* ln2 in two parts: n * VX_LN2_HI is exact */
#define VX_LN2_LO 1.428606765330187e-06f
static inline float vx_expf(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const int ni = (int)(t - 0.5f);  /* t <= 0: truncation of t - 0.5 rounds to nearest */
    const float n = (float)ni;
    const float r = (x - n * VX_LN2_HI) - n * VX_LN2_LO;
    float p = 1.f / 5040.f;
    p = p * r + 1.f / 720.f; p = p * r + 1.f / 120.f; p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f; p = p * r + 0.5f; p = p * r + 1.f; p = p * r + 1.f;
    union { uint32_t u; float f; } c; c.u = (uint32_t)(ni + 127) << 23;
    return p * c.f;
}
/* vx_expf's polynomial for its vector forms (vx_exp16 here, vx_exp8 with the AVX2 SiLU), the
   same Horner steps: FMA(a, b, c) = a * b + c, SET(c) the constant c in every lane. */
#define VX_EXP_POLY(FMA, SET, r) \
    FMA(FMA(FMA(FMA(FMA(FMA(FMA(SET(1.f / 5040.f), r, SET(1.f / 720.f)), r, SET(1.f / 120.f)), \
        r, SET(1.f / 24.f)), r, SET(1.f / 6.f)), r, SET(0.5f)), r, SET(1.f)), r, SET(1.f))
/* 2^r for r in [-1/2, 1/2]: degree 6, fitted for relative error (~1e-7 in fp32). Shared by the
   prefill kernels' 2^x (AMX: 16 lanes; AVX2: 8). */
#define VX_EXP2_POLY(FMA, SET, r) \
    FMA(FMA(FMA(FMA(FMA(FMA(SET(1.534581242594868e-04f), r, SET(1.3399930903688073e-03f)), r, \
        SET(9.618489071726799e-03f)), r, SET(5.550328642129898e-02f)), r, \
        SET(2.4022646248340607e-01f)), r, SET(6.931471824645996e-01f)), r, SET(1.0f))

/* ── The library's ABI: every exported function, as `vx.gpu.cpu.abi.KERNEL_ABI` binds it ── */

/* The fused step's arguments (decode_step.c, greedy_step.c, split_step.c define them; the
   ctypes Structures of `vx.gpu.cpu.fused_step` mirror them field by field). */
typedef struct vx_layer vx_layer;
typedef struct vx_step vx_step;
typedef struct vx_greedy_tail vx_greedy_tail;
typedef struct vx_screen_head vx_screen_head;

/* parallel.c */
int vx_bind_threads(const int* cpus, int n);
void vx_set_work_stealing(int mode);

/* decode_attention.c: the portable decode attention, the AVX512-BF16 one, and the KV write */
int vx_decode_attention_f32(const float* q, int64_t q_st, int64_t q_sh, float* out, int64_t o_st, int64_t o_sh, const float* kc, const float* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss, const int32_t* bt, int64_t bt_s, const int32_t* lens, int B, int Hq, int Hkv, int D, int BS, float scale, int max_len, int window, float softcap);
int vx_decode_attention_bf16(const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh, const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss, const int32_t* bt, int64_t bt_s, const int32_t* lens, int B, int Hq, int Hkv, int D, int BS, float scale, int max_len, int window, float softcap);
int vx_decode_attention_bf16_fast(const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh, const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss, const int32_t* bt, int64_t bt_s, const int32_t* lens, int B, int Hq, int Hkv, int D, int BS, float scale, int max_len, int window, float softcap);
int vx_fast_amx(int enable);
int vx_has_fast_bf16(void);
void vx_write_kv(const char* k, int64_t k_st, int64_t k_sh, const char* v, int64_t v_st, int64_t v_sh, char* kc, char* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss, int64_t row_bytes, const int64_t* slots, int T, int Hkv, int BS, int64_t num_slots);

/* eltwise.c */
void vx_add_rms_norm_bf16(const vx_bf16* x, int64_t x_st, const vx_bf16* residual, vx_bf16* r_out, const vx_bf16* w, vx_bf16* out, int64_t T, int64_t H, float eps);
void vx_silu_and_mul_bf16(const vx_bf16* gu, int64_t gu_st, vx_bf16* out, int64_t T, int64_t I);
int vx_silu_simd(void);
void vx_rotary_bf16(vx_bf16* x, int64_t x_st, int64_t T, int64_t nh, int64_t D, const vx_bf16* cos, const vx_bf16* sin);
void vx_rotary_part_bf16(vx_bf16* x, int64_t x_st, int64_t T, int64_t nh, int64_t D, int64_t R, const vx_bf16* cos, const vx_bf16* sin);
void vx_gemma_rms_norm_bf16(const vx_bf16* x, int64_t x_st, const vx_bf16* residual, vx_bf16* r_out, const vx_bf16* w, vx_bf16* out, int64_t T, int64_t H, float eps);
void vx_head_rms_norm_bf16(vx_bf16* x, int64_t x_st, int64_t T, int64_t nh, int64_t D, const vx_bf16* w, float eps, int gemma);
void vx_gelu_tanh_and_mul_bf16(const vx_bf16* gu, int64_t gu_st, vx_bf16* out, int64_t T, int64_t I);

/* moe.c: the MoE glue */
int vx_moe_group_bf16(const vx_bf16* x, int64_t x_st, const int64_t* ids, int64_t T, int64_t k, int64_t E, int64_t H, int64_t* counts, int64_t* pos, vx_bf16* xs);
void vx_moe_combine_bf16(const vx_bf16* ys, const int64_t* pos, const void* w, int32_t w_f32, int64_t T, int64_t k, int64_t H, vx_bf16* out);
void vx_moe_topk_bf16(const vx_bf16* logits, int64_t l_st, int64_t T, int64_t E, int64_t k, int32_t renorm, int32_t w_f32, void* w, int64_t* ids);

/* gemv.c: the skinny GEMMs on AVX-512, the AMX GEMM on plain weights */
int vx_has_gemv(void);
int vx_gemv_bf16_max_rows(void);
int vx_gemv_int8(const vx_bf16* x, int64_t x_st, int M, const int8_t* W, const vx_bf16* scale, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);
int vx_gemv_bf16(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W, const vx_bf16* scale, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);
int vx_gemm_amx_bf16(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);
int vx_argmax_amx_bf16(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W, int64_t N, int64_t K, int64_t* out);

/* gemm_vnni.c */
int vx_has_gemm_vnni(void);
int vx_pack_vnni_bf16(const vx_bf16* w, int64_t N, int64_t K, uint32_t* wp);
int vx_gemm_vnni_bf16(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);
int vx_argmax_vnni_bf16(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp, int64_t N, int64_t K, int64_t* out);
int vx_vnni_small_loop(int n);

/* gemm_amx_vnni.c */
int vx_has_gemm_amx_vnni(void);
int vx_amx_vnni_rows(int which);
int vx_gemm_amx_vnni(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);
int vx_gemm_amx_vnni_silu(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t I, int64_t K);
int vx_gemm_amx_vnni_rope(const vx_bf16* x, int64_t x_st, int M, const uint32_t* wp, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K, const vx_bf16* rcos, const vx_bf16* rsin, int64_t rope_n, int D);

/* experts_amx.c: a MoE layer's expert GEMMs on AMX, one call */
int vx_moe_experts_amx(const vx_bf16* xs, const int64_t* counts, int64_t E, const uint32_t* const* w13, const uint32_t* const* w2, int64_t H, int64_t I, vx_bf16* act, vx_bf16* ys);
/* experts_vnni.c: the same on AVX512-BF16 without AMX (the SiLU-mul between, in gu's rows) */
int vx_moe_experts_vnni(const vx_bf16* xs, const int64_t* counts, int64_t E, const uint32_t* const* w13, const uint32_t* const* w2, int64_t H, int64_t I, vx_bf16* gu, vx_bf16* act, vx_bf16* ys);

/* gemv_avx2.c */
int vx_gemv_avx2_max_rows(void);
int vx_gemv_bf16_avx2(const vx_bf16* x, int64_t x_st, int M, const vx_bf16* W, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);
int vx_gemv_int8_avx2(const vx_bf16* x, int64_t x_st, int M, const int8_t* Q, const vx_bf16* scale, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);
int vx_gemv_int4_avx2(const vx_bf16* x, int64_t x_st, int M, const uint8_t* Q, const float* S, const float* Z, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);

/* gemv_compact_avx2.c */
int vx_compact_max_rows(void);
int vx_gemv_compact_avx2(const vx_bf16* x, int64_t x_st, int M, const uint8_t* W, const uint8_t* Hb, const vx_bf16* raw, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);

/* gemm_avx2.c */
int vx_has_gemm_panels_avx2(void);
int vx_panel_small_loop(int on);
int vx_gemm_panels_avx2(const vx_bf16* x, int64_t x_st, int M, const uint32_t* P, const vx_bf16* bias, vx_bf16* y, int64_t y_st, int64_t N, int64_t K);

/* gemm_f32.c */
int vx_has_gemm_f32_panels(void);
int vx_gemm_f32_panels(const float* x, int64_t x_st, int M, const float* P, const float* bias, float* y, int64_t y_st, int64_t N, int64_t K);

/* screen.c */
int vx_has_screen(void);
int vx_screen_i8(const vx_bf16* x, int64_t x_st, int M, const int8_t* W, const float* s, float* y, int64_t N, int64_t K);
int vx_screen_i8_avx2(const vx_bf16* x, int64_t x_st, int M, const int8_t* Q, const float* s, float* y, int64_t N, int64_t K);
int64_t vx_screen_select(const float* a, int M, int64_t N, const double* bound, const vx_bf16* x, int64_t x_st, int64_t K, int64_t* idx, uint8_t* cand, int64_t max_union);

/* decode_attention_avx2.c */
int vx_has_avx2_attention(void);
int vx_decode_attention_bf16_avx2(const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh, const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss, const int32_t* bt, int64_t bt_s, const int32_t* lens, int B, int Hq, int Hkv, int D, int BS, float scale, int max_len, int window, float softcap);

/* prefill_avx2.c, prefill_amx.c, prefill_avx512.c, prefill_dispatch.c */
int vx_has_prefill_attention(void);
int vx_prefill_attention_bf16(const vx_bf16* q, int64_t q_st, int64_t q_sh, vx_bf16* out, int64_t o_st, int64_t o_sh, const vx_bf16* kc, const vx_bf16* vc, int64_t c_sh, int64_t c_sb, int64_t c_ss, const int32_t* bt, int64_t bt_s, const int32_t* starts, const int32_t* lens, const int32_t* computed, int nchunks, int Hq, int Hkv, int D, int BS, float scale, int window, float softcap);

/* decode_step.c, split_step.c, greedy_step.c: the fused step */
int vx_has_decode_step(void);
int vx_llama_decode_bf16(const vx_layer* layers, int n_layers, const vx_step* s);
int vx_llama_decode_split(const vx_layer* layers, int n_layers, const vx_step* s, int parts, const vx_greedy_tail* g);
int vx_llama_greedy_whole(const vx_layer* layers, int n_layers, const vx_step* s, const vx_greedy_tail* g, const vx_screen_head* sh);
void vx_split_cut(const int32_t* lens, int64_t T, int parts, int64_t* cut);
void vx_split_set_speeds(const double* v, int n);
void vx_set_split_adapt(int on);
void vx_set_split_steal(int on);
int vx_split_handovers(void);

#endif  /* VX_KERNELS_H */
