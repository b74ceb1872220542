/* The aarch64 paths: NEON float kernels (matmuls over the packed panels of
 * gemm.h, attention), the opt-in BFDOT matmul, CPU feature
 * detection, and the tables kernels.c chooses among. Each output is summed
 * in one fixed order, whatever the number of tokens, panels or threads, as
 * on x86: a chain of multiply-adds per block of 32 k, the block sums added
 * in order. The tables are in kernels.c, beside the portable kernels that
 * they use where NEON gains little. */
#include <math.h>
#include <string.h>

#include "simd_arm64.h"

#ifdef FLM_ARM64

#if defined(__linux__)
#include <sys/auxv.h>
#ifndef AT_HWCAP2   /* glibc before 2.18 */
#define AT_HWCAP2 26
#endif
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#define PANEL FLM_PANEL
#define KBLOCK 32
#define TILE_T 4

static int imin(int a, int b) { return a < b ? a : b; }

/* ------------------------------------------------------------ features */

static int detect(void) {
    int f = 0;
#if defined(__linux__)
    /* Linux's hwcap bits (asm/hwcap.h), named here for older headers. */
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    if (hw & (1UL << 20)) f |= FLM_ARM_DOTPROD;   /* HWCAP_ASIMDDP */
    if (hw2 & (1UL << 13)) f |= FLM_ARM_I8MM;     /* HWCAP2_I8MM */
    if (hw2 & (1UL << 14)) f |= FLM_ARM_BF16;     /* HWCAP2_BF16 */
#elif defined(__APPLE__)
    const char *names[3] = {"hw.optional.arm.FEAT_DotProd", "hw.optional.arm.FEAT_I8MM", "hw.optional.arm.FEAT_BF16"};
    for (int i = 0; i < 3; i++) {
        int v = 0;
        size_t n = sizeof v;
        if (sysctlbyname(names[i], &v, &n, NULL, 0) == 0 && v) f |= 1 << i;
    }
#endif
    return f;
}

int flm_arm64_features(void) {
    static int features = -1;
    if (features < 0) features = detect();
    return features;
}

/* ------------------------------------------------------------ matmuls */

/* Add one block's sums of 4 rows into out (the first block stores); only
 * the rows below N. */
ARM_INLINE void flush4(float *out, float32x4_t acc, int rows, int first) {
    if (rows >= 4) {
        vst1q_f32(out, first ? acc : vaddq_f32(vld1q_f32(out), acc));
        return;
    }
    float t[4];
    vst1q_f32(t, acc);
    for (int r = 0; r < rows; r++) out[r] = first ? t[r] : out[r] + t[r];
}

/* bf16 pairs: the low half of each 32-bit lane is k even, the high half k odd. */
ARM_INLINE float32x4_t bf_lo(uint16x8_t v) { return vreinterpretq_f32_u32(vshlq_n_u32(vreinterpretq_u32_u16(v), 16)); }
ARM_INLINE float32x4_t bf_hi(uint16x8_t v) {
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_u16(v), vdupq_n_u32(0xFFFF0000u)));
}

/* One panel (4 vectors of 4 rows) for nt <= TILE_T tokens; bf16 selects the
 * weight format. */
ARM_INLINE void panel_neon(const int bf16, float *out, int ldo, const float *x, int ldx, const void *b, int K,
                           const int nt, int p, int N) {
    const int rows = N - p * PANEL;
    for (int kb = 0; kb < K; kb += KBLOCK) {
        const int kend = imin(K, kb + KBLOCK);
        float32x4_t acc[TILE_T][4];
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < 4; g++) acc[t][g] = vdupq_n_f32(0.0f);
        if (bf16) {
            const uint16_t *w = (const uint16_t *)b;
            for (int k = kb; k < kend; k += 2) {
                uint16x8_t q[4];
                for (int g = 0; g < 4; g++) q[g] = vld1q_u16(w + (size_t)k * PANEL + 8 * g);
                for (int t = 0; t < nt; t++) {
                    const float xe = x[(size_t)t * ldx + k];
                    for (int g = 0; g < 4; g++) acc[t][g] = vfmaq_n_f32(acc[t][g], bf_lo(q[g]), xe);
                }
                if (k + 1 < K)
                    for (int t = 0; t < nt; t++) {
                        const float xo = x[(size_t)t * ldx + k + 1];
                        for (int g = 0; g < 4; g++) acc[t][g] = vfmaq_n_f32(acc[t][g], bf_hi(q[g]), xo);
                    }
            }
        } else {
            const float *w = (const float *)b;
            for (int k = kb; k < kend; k++) {
                float32x4_t q[4];
                for (int g = 0; g < 4; g++) q[g] = vld1q_f32(w + (size_t)k * PANEL + 4 * g);
                for (int t = 0; t < nt; t++) {
                    const float xk = x[(size_t)t * ldx + k];
                    for (int g = 0; g < 4; g++) acc[t][g] = vfmaq_n_f32(acc[t][g], q[g], xk);
                }
            }
        }
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < 4 && rows > 4 * g; g++) flush4(out + (size_t)t * ldo + 4 * g, acc[t][g], rows - 4 * g, kb == 0);
    }
}

