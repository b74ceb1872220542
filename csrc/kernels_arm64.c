/* The aarch64 paths: NEON float kernels (matmuls over the packed panels of
 * gemm.h, attention, softmax, the delta rule, the conv and the elementwise
 * kernels), the opt-in BFDOT matmul, and CPU feature detection. Each output
 * is summed in one fixed order, whatever the number of tokens, panels or
 * threads, as on x86: a chain of multiply-adds per block of 32 k, the
 * block sums added in order. Then the paths' tables, which keep the
 * portable RMSNorm, and their CPU checks (kernels.c chooses among them). */
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

/* 4 floats to bf16 as flm_f32_to_bf16 rounds them: nearest-even by adding
 * 0x7FFF plus the kept half's lowest bit, a NaN kept NaN by setting its
 * quiet bit instead. */
ARM_INLINE uint16x4_t bf16_round4(float32x4_t f) {
    const uint32x4_t u = vreinterpretq_u32_f32(f);
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7FFFFFFFu)), vdupq_n_u32(0x7F800000u));
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vaddq_u32(u, vaddq_u32(odd, vdupq_n_u32(0x7FFF)));
    return vshrn_n_u32(vbslq_u32(nan, vorrq_u32(u, vdupq_n_u32(0x00400000u)), rounded), 16);
}

/* n floats to bf16, nearest-even (as flm_f32_to_bf16), zero-padded to even n. */
void flm_to_bf16_neon(uint16_t *dst, const float *src, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        vst1q_u16(dst + i, vcombine_u16(bf16_round4(vld1q_f32(src + i)), bf16_round4(vld1q_f32(src + i + 4))));
    for (; i < n; i++) dst[i] = flm_f32_to_bf16(src[i]);
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

/* Q queries (1 to 4) against every block of 16 keys, each key vector
 * loaded once for all of them. */
ARM_INLINE void key_scores_q(float *att, size_t lda, const float *const *q, const int Q, const void *kb, int n,
                             int hd, const int kv) {
    for (int b = 0; b < n; b += 16) {
        const size_t blk = (size_t)b * hd;
        float32x4_t a[4][4];
        for (int i = 0; i < Q; i++)
            for (int g = 0; g < 4; g++) a[i][g] = vdupq_n_f32(0.0f);
        for (int d = 0; d < hd; d++)
            for (int g = 0; g < 4; g++) {
                const float32x4_t k = kv_load4(kb, blk + (size_t)d * 16 + 4 * g, kv);
                for (int i = 0; i < Q; i++) a[i][g] = vfmaq_n_f32(a[i][g], k, q[i][d]);
            }
        for (int i = 0; i < Q; i++)
            for (int g = 0; g < 4; g++) vst1q_f32(att + i * lda + b + 4 * g, a[i][g]);
    }
}

/* Q queries' (1 to 4) weighted sums over the same values, 16 dims at a
 * time, each value vector loaded once for all of them (the dims past the
 * last 16 one by one, as fmaf sums them). */
ARM_INLINE void weighted_sum_q(float *out, size_t ldo, const float *p, size_t ldp, const int Q, const void *v, int n,
                               size_t ldv, int dim, const int kv) {
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
        float32x4_t a[4][4];
        for (int i = 0; i < Q; i++)
            for (int g = 0; g < 4; g++) a[i][g] = vld1q_f32(out + i * ldo + d + 4 * g);
        for (int j = 0; j < n; j++)
            for (int g = 0; g < 4; g++) {
                const float32x4_t x = kv_load4(v, (size_t)j * ldv + d + 4 * g, kv);
                for (int i = 0; i < Q; i++) a[i][g] = vfmaq_n_f32(a[i][g], x, p[i * ldp + j]);
            }
        for (int i = 0; i < Q; i++)
            for (int g = 0; g < 4; g++) vst1q_f32(out + i * ldo + d + 4 * g, a[i][g]);
    }
    for (; d < dim; d++)
        for (int i = 0; i < Q; i++) {
            float a = out[i * ldo + d];
            for (int j = 0; j < n; j++) a = fmaf(p[i * ldp + j], flm_kv_at(v, (size_t)j * ldv + d, kv), a);
            out[i * ldo + d] = a;
        }
}

/* 64 keys (values) at a time for every query, so that they stay in L1
 * while all the queries read them (each sum goes on from where the last
 * part left it). */
