/* The <immintrin.h> of the emulated build (VX_CPU_EMULATE=1, `vx.gpu.cpu.emulate`): SIMDe's
   AVX-512 in portable C, then what SIMDe lacks (bf16 conversions, scatter, masked gather and
   store), then the AMX tile instructions, lane by lane after Intel's pseudocode.

   Invariants: it shadows the compiler's header through the include path only (no kernel file
   changes for it); SIMDe never includes the real header (SIMDE_NO_NATIVE); tile state is per
   thread, as on the hardware (each OpenMP thread configures its own). */
#ifndef VX_EMU_IMMINTRIN
#define VX_EMU_IMMINTRIN
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <string.h>
#include <stdint.h>
#include <unistd.h>
#include <sys/syscall.h>
/* the one syscall of the kernels asks Linux for the AMX tile state: granted (nothing to ask) */
#define syscall(...) 0L
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
typedef uint8_t __mmask8;
/* VCVTNEPS2BF16: round to nearest even, NaN quietened, denormals to a signed zero */
static inline uint16_t vxe_bf16_rne(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline __m512i vxe_mm512_cvtepi8_epi32(__m128i a) {
    int8_t s[16]; int32_t d[16]; __m512i r;
    memcpy(s, &a, 16); for (int i = 0; i < 16; i++) d[i] = s[i];
    memcpy(&r, d, 64); return r;
}
#define _mm512_cvtepi8_epi32 vxe_mm512_cvtepi8_epi32
static inline __m512bh vxe_mm512_cvtne2ps_pbh(__m512 a, __m512 b) {
    float fa[16], fb[16]; uint16_t d[32]; __m512bh r;
    memcpy(fa, &a, 64); memcpy(fb, &b, 64);
    for (int i = 0; i < 16; i++) { d[i] = vxe_bf16_rne(fb[i]); d[16 + i] = vxe_bf16_rne(fa[i]); }
    memcpy(&r, d, 64); return r;
}
#define _mm512_cvtne2ps_pbh vxe_mm512_cvtne2ps_pbh
static inline __m256bh vxe_mm512_cvtneps_pbh(__m512 a) {
    float fa[16]; uint16_t d[16]; __m256bh r;
    memcpy(fa, &a, 64); for (int i = 0; i < 16; i++) d[i] = vxe_bf16_rne(fa[i]);
    memcpy(&r, d, 32); return r;
}
#define _mm512_cvtneps_pbh vxe_mm512_cvtneps_pbh
static inline __m512 vxe_mm512_cvtpbh_ps(__m256bh a) {
    uint16_t s[16]; uint32_t d[16]; __m512 r;
    memcpy(s, &a, 32); for (int i = 0; i < 16; i++) d[i] = (uint32_t)s[i] << 16;
    memcpy(&r, d, 64); return r;
}
#define _mm512_cvtpbh_ps vxe_mm512_cvtpbh_ps
static inline __m512d vxe_mm512_cvtps_pd(__m256 a) {
    float s[8]; double d[8]; __m512d r;
    memcpy(s, &a, 32); for (int i = 0; i < 8; i++) d[i] = s[i];
    memcpy(&r, d, 64); return r;
}
#define _mm512_cvtps_pd vxe_mm512_cvtps_pd
static inline void vxe_mm512_i32scatter_epi32(void* base, __m512i idx, __m512i v, int scale) {
    int32_t ix[16], vv[16]; memcpy(ix, &idx, 64); memcpy(vv, &v, 64);
    for (int i = 0; i < 16; i++) memcpy((char*)base + (int64_t)ix[i] * scale, &vv[i], 4);
}
#define _mm512_i32scatter_epi32 vxe_mm512_i32scatter_epi32
static inline __m512i vxe_mm512_mask_i32gather_epi32(__m512i src, __mmask16 k, __m512i idx,
                                                     const void* base, int scale) {
    int32_t ix[16], d[16]; memcpy(ix, &idx, 64); memcpy(d, &src, 64);
    for (int i = 0; i < 16; i++)
        if ((k >> i) & 1) memcpy(&d[i], (const char*)base + (int64_t)ix[i] * scale, 4);
    __m512i r; memcpy(&r, d, 64); return r;
}
#define _mm512_mask_i32gather_epi32 vxe_mm512_mask_i32gather_epi32
static inline void vxe_mm512_mask_store_ps(void* p, __mmask16 k, __m512 a) {
    float s[16]; memcpy(s, &a, 64);
    for (int i = 0; i < 16; i++) if ((k >> i) & 1) ((float*)p)[i] = s[i];
}
#define _mm512_mask_store_ps vxe_mm512_mask_store_ps
static inline float vxe_mm512_reduce_add_ps(__m512 a) {
    float s[16]; memcpy(s, &a, 64);  /* the hardware sequence's pairing: halves, then halves */
    for (int w = 8; w >= 1; w /= 2) for (int i = 0; i < w; i++) s[i] += s[i + w];
    return s[0];
}
#define _mm512_reduce_add_ps vxe_mm512_reduce_add_ps
/* AMX: eight tiles of 16 rows x 64 bytes per thread, as the hardware keeps them. */
typedef struct { uint16_t colsb[16]; uint8_t rows[16]; } vxe_tilecfg;
static __thread vxe_tilecfg vxe_cfg;
static __thread uint8_t vxe_tile[8][16][64];
static inline void vxe_tile_loadconfig(const void* p) {
    const uint8_t* c = (const uint8_t*)p;
    memcpy(vxe_cfg.colsb, c + 16, 32); memcpy(vxe_cfg.rows, c + 48, 16);
    memset(vxe_tile, 0, sizeof(vxe_tile));
}
static inline void vxe_tile_loadd(int t, const void* base, long stride) {
    memset(vxe_tile[t], 0, sizeof(vxe_tile[t]));
    for (int r = 0; r < vxe_cfg.rows[t]; r++)
        memcpy(vxe_tile[t][r], (const char*)base + r * stride, vxe_cfg.colsb[t]);
}
static inline void vxe_tile_stored(int t, void* base, long stride) {
    for (int r = 0; r < vxe_cfg.rows[t]; r++)
        memcpy((char*)base + r * stride, vxe_tile[t][r], vxe_cfg.colsb[t]);
}
static inline float vxe_bf(const uint8_t* p) {
    uint16_t h; memcpy(&h, p, 2); uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4);
    return f;
}
/* C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1], in fp32, one rounding per term */
static inline void vxe_tile_dpbf16ps(int c, int a, int b) {
    const int M = vxe_cfg.rows[a], K = vxe_cfg.colsb[a] / 4, N = vxe_cfg.colsb[c] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc; memcpy(&acc, &vxe_tile[c][m][4 * n], 4);
            for (int k = 0; k < K; k++) {
                acc += vxe_bf(&vxe_tile[a][m][4 * k]) * vxe_bf(&vxe_tile[b][k][4 * n]);
                acc += vxe_bf(&vxe_tile[a][m][4 * k + 2]) * vxe_bf(&vxe_tile[b][k][4 * n + 2]);
            }
            memcpy(&vxe_tile[c][m][4 * n], &acc, 4);
        }
}
#define _tile_loadconfig(p) vxe_tile_loadconfig(p)
#define _tile_loadd(t, base, stride) vxe_tile_loadd((t), (base), (stride))
#define _tile_stream_loadd(t, base, stride) vxe_tile_loadd((t), (base), (stride))
#define _tile_stored(t, base, stride) vxe_tile_stored((t), (base), (stride))
#define _tile_zero(t) memset(vxe_tile[t], 0, sizeof(vxe_tile[t]))
#define _tile_dpbf16ps(c, a, b) vxe_tile_dpbf16ps((c), (a), (b))
#define _tile_release() memset(&vxe_cfg, 0, sizeof(vxe_cfg))
#endif