static void gemm_neon(const int bf16, float *out, int ldo, const float *x, int ldx, const void *wp, int K, int T,
                      int p0, int np, int N) {
    const size_t ps = bf16 ? (size_t)(K + 1) / 2 * 2 * PANEL : (size_t)K * PANEL;
    for (int t = 0; t < T; t += TILE_T)
        for (int p = p0; p < p0 + np; p++) {
            const void *b = bf16 ? (const void *)((const uint16_t *)wp + p * ps) : (const void *)((const float *)wp + p * ps);
            float *o = out + (size_t)t * ldo + p * PANEL;
            const float *xt = x + (size_t)t * ldx;
            switch (imin(TILE_T, T - t)) {   /* the tile height a constant in each copy */
            case 4: panel_neon(bf16, o, ldo, xt, ldx, b, K, 4, p, N); break;
            case 3: panel_neon(bf16, o, ldo, xt, ldx, b, K, 3, p, N); break;
            case 2: panel_neon(bf16, o, ldo, xt, ldx, b, K, 2, p, N); break;
            default: panel_neon(bf16, o, ldo, xt, ldx, b, K, 1, p, N); break;
            }
        }
}

void flm_gemm_f32_neon(float *out, int ldo, const float *x, int ldx, const void *wp, int K, int T, int p0, int np,
                          int N) {
    gemm_neon(0, out, ldo, x, ldx, wp, K, T, p0, np, N);
}

void flm_gemm_bf16_neon(float *out, int ldo, const float *x, int ldx, const void *wp, int K, int T, int p0, int np,
                           int N) {
    gemm_neon(1, out, ldo, x, ldx, wp, K, T, p0, np, N);
}

/* ---- BFDOT: x arrives as bf16 pairs (ldx counted in pairs); one BFDOT
 * adds both products of a k pair to each of 4 rows, so a panel's pair
 * layout ([k/2][16 rows][2]) is read as it is. Blocks of 16 pairs, as the
 * other paths' blocks of 32 k. */
ARM_INLINE ARMBF16 void panel_bfdot(float *out, int ldo, const uint32_t *x, int ldx, const uint16_t *w, int pairs,
                                    const int nt, int p, int N) {
    const int rows = N - p * PANEL;
    for (int jb = 0; jb < pairs; jb += KBLOCK / 2) {
        float32x4_t acc[TILE_T][4];
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < 4; g++) acc[t][g] = vdupq_n_f32(0.0f);
        for (int j = jb; j < imin(pairs, jb + KBLOCK / 2); j++) {
            bfloat16x8_t q[4];
            for (int g = 0; g < 4; g++) q[g] = vreinterpretq_bf16_u16(vld1q_u16(w + (size_t)j * 2 * PANEL + 8 * g));
            for (int t = 0; t < nt; t++) {
                const bfloat16x8_t xv = vreinterpretq_bf16_u32(vdupq_n_u32(x[(size_t)t * ldx + j]));
                for (int g = 0; g < 4; g++) acc[t][g] = vbfdotq_f32(acc[t][g], q[g], xv);
            }
        }
        for (int t = 0; t < nt; t++)
            for (int g = 0; g < 4 && rows > 4 * g; g++) flush4(out + (size_t)t * ldo + 4 * g, acc[t][g], rows - 4 * g, jb == 0);
    }
}