ARM_INLINE void key_scores_kv(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n, int hd,
                              const int kv) {
    for (int b = 0; b < n; b += 64) {
        const int m = imin(n - b, 64);
        const void *k = (const char *)kb + (size_t)b * hd * (kv == FLM_F32 ? 4 : 2);
        float *a = att + b;
        int i = 0;
        for (; i + 4 <= nq; i += 4) key_scores_q(a + i * lda, lda, q + i, 4, k, m, hd, kv);
        if (nq - i == 3) key_scores_q(a + i * lda, lda, q + i, 3, k, m, hd, kv);
        if (nq - i == 2) key_scores_q(a + i * lda, lda, q + i, 2, k, m, hd, kv);
        if (nq - i == 1) key_scores_q(a + i * lda, lda, q + i, 1, k, m, hd, kv);
    }
}

ARM_INLINE void weighted_sum_kv(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v, int n,
                                size_t ldv, int dim, const int kv) {
    for (int j = 0; j < n; j += 64) {
        const int m = imin(n - j, 64);
        const void *vj = (const char *)v + j * ldv * (kv == FLM_F32 ? 4 : 2);
        int i = 0;
        for (; i + 4 <= nq; i += 4) weighted_sum_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 4, vj, m, ldv, dim, kv);
        if (nq - i == 3) weighted_sum_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 3, vj, m, ldv, dim, kv);
        if (nq - i == 2) weighted_sum_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 2, vj, m, ldv, dim, kv);
        if (nq - i == 1) weighted_sum_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 1, vj, m, ldv, dim, kv);
    }
}

/* One copy of each loop per storage type (KV_DISPATCH: kernels.h). */
void flm_key_scores_neon(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n, int hd,
                         int kv) {
    if (kv == FLM_Q8_0) {
        flm_key_scores_q8(att, lda, q, nq, kb, n, hd);
        return;
    }
#define CALL(t) key_scores_kv(att, lda, q, nq, kb, n, hd, t)
    KV_DISPATCH(CALL, kv);
#undef CALL
}

void flm_weighted_sum_neon(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v, int n,
                           size_t ldv, int dim, int kv) {
    if (kv == FLM_Q8_0) {
        flm_weighted_sum_q8(out, ldo, p, ldp, nq, v, n, ldv, dim);
        return;
    }
#define CALL(t) weighted_sum_kv(out, ldo, p, ldp, nq, v, n, ldv, dim, t)
    KV_DISPATCH(CALL, kv);
#undef CALL
}

void flm_scale_neon(float *x, int n, float s) {
    int i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(x + i, vmulq_n_f32(vld1q_f32(x + i), s));
    for (; i < n; i++) x[i] *= s;
}

/* ------------------------------------------------- softmax, elementwise */

/* Lanes i < m of 4 (all of them when m >= 4), as a mask. */
ARM_INLINE uint32x4_t lanes_below(int m) {
    static const uint32_t lane[4] = {0, 1, 2, 3};
    return vcltq_u32(vld1q_u32(lane), vdupq_n_u32((uint32_t)imin(m, 4)));
}

/* The first m of 4 floats at p (all 4 when m >= 4), the other lanes 0, as
 * AVX-512's masked loads (store4, simd_arm64.h, the masked stores): a tail
 * is computed as the whole vectors are, so each value's result does not
 * depend on where a call's range ends. */
ARM_INLINE float32x4_t load4(const float *p, int m) {
    if (m >= 4) return vld1q_f32(p);
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    memcpy(t, p, sizeof(float) * m);
    return vld1q_f32(t);
}

/* 2^n for whole n in [-75, 64]: n + 127 in the exponent bits. */
ARM_INLINE float32x4_t pow2(int32x4_t n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n, vdupq_n_s32(127)), 23));
}

/* exp(x) as exp16 (kernels_x86.c) computes it: 2^n * p(r), x = n*ln2 + r,
 * |r| <= ln2/2, a degree-6 polynomial for exp(r); about 1 ulp, exactly 0
 * below -104, inf above 89, NaN kept. Unlike exp16 it keeps the subnormals
 * between -104 and EXP_LOWEST (ARM cores compute them in hardware; their
 * cost was not measured here). 2^n is applied in two halves, each a normal
 * float: p times the first is exact, so a result below FLT_MIN is rounded
 * once, as scalef rounds it. */
ARM_INLINE float32x4_t exp4(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-104.0f)), vdupq_n_f32(89.0f));
    const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));   /* x - n*ln2, ln2 in two parts */
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    const int32x4_t ni = vcvtq_s32_f32(n), half = vshrq_n_s32(ni, 1);   /* n in [-150, 128] */
    return vmulq_f32(vmulq_f32(p, pow2(half)), pow2(vsubq_s32(ni, half)));
}

/* tanh(x) as tanh16 (kernels.c): kernels.h's polynomial below TANH_SMALL,
 * 1 - 2 / (exp(2|x|) + 1) with x's sign above. NaN stays NaN through both
 * (exp4 keeps it), so it needs no select of its own, as tanh16 does. */
ARM_INLINE float32x4_t tanh4(float32x4_t x) {
    const float32x4_t one = vdupq_n_f32(1.0f), a = vabsq_f32(x), z = vmulq_f32(x, x);
    float32x4_t p = vfmaq_f32(vdupq_n_f32(TANH_P3), vdupq_n_f32(TANH_P4), z);
    p = vfmaq_f32(vdupq_n_f32(TANH_P2), p, z);
    p = vfmaq_f32(vdupq_n_f32(TANH_P1), p, z);
    p = vfmaq_f32(vdupq_n_f32(TANH_P0), p, z);
    const float32x4_t small = vfmaq_f32(x, vmulq_f32(p, z), x);
    const float32x4_t e = exp4(vaddq_f32(a, a));
    float32x4_t large = vsubq_f32(one, vdivq_f32(vdupq_n_f32(2.0f), vaddq_f32(e, one)));
    large = vbslq_f32(vdupq_n_u32(0x80000000u), x, large);   /* x's sign */
    return vbslq_f32(vcltq_f32(a, vdupq_n_f32(TANH_SMALL)), small, large);
}

/* x / (1 + exp(-x)) */
ARM_INLINE float32x4_t silu4(float32x4_t x) {
    return vdivq_f32(x, vaddq_f32(vdupq_n_f32(1.0f), exp4(vnegq_f32(x))));
}

float flm_exp_sum_neon(float *x, int n, float max) {
    const float32x4_t mx = vdupq_n_f32(max);
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int i = 0; i < n; i += 4) {
        const float32x4_t e = exp4(vsubq_f32(load4(x + i, n - i), mx));
        store4(x + i, e, n - i);
        acc = vbslq_f32(lanes_below(n - i), vaddq_f32(acc, e), acc);
    }
    return vaddvq_f32(acc);
}

/* x[i] = x[i] * s, or with capped s * tanh(x[i] / s), for i < n; returns
 * the largest new x, NaN ignored as the scalar loop's `x > max` ignores it
 * (FMAXNM returns the number). */
ARM_INLINE float map_max(float *x, int n, float s, const int capped) {
    float32x4_t mx = vdupq_n_f32(-INFINITY);
    for (int i = 0; i < n; i += 4) {
        const float32x4_t in = load4(x + i, n - i);
        const float32x4_t v = vmulq_n_f32(capped ? tanh4(vdivq_f32(in, vdupq_n_f32(s))) : in, s);
        store4(x + i, v, n - i);
        mx = vbslq_f32(lanes_below(n - i), vmaxnmq_f32(mx, v), mx);
    }
    return vmaxnmvq_f32(mx);
}

float flm_scale_max_neon(float *x, int n, float s) { return map_max(x, n, s, 0); }

float flm_softcap_max_neon(float *x, int n, float cap) { return map_max(x, n, cap, 1); }

void flm_silu_mul_neon(float *g, const float *u, int n) {
    for (int i = 0; i < n; i += 4)
        store4(g + i, vmulq_f32(silu4(load4(g + i, n - i)), load4(u + i, n - i)), n - i);
}

/* The terms in the generic loop's order (GELU_BETA, GELU_KAPPA: kernels.h). */
void flm_gelu_tanh_mul_neon(float *g, const float *u, int n) {
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (int i = 0; i < n; i += 4) {
        const float32x4_t x = load4(g + i, n - i);
        const float32x4_t cube = vmulq_f32(vmulq_f32(x, x), x);
        const float32x4_t inner = vmulq_n_f32(vaddq_f32(x, vmulq_n_f32(cube, GELU_KAPPA)), GELU_BETA);
        const float32x4_t y = vmulq_f32(vmulq_n_f32(x, 0.5f), vaddq_f32(one, tanh4(inner)));
        store4(g + i, vmulq_f32(y, load4(u + i, n - i)), n - i);
    }
}

/* Columns j .. j + 4*nu - 1 of S (nu vectors of 4): each column summed
 * over i in order, as the generic kernel sums it, the nu chains side by
 * side. The decayed state is recomputed in the second pass rather than
 * stored by the first: the same product, one store less. */