ARMBF16 void flm_gemm_bf16_bfdot(float *out, int ldo, const float *xf, int ldx, const void *wp, int K, int T,
                                    int p0, int np, int N) {
    const uint32_t *x = (const uint32_t *)xf;
    const int pairs = (K + 1) / 2;
    const size_t ps = (size_t)pairs * 2 * PANEL;
    for (int t = 0; t < T; t += TILE_T)
        for (int p = p0; p < p0 + np; p++) {
            const uint16_t *b = (const uint16_t *)wp + p * ps;
            float *o = out + (size_t)t * ldo + p * PANEL;
            const uint32_t *xt = x + (size_t)t * ldx;
            switch (imin(TILE_T, T - t)) {
            case 4: panel_bfdot(o, ldo, xt, ldx, b, pairs, 4, p, N); break;
            case 3: panel_bfdot(o, ldo, xt, ldx, b, pairs, 3, p, N); break;
            case 2: panel_bfdot(o, ldo, xt, ldx, b, pairs, 2, p, N); break;
            default: panel_bfdot(o, ldo, xt, ldx, b, pairs, 1, p, N); break;
            }
        }
}

/* n floats to bf16, nearest-even (as flm_f32_to_bf16), zero-padded to even n. */
void flm_to_bf16_neon(uint16_t *dst, const float *src, int n) {
    for (int i = 0; i < n; i++) dst[i] = flm_f32_to_bf16(src[i]);
    if (n & 1) dst[n] = 0;
}

/* ---------------------------------------------------------- attention */

/* 4 values of a KV cache array stored as kv, from element i. */
ARM_INLINE float32x4_t kv_load4(const void *p, size_t i, const int kv) {
    if (kv == FLM_F32) return vld1q_f32((const float *)p + i);
    const uint16x4_t h = vld1_u16((const uint16_t *)p + i);
    if (kv == FLM_BF16) return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

ARM_INLINE void key_scores_kv(float *att, const float *q, const void *kb, int n, int hd, const int kv) {
    for (int b = 0; b < n; b += 16) {
        const size_t blk = (size_t)b * hd;
        float32x4_t a[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
        for (int d = 0; d < hd; d++)
            for (int g = 0; g < 4; g++) a[g] = vfmaq_n_f32(a[g], kv_load4(kb, blk + (size_t)d * 16 + 4 * g, kv), q[d]);
        for (int g = 0; g < 4; g++) vst1q_f32(att + b + 4 * g, a[g]);
    }
}

ARM_INLINE void weighted_sum_kv(float *out, const float *p, const void *v, int n, size_t ldv, int dim, const int kv) {
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
        float32x4_t a[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
        for (int j = 0; j < n; j++)
            for (int g = 0; g < 4; g++) a[g] = vfmaq_n_f32(a[g], kv_load4(v, (size_t)j * ldv + d + 4 * g, kv), p[j]);
        for (int g = 0; g < 4; g++) vst1q_f32(out + d + 4 * g, a[g]);
    }
    for (; d < dim; d++) {
        float a = 0.0f;
        for (int j = 0; j < n; j++) a = fmaf(p[j], flm_kv_at(v, (size_t)j * ldv + d, kv), a);
        out[d] = a;
    }
}

/* One copy of each loop per storage type. */
void flm_key_scores_neon(float *att, const float *q, const void *kb, int n, int hd, int kv) {
    if (kv == FLM_F32) key_scores_kv(att, q, kb, n, hd, FLM_F32);
    else if (kv == FLM_BF16) key_scores_kv(att, q, kb, n, hd, FLM_BF16);
    else key_scores_kv(att, q, kb, n, hd, FLM_F16);
}

void flm_weighted_sum_neon(float *out, const float *p, const void *v, int n, size_t ldv, int dim, int kv) {
    if (kv == FLM_F32) weighted_sum_kv(out, p, v, n, ldv, dim, FLM_F32);
    else if (kv == FLM_BF16) weighted_sum_kv(out, p, v, n, ldv, dim, FLM_BF16);
    else weighted_sum_kv(out, p, v, n, ldv, dim, FLM_F16);
}

void flm_scale_neon(float *x, int n, float s) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(x + i, vmulq_n_f32(vld1q_f32(x + i), s));
    for (; i < n; i++) x[i] *= s;
}

#endif