ARM_INLINE void delta_cols(float *S, const float *q, const float *k, const float *v, float beta, float decay, int dk,
                           int dv, float *o, int j, const int nu) {
    float32x4_t kv[8], d[8], acc[8];
    for (int u = 0; u < nu; u++) kv[u] = acc[u] = vdupq_n_f32(0.0f);
    for (int i = 0; i < dk; i++) {
        const float *Si = S + (size_t)i * dv + j;
        for (int u = 0; u < nu; u++) kv[u] = vfmaq_n_f32(kv[u], vmulq_n_f32(vld1q_f32(Si + 4 * u), decay), k[i]);
    }
    for (int u = 0; u < nu; u++) d[u] = vmulq_n_f32(vsubq_f32(vld1q_f32(v + j + 4 * u), kv[u]), beta);
    for (int i = 0; i < dk; i++) {
        float *Si = S + (size_t)i * dv + j;
        for (int u = 0; u < nu; u++) {
            const float32x4_t sv = vfmaq_n_f32(vmulq_n_f32(vld1q_f32(Si + 4 * u), decay), d[u], k[i]);
            vst1q_f32(Si + 4 * u, sv);
            acc[u] = vfmaq_n_f32(acc[u], sv, q[i]);
        }
    }
    for (int u = 0; u < nu; u++) vst1q_f32(o + j + 4 * u, acc[u]);
}

/* One column, as one lane of delta_cols computes it (fmaf is one lane of
 * vfmaq). */
static void delta_col(float *S, const float *q, const float *k, const float *v, float beta, float decay, int dk,
                      int dv, float *o, int j) {
    float kv = 0.0f, acc = 0.0f;
    for (int i = 0; i < dk; i++) kv = fmaf(S[(size_t)i * dv + j] * decay, k[i], kv);
    const float d = (v[j] - kv) * beta;
    for (int i = 0; i < dk; i++) {
        float *s = S + (size_t)i * dv + j;
        *s = fmaf(k[i], d, *s * decay);
        acc = fmaf(*s, q[i], acc);
    }
    o[j] = acc;
}

void flm_delta_rule_neon(float *S, const float *q, const float *k, const float *v, float beta, float decay, int dk,
                         int dv, float *o) {
    int j = 0;
    for (; j + 32 <= dv; j += 32) delta_cols(S, q, k, v, beta, decay, dk, dv, o, j, 8);
    for (; j + 4 <= dv; j += 4) delta_cols(S, q, k, v, beta, decay, dk, dv, o, j, 1);
    for (; j < dv; j++) delta_col(S, q, k, v, beta, decay, dk, dv, o, j);
}

/* 4 channels at a time (the last group fewer), the kernel's taps and the
 * window rows in registers; products and sums UNFUSED, in the generic
 * loop's order. */
ARM_INLINE UNFUSED void conv_groups(float *x, size_t ldx, int T, float *win, size_t ldw, const float *w, const int K, int n) {
    for (int c = 0; c < n; c += 4) {
        const int m = n - c;
        float32x4_t wj[CONV_MAX_K], wn[CONV_MAX_K];
        for (int j = 0; j < K; j++) {
            float taps[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int l = 0; l < imin(m, 4); l++) taps[l] = w[(size_t)(c + l) * K + j];
            wj[j] = vld1q_f32(taps);
        }
        for (int j = 0; j < K - 1; j++) wn[j] = load4(win + j * ldw + c, m);
        for (int t = 0; t < T; t++) {
            float *xt = x + (size_t)t * ldx + c;
            const float32x4_t in = load4(xt, m);
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (int j = 0; j < K - 1; j++) acc = vaddq_f32(acc, vmulq_f32(wj[j], wn[j]));
            acc = vaddq_f32(acc, vmulq_f32(wj[K - 1], in));
            for (int j = 0; j + 1 < K - 1; j++) wn[j] = wn[j + 1];
            if (K > 1) wn[K - 2] = in;
            store4(xt, silu4(acc), m);
        }
        for (int j = 0; j < K - 1; j++) store4(win + j * ldw + c, wn[j], m);
    }
}

/* Kernels wider than CONV_MAX_K take the generic loop; Qwen3.5's 4 has a
 * copy of its own, its taps a constant. */
UNFUSED void flm_conv_silu_neon(float *x, size_t ldx, int T, float *win, size_t ldw, const float *w, int K, int n) {
    if (K > CONV_MAX_K) flm_conv_silu_generic(x, ldx, T, win, ldw, w, K, n);
    else if (K == 4) conv_groups(x, ldx, T, win, ldw, w, 4, n);
    else conv_groups(x, ldx, T, win, ldw, w, K, n);
}

/* ------------------------------------------------------------- the paths */

/* The paths differ in their int8 kernels (quant_arm64.c) and in how bf16
 * weights multiply; the float kernels are shared (kernels_arm64.c).
 * RMSNorm stays portable: a NEON sum of squares, rounded differently,
 * moved int8 activations by whole steps (Q6_K beside a Gated DeltaNet
 * layer in test_core.c) for a kernel that costs little anyway. */
#define ARM_FLOAT_KERNELS                                                                               \
    .key_scores = flm_key_scores_neon, .exp_sum = flm_exp_sum_neon, .scale_max = flm_scale_max_neon,    \
    .scale = flm_scale_neon, .weighted_sum = flm_weighted_sum_neon, .delta_rule = flm_delta_rule_neon,  \
    .conv_silu = flm_conv_silu_neon, .rmsnorm = flm_rmsnorm_generic, .silu_mul = flm_silu_mul_neon,         \
    .gelu_tanh_mul = flm_gelu_tanh_mul_neon, .softcap_max = flm_softcap_max_neon, .token_block = 60

static const FlmKernels kernels_neon = {
    .name = "neon",
    .gemm_f32 = flm_gemm_f32_neon,
    .gemm_bf16 = flm_gemm_bf16_neon,
    .to_bf16 = NULL,
    .int8_name = "neon",
    .qgemm = flm_qgemm_neon,
    .quantize_q8 = flm_quantize_q8_neon,
    ARM_FLOAT_KERNELS,
};
static const FlmKernels kernels_dotprod = {
    .name = "dotprod",
    .gemm_f32 = flm_gemm_f32_neon,
    .gemm_bf16 = flm_gemm_bf16_neon,
    .to_bf16 = NULL,
    .int8_name = "dotprod",
    .qgemm = flm_qgemm_dotprod,
    .quantize_q8 = flm_quantize_q8_neon,
    ARM_FLOAT_KERNELS,
};
static const FlmKernels kernels_i8mm = {
    .name = "i8mm",
    .gemm_f32 = flm_gemm_f32_neon,
    .gemm_bf16 = flm_gemm_bf16_neon,
    .to_bf16 = NULL,
    .int8_name = "i8mm",
    .qgemm = flm_qgemm_i8mm,
    .quantize_q8 = flm_quantize_q8_neon,
    ARM_FLOAT_KERNELS,
};
/* BF16 dot products: bf16 weights take bf16 activations, as avx512_bf16.
 * Every CPU with BF16 so far (Armv8.6: Graviton 3, Neoverse V1 and N2,
 * Apple M2) has i8mm too, and the path asks for both. */
static const FlmKernels kernels_neon_bf16 = {
    .name = "neon_bf16",
    .gemm_f32 = flm_gemm_f32_neon,
    .gemm_bf16 = flm_gemm_bf16_bfdot,
    .to_bf16 = flm_to_bf16_neon,
    .int8_name = "i8mm",
    .qgemm = flm_qgemm_i8mm,
    .quantize_q8 = flm_quantize_q8_neon,
    ARM_FLOAT_KERNELS,
};

/* ---- The paths, as kernels.c chooses among them */

const FlmKernels *const flm_arch_paths[] = {&kernels_neon_bf16, &kernels_i8mm, &kernels_dotprod, &kernels_neon, NULL};

int flm_arch_supported(const FlmKernels *k) {
    const int f = flm_arm64_features();
    if (k == &kernels_neon) return 1;
    if (k == &kernels_dotprod) return (f & FLM_ARM_DOTPROD) != 0;
    if (k == &kernels_i8mm) return (f & FLM_ARM_DOTPROD) && (f & FLM_ARM_I8MM);
    if (k == &kernels_neon_bf16) return (f & FLM_ARM_DOTPROD) && (f & FLM_ARM_I8MM) && (f & FLM_ARM_BF16);
    return 0;
}

void flm_arch_adapt(FlmKernels *k) { (void)k; }
/* The NEON kernels leave streams to the hardware prefetcher. */
int flm_arch_set_stream_prefetch(int bytes, int level) { (void)bytes; (void)level; return -1; }
int flm_arch_stream_prefetch(int *bytes, int *level) { (void)bytes; (void)level; return -1; }

#endif
