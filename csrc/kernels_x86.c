/* The x86-64 paths: AVX2+FMA and AVX-512 kernels for attention, softmax,
 * the delta rule, the conv and the elementwise kernels, the paths' tables
 * and CPU feature checks (matmul kernels: gemm.c, int8 ones: quant.c). */
#include "kernels.h"
#include "quant.h"
#include "simd.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------- x86 */
#ifdef FLM_X86
#include <cpuid.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif


/* ---- AVX2: 8 lanes */

/* 8 values of a KV cache array stored as kv, from element i. */
INLINE AVX2 __m256 kv_load8(const void *p, size_t i, int kv) {
    if (kv == FLM_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (kv == FLM_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Q queries (1 to 4) against every block of 16 keys, each key vector
 * loaded once for all of them. */
INLINE AVX2 void key_scores_avx2_q(float *att, size_t lda, const float *const *q, const int Q, const void *kb, int n,
                                   int hd, int kv) {
    for (int b = 0; b < n; b += 16) {
        const size_t blk = (size_t)b * hd;
        __m256 lo[4], hi[4];
        for (int i = 0; i < Q; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d++) {
            const __m256 k0 = kv_load8(kb, blk + d * 16, kv), k1 = kv_load8(kb, blk + d * 16 + 8, kv);
            for (int i = 0; i < Q; i++) {
                const __m256 qd = _mm256_set1_ps(q[i][d]);
                lo[i] = _mm256_fmadd_ps(qd, k0, lo[i]);
                hi[i] = _mm256_fmadd_ps(qd, k1, hi[i]);
            }
        }
        for (int i = 0; i < Q; i++) {
            _mm256_storeu_ps(att + i * lda + b, lo[i]);
            _mm256_storeu_ps(att + i * lda + b + 8, hi[i]);
        }
    }
}

/* Q queries' (1 to 4) weighted sums over the same values, each value
 * vector loaded once for all of them. */
INLINE AVX2 void weighted_sum_avx2_q(float *out, size_t ldo, const float *p, size_t ldp, const int Q, const void *v,
                                     int n, size_t ldv, int dim, int kv) {
    int d = 0;
    for (; d + 16 <= dim; d += 16) {
        __m256 a[4], c[4];
        for (int i = 0; i < Q; i++) {
            a[i] = _mm256_loadu_ps(out + i * ldo + d);
            c[i] = _mm256_loadu_ps(out + i * ldo + d + 8);
        }
        for (int j = 0; j < n; j++) {
            const __m256 v0 = kv_load8(v, j * ldv + d, kv), v1 = kv_load8(v, j * ldv + d + 8, kv);
            for (int i = 0; i < Q; i++) {
                const __m256 pj = _mm256_set1_ps(p[i * ldp + j]);
                a[i] = _mm256_fmadd_ps(pj, v0, a[i]);
                c[i] = _mm256_fmadd_ps(pj, v1, c[i]);
            }
        }
        for (int i = 0; i < Q; i++) {
            _mm256_storeu_ps(out + i * ldo + d, a[i]);
            _mm256_storeu_ps(out + i * ldo + d + 8, c[i]);
        }
    }
    for (; d + 8 <= dim; d += 8) {
        __m256 a[4];
        for (int i = 0; i < Q; i++) a[i] = _mm256_loadu_ps(out + i * ldo + d);
        for (int j = 0; j < n; j++) {
            const __m256 v0 = kv_load8(v, j * ldv + d, kv);
            for (int i = 0; i < Q; i++) a[i] = _mm256_fmadd_ps(_mm256_set1_ps(p[i * ldp + j]), v0, a[i]);
        }
        for (int i = 0; i < Q; i++) _mm256_storeu_ps(out + i * ldo + d, a[i]);
    }
    for (; d < dim; d++)
        for (int i = 0; i < Q; i++) {
            float a = out[i * ldo + d];
            for (int j = 0; j < n; j++) a = __builtin_fmaf(p[i * ldp + j], flm_kv_at(v, j * ldv + d, kv), a);
            out[i * ldo + d] = a;
        }
}

/* 64 keys (values) at a time for every query, so that they stay in L1
 * while all the queries read them (each sum goes on from where the last
 * part left it). */
INLINE AVX2 void key_scores_avx2_kv(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n,
                                    int hd, int kv) {
    for (int b = 0; b < n; b += 64) {
        const int m = n - b < 64 ? n - b : 64;
        const void *k = (const char *)kb + (size_t)b * hd * (kv == FLM_F32 ? 4 : 2);
        float *a = att + b;
        int i = 0;
        for (; i + 4 <= nq; i += 4) key_scores_avx2_q(a + i * lda, lda, q + i, 4, k, m, hd, kv);
        if (nq - i == 3) key_scores_avx2_q(a + i * lda, lda, q + i, 3, k, m, hd, kv);
        if (nq - i == 2) key_scores_avx2_q(a + i * lda, lda, q + i, 2, k, m, hd, kv);
        if (nq - i == 1) key_scores_avx2_q(a + i * lda, lda, q + i, 1, k, m, hd, kv);
    }
}

INLINE AVX2 void weighted_sum_avx2_kv(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v,
                                      int n, size_t ldv, int dim, int kv) {
    for (int j = 0; j < n; j += 64) {
        const int m = n - j < 64 ? n - j : 64;
        const void *vj = (const char *)v + j * ldv * (kv == FLM_F32 ? 4 : 2);
        int i = 0;
        for (; i + 4 <= nq; i += 4) weighted_sum_avx2_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 4, vj, m, ldv, dim, kv);
        if (nq - i == 3) weighted_sum_avx2_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 3, vj, m, ldv, dim, kv);
        if (nq - i == 2) weighted_sum_avx2_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 2, vj, m, ldv, dim, kv);
        if (nq - i == 1) weighted_sum_avx2_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 1, vj, m, ldv, dim, kv);
    }
}

/* The q8_0 cache (flm_key_scores_q8 and flm_weighted_sum_q8 in kernels.h
 * say what is summed in which order): 8 int8 as 8 floats. */
INLINE AVX2 __m256 i8x8_ps(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

INLINE AVX2 void key_scores_q8_avx2_q(float *att, size_t lda, const float *const *q, const int Q, const char *kb,
                                      int n, int hd) {
    for (int b = 0; b < n; b += 16) {
        const int8_t *k = (const int8_t *)(kb + b / 16 * FLM_KV_Q8_BYTES(16 * (size_t)hd));
        const uint16_t *sc = (const uint16_t *)(k + 16 * hd);
        __m256 lo[4], hi[4];
        for (int i = 0; i < Q; i++) lo[i] = hi[i] = _mm256_setzero_ps();
        for (int g = 0; g < hd; g += 32) {
            __m256 plo[4], phi[4];
            for (int i = 0; i < Q; i++) plo[i] = phi[i] = _mm256_setzero_ps();
            for (int d = g; d < g + 32; d++) {
                const __m256 k0 = i8x8_ps(k + d * 16), k1 = i8x8_ps(k + d * 16 + 8);
                for (int i = 0; i < Q; i++) {
                    const __m256 qd = _mm256_set1_ps(q[i][d]);
                    plo[i] = _mm256_fmadd_ps(qd, k0, plo[i]);
                    phi[i] = _mm256_fmadd_ps(qd, k1, phi[i]);
                }
            }
            const uint16_t *s = sc + g / 32 * 16;
            const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
            const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 8)));
            for (int i = 0; i < Q; i++) {
                lo[i] = _mm256_fmadd_ps(plo[i], s0, lo[i]);
                hi[i] = _mm256_fmadd_ps(phi[i], s1, hi[i]);
            }
        }
        for (int i = 0; i < Q; i++) {
            _mm256_storeu_ps(att + i * lda + b, lo[i]);
            _mm256_storeu_ps(att + i * lda + b + 8, hi[i]);
        }
    }
}

INLINE AVX2 void weighted_sum_q8_avx2_q(float *out, size_t ldo, const float *p, size_t ldp, const int Q,
                                        const char *v, int n, size_t ldv, int dim) {
    for (int d = 0; d < dim; d += 16) {   /* dim: a multiple of 32 */
        __m256 a[4], c[4];
        for (int i = 0; i < Q; i++) {
            a[i] = _mm256_loadu_ps(out + i * ldo + d);
            c[i] = _mm256_loadu_ps(out + i * ldo + d + 8);
        }
        for (int j = 0; j < n; j++) {
            const int8_t *r = (const int8_t *)(v + j * FLM_KV_Q8_BYTES(ldv));
            const float s = flm_f16_to_f32(((const uint16_t *)(r + ldv))[d / 32]);
            const __m256 v0 = i8x8_ps(r + d), v1 = i8x8_ps(r + d + 8);
            for (int i = 0; i < Q; i++) {
                const __m256 pj = _mm256_set1_ps(p[i * ldp + j] * s);
                a[i] = _mm256_fmadd_ps(pj, v0, a[i]);
                c[i] = _mm256_fmadd_ps(pj, v1, c[i]);
            }
        }
        for (int i = 0; i < Q; i++) {
            _mm256_storeu_ps(out + i * ldo + d, a[i]);
            _mm256_storeu_ps(out + i * ldo + d + 8, c[i]);
        }
    }
}

/* 64 keys (values) at a time for up to 4 queries, as the 16-bit caches. */
static AVX2 void key_scores_q8_avx2(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n,
                                    int hd) {
    for (int b = 0; b < n; b += 64) {
        const int m = n - b < 64 ? n - b : 64;
        const char *k = (const char *)kb + b / 16 * FLM_KV_Q8_BYTES(16 * (size_t)hd);
        for (int i = 0; i < nq; i += 4)
            key_scores_q8_avx2_q(att + i * lda + b, lda, q + i, nq - i < 4 ? nq - i : 4, k, m, hd);
    }
}

static AVX2 void weighted_sum_q8_avx2(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v,
                                      int n, size_t ldv, int dim) {
    for (int j = 0; j < n; j += 64) {
        const int m = n - j < 64 ? n - j : 64;
        const char *vj = (const char *)v + j * FLM_KV_Q8_BYTES(ldv);
        for (int i = 0; i < nq; i += 4)
            weighted_sum_q8_avx2_q(out + i * ldo, ldo, p + i * ldp + j, ldp, nq - i < 4 ? nq - i : 4, vj, m, ldv,
                                   dim);
    }
}

static AVX2 void key_scores_avx2(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n,
                                 int hd, int kv) {
    if (kv == FLM_Q8_0) {
        key_scores_q8_avx2(att, lda, q, nq, kb, n, hd);
        return;
    }
#define CALL(t) key_scores_avx2_kv(att, lda, q, nq, kb, n, hd, t)
    KV_DISPATCH(CALL, kv);
#undef CALL
}

static AVX2 void weighted_sum_avx2(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v, int n,
                                   size_t ldv, int dim, int kv) {
    if (kv == FLM_Q8_0) {
        weighted_sum_q8_avx2(out, ldo, p, ldp, nq, v, n, ldv, dim);
        return;
    }
#define CALL(t) weighted_sum_avx2_kv(out, ldo, p, ldp, nq, v, n, ldv, dim, t)
    KV_DISPATCH(CALL, kv);
#undef CALL
}

/* exp(x) for x in [-87, 88] (clamped there), as exp16 below computes it:
 * 2^n * p(r), x = n*ln2 + r, 2^n built in the exponent bits. */
INLINE AVX2 __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* tanh (kernels.h's form); NaN stays NaN. */
INLINE AVX2 __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 a = _mm256_andnot_ps(sign, x), z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(TANH_P4), z, _mm256_set1_ps(TANH_P3));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_P2));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_P1));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_P0));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    const __m256 e = exp8(_mm256_add_ps(a, a));
    __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    large = _mm256_or_ps(large, _mm256_and_ps(sign, x));
    __m256 out = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(TANH_SMALL), _CMP_LT_OQ));
    return _mm256_blendv_ps(out, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

static AVX2 void gelu_tanh_mul_avx2(float *g, const float *u, int n) {
    const __m256 beta = _mm256_set1_ps(GELU_BETA), kappa = _mm256_set1_ps(GELU_KAPPA);
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, cube)));
        const __m256 y = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh8(inner)));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
    }
    if (i < n) {   /* the tail through a padded vector, computed as the full ones */
        float x[8] = {0}, v[8] = {0};
        memcpy(x, g + i, sizeof(float) * (n - i));
        memcpy(v, u + i, sizeof(float) * (n - i));
        gelu_tanh_mul_avx2(x, v, 8);
        memcpy(g + i, x, sizeof(float) * (n - i));
    }
}

static AVX2 float softcap_max_avx2(float *x, int n, float cap) {
    const __m256 vc = _mm256_set1_ps(cap);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_mul_ps(tanh8(_mm256_div_ps(_mm256_loadu_ps(x + i), vc)), vc);
        _mm256_storeu_ps(x + i, v);
        mx = _mm256_max_ps(v, mx);   /* a NaN in v keeps mx, as the scalar loop does */
    }
    float lanes[8], max = -INFINITY;
    _mm256_storeu_ps(lanes, mx);
    for (int j = 0; j < 8; j++) max = lanes[j] > max ? lanes[j] : max;
    if (i < n) {
        float t[8] = {0};
        memcpy(t, x + i, sizeof(float) * (n - i));
        softcap_max_avx2(t, 8, cap);
        memcpy(x + i, t, sizeof(float) * (n - i));
        for (int j = 0; j < n - i; j++) max = t[j] > max ? t[j] : max;
    }
    return max;
}

static const FlmKernels kernels_avx2 = {
    .name = "avx2",
    .gemm_f32 = flm_gemm_f32_avx2,
    .gemm_bf16 = flm_gemm_bf16_avx2,
    .to_bf16 = NULL,
    .int8_name = "avx2",
    .qgemm = flm_qgemm_avx2,
    .quantize_q8 = flm_quantize_q8_generic,
    .key_scores = key_scores_avx2,
    .exp_sum = flm_exp_sum_generic,
    .scale_max = flm_scale_max_generic,
    .scale = flm_scale_generic,
    .weighted_sum = weighted_sum_avx2,
    .delta_rule = flm_delta_rule_generic,
    .conv_silu = flm_conv_silu_generic,
    .rmsnorm = flm_rmsnorm_generic,
    .silu_mul = flm_silu_mul_generic,
    .gelu_tanh_mul = gelu_tanh_mul_avx2,
    .softcap_max = softcap_max_avx2,
    .token_block = 60,
};

/* ---- AVX-512: 16 lanes, masked tails */

/* exp(x) as 2^n * p(r), x = n*ln2 + r, |r| <= ln2/2, with a degree-6
 * polynomial for exp(r): about 1 ulp, and exactly 0 below EXP_LOWEST (NaN
 * too; kernels.h says why). The input is clamped there too, so that the
 * zeroed lanes compute no subnormal either. */
INLINE AVX512 __m512 exp16(__m512 x) {
    const __m512 lowest = _mm512_set1_ps(EXP_LOWEST);
    const __mmask16 normal = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lowest);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(normal, p, n);
}

/* 16 values of a KV cache array stored as kv, from element i (lanes
 * outside m read as 0). */
INLINE AVX512 __m512 kv_load16(__mmask16 m, const void *p, size_t i, int kv) {
    if (kv == FLM_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (kv == FLM_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#define KV16(p, i, kv) kv_load16((__mmask16)0xFFFF, p, i, kv)

/* Q queries (1 to 4) against four blocks of 16 keys at a time: each key
 * vector loaded once for all the queries, 4 Q independent chains. */
INLINE AVX512 void key_scores_avx512_q(float *att, size_t lda, const float *const *q, const int Q, const void *kb,
                                       int n, int hd, int kv) {
    int b = 0;
    for (; b + 48 < n; b += 64) {
        const size_t k0 = (size_t)b * hd, k1 = k0 + 16 * hd, k2 = k1 + 16 * hd, k3 = k2 + 16 * hd;
        __m512 a[4][4];
        for (int i = 0; i < Q; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d++) {
            const __m512 w0 = KV16(kb, k0 + d * 16, kv), w1 = KV16(kb, k1 + d * 16, kv);
            const __m512 w2 = KV16(kb, k2 + d * 16, kv), w3 = KV16(kb, k3 + d * 16, kv);
            for (int i = 0; i < Q; i++) {
                const __m512 qd = _mm512_set1_ps(q[i][d]);
                a[i][0] = _mm512_fmadd_ps(qd, w0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(qd, w1, a[i][1]);
                a[i][2] = _mm512_fmadd_ps(qd, w2, a[i][2]);
                a[i][3] = _mm512_fmadd_ps(qd, w3, a[i][3]);
            }
        }
        for (int i = 0; i < Q; i++)
            for (int g = 0; g < 4; g++) _mm512_storeu_ps(att + i * lda + b + 16 * g, a[i][g]);
    }
    for (; b < n; b += 16) {
        const size_t k0 = (size_t)b * hd;
        __m512 a[4];
        for (int i = 0; i < Q; i++) a[i] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d++) {
            const __m512 w0 = KV16(kb, k0 + d * 16, kv);
            for (int i = 0; i < Q; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), w0, a[i]);
        }
        for (int i = 0; i < Q; i++) _mm512_storeu_ps(att + i * lda + b, a[i]);
    }
}

/* 64 keys (values) at a time for every query, so that they stay in L1
 * while all the queries read them (each sum goes on from where the last
 * part left it). */
INLINE AVX512 void key_scores_avx512_kv(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n,
                                        int hd, int kv) {
    for (int b = 0; b < n; b += 64) {
        const int m = n - b < 64 ? n - b : 64;
        const void *k = (const char *)kb + (size_t)b * hd * (kv == FLM_F32 ? 4 : 2);
        float *a = att + b;
        int i = 0;
        for (; i + 4 <= nq; i += 4) key_scores_avx512_q(a + i * lda, lda, q + i, 4, k, m, hd, kv);
        if (nq - i == 3) key_scores_avx512_q(a + i * lda, lda, q + i, 3, k, m, hd, kv);
        if (nq - i == 2) key_scores_avx512_q(a + i * lda, lda, q + i, 2, k, m, hd, kv);
        if (nq - i == 1) key_scores_avx512_q(a + i * lda, lda, q + i, 1, k, m, hd, kv);
    }
}

static AVX512 void key_scores_avx512(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n,
                                     int hd, int kv) {
    if (kv == FLM_Q8_0) {   /* the int8 loads are 8 wide; AVX2's loop reads them as fast */
        key_scores_q8_avx2(att, lda, q, nq, kb, n, hd);
        return;
    }
#define CALL(t) key_scores_avx512_kv(att, lda, q, nq, kb, n, hd, t)
    KV_DISPATCH(CALL, kv);
#undef CALL
}

static AVX512 float scale_max_avx512(float *x, int n, float s) {
    const __m512 vs = _mm512_set1_ps(s);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs);
        _mm512_mask_storeu_ps(x + i, m, v);
        mx = _mm512_mask_max_ps(mx, m, v, mx);   /* a NaN in v keeps mx, as the scalar loop does */
    }
    return _mm512_reduce_max_ps(mx);
}

static AVX512 void scale_avx512(float *x, int n, float s) {
    const __m512 vs = _mm512_set1_ps(s);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
    }
}

static AVX512 float exp_sum_avx512(float *x, int n, float max) {
    __m512 acc = _mm512_setzero_ps(), mx = _mm512_set1_ps(max);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mx));
        _mm512_mask_storeu_ps(x + i, m, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(acc);
}

/* Q queries' (1 to 4) weighted sums over the same values, 64 dims at a
 * time: each value vector loaded once for all the queries. */
INLINE AVX512 void weighted_sum_avx512_q(float *out, size_t ldo, const float *p, size_t ldp, const int Q,
                                         const void *v, int n, size_t ldv, int dim, int kv) {
    for (int d = 0; d < dim; d += 64) {
        __mmask16 m[4];
        for (int g = 0; g < 4; g++) m[g] = tail_mask(dim - d - 16 * g);
        __m512 a[4][4];
        for (int i = 0; i < Q; i++)
            for (int g = 0; g < 4; g++) a[i][g] = _mm512_maskz_loadu_ps(m[g], out + i * ldo + d + 16 * g);
        for (int j = 0; j < n; j++) {
            const size_t vd = j * ldv + d;
            const __m512 v0 = kv_load16(m[0], v, vd, kv), v1 = kv_load16(m[1], v, vd + 16, kv);
            const __m512 v2 = kv_load16(m[2], v, vd + 32, kv), v3 = kv_load16(m[3], v, vd + 48, kv);
            for (int i = 0; i < Q; i++) {
                const __m512 pj = _mm512_set1_ps(p[i * ldp + j]);
                a[i][0] = _mm512_fmadd_ps(pj, v0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(pj, v1, a[i][1]);
                a[i][2] = _mm512_fmadd_ps(pj, v2, a[i][2]);
                a[i][3] = _mm512_fmadd_ps(pj, v3, a[i][3]);
            }
        }
        for (int i = 0; i < Q; i++)
            for (int g = 0; g < 4; g++) _mm512_mask_storeu_ps(out + i * ldo + d + 16 * g, m[g], a[i][g]);
    }
}

INLINE AVX512 void weighted_sum_avx512_kv(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v,
                                          int n, size_t ldv, int dim, int kv) {
    for (int j = 0; j < n; j += 64) {
        const int m = n - j < 64 ? n - j : 64;
        const void *vj = (const char *)v + j * ldv * (kv == FLM_F32 ? 4 : 2);
        int i = 0;
        for (; i + 4 <= nq; i += 4) weighted_sum_avx512_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 4, vj, m, ldv, dim, kv);
        if (nq - i == 3) weighted_sum_avx512_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 3, vj, m, ldv, dim, kv);
        if (nq - i == 2) weighted_sum_avx512_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 2, vj, m, ldv, dim, kv);
        if (nq - i == 1) weighted_sum_avx512_q(out + i * ldo, ldo, p + i * ldp + j, ldp, 1, vj, m, ldv, dim, kv);
    }
}

static AVX512 void weighted_sum_avx512(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v,
                                       int n, size_t ldv, int dim, int kv) {
    if (kv == FLM_Q8_0) {
        weighted_sum_q8_avx2(out, ldo, p, ldp, nq, v, n, ldv, dim);
        return;
    }
#define CALL(t) weighted_sum_avx512_kv(out, ldo, p, ldp, nq, v, n, ldv, dim, t)
    KV_DISPATCH(CALL, kv);
#undef CALL
}

/* Columns j .. j+127 of S at once, as 8 strips of 16 (absent strips
 * masked off): each column sums over i in order as the generic kernel does,
 * and the 8 strips' chains of FMAs run side by side instead of one waiting
 * on the latency of the last. The decayed state is recomputed in the second
 * pass rather than stored by the first: the same product, one store less. */
static AVX512 void delta_rule_avx512(float *S, const float *q, const float *k, const float *v,
                                     float beta, float decay, int dk, int dv, float *o) {
    const __m512 dec = _mm512_set1_ps(decay);
    for (int j = 0; j < dv; j += 128) {
        __mmask16 m[8];
        __m512 kv[8], d[8], acc[8];
        _Pragma("GCC unroll 8")
        for (int u = 0; u < 8; u++) {
            m[u] = tail_mask(dv - j - 16 * u);
            kv[u] = acc[u] = _mm512_setzero_ps();
        }
        for (int i = 0; i < dk; i++) {
            const float *Si = S + (size_t)i * dv + j;
            const __m512 ki = _mm512_set1_ps(k[i]);
            _Pragma("GCC unroll 8")
            for (int u = 0; u < 8; u++)
                kv[u] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m[u], Si + 16 * u), dec), ki, kv[u]);
        }
        _Pragma("GCC unroll 8")
        for (int u = 0; u < 8; u++)
            d[u] = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m[u], v + j + 16 * u), kv[u]),
                                 _mm512_set1_ps(beta));
        for (int i = 0; i < dk; i++) {
            float *Si = S + (size_t)i * dv + j;
            const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
            _Pragma("GCC unroll 8")
            for (int u = 0; u < 8; u++) {
                const __m512 sv = _mm512_fmadd_ps(ki, d[u], _mm512_mul_ps(_mm512_maskz_loadu_ps(m[u], Si + 16 * u), dec));
                _mm512_mask_storeu_ps(Si + 16 * u, m[u], sv);
                acc[u] = _mm512_fmadd_ps(sv, qi, acc[u]);
            }
        }
        _Pragma("GCC unroll 8")
        for (int u = 0; u < 8; u++) _mm512_mask_storeu_ps(o + j + 16 * u, m[u], acc[u]);
    }
}

/* 16 channels at a time, their window rows in registers; kernels wider
 * than CONV_MAX_K take the generic loop. Products and sums UNFUSED, as
 * the generic loop rounds them. */
static AVX512 UNFUSED void conv_silu_avx512(float *x, size_t ldx, int T, float *win, size_t ldw, const float *w, int K,
                                    int n) {
    if (K > CONV_MAX_K) {
        flm_conv_silu_generic(x, ldx, T, win, ldw, w, K, n);
        return;
    }
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i taps = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(K));
    for (int c = 0; c < n; c += 16) {
        const __mmask16 m = tail_mask(n - c);
        __m512 wj[CONV_MAX_K], wn[CONV_MAX_K];
        for (int j = 0; j < K; j++)
            wj[j] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, taps, w + (size_t)c * K + j, 4);
        for (int j = 0; j < K - 1; j++) wn[j] = _mm512_maskz_loadu_ps(m, win + j * ldw + c);
        for (int t = 0; t < T; t++) {
            float *xt = x + (size_t)t * ldx + c;
            const __m512 in = _mm512_maskz_loadu_ps(m, xt);
            __m512 acc = _mm512_setzero_ps();
            for (int j = 0; j < K - 1; j++) acc = _mm512_add_ps(acc, _mm512_mul_ps(wj[j], wn[j]));
            acc = _mm512_add_ps(acc, _mm512_mul_ps(wj[K - 1], in));
            for (int j = 0; j + 1 < K - 1; j++) wn[j] = wn[j + 1];
            if (K > 1) wn[K - 2] = in;
            _mm512_mask_storeu_ps(xt, m, _mm512_div_ps(acc, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc)))));
        }
        for (int j = 0; j < K - 1; j++) _mm512_mask_storeu_ps(win + j * ldw + c, m, wn[j]);
    }
}

static AVX512 void rmsnorm_avx512(float *out, const float *x, const float *weight, int n, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps));
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, weight + i), v));
    }
}

static AVX512 void silu_mul_avx512(float *g, const float *u, int n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_maskz_loadu_ps(m, g + i);
        __m512 s = _mm512_div_ps(v, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

INLINE AVX512 __m512 tanh16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 a = _mm512_abs_ps(x), z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(TANH_P4), z, _mm512_set1_ps(TANH_P3));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P2));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P1));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P0));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    const __m512 e = exp16(_mm512_add_ps(a, a));
    __m512 large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    large = _mm512_or_ps(large, _mm512_and_ps(_mm512_set1_ps(-0.0f), x));
    const __m512 out = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(TANH_SMALL), _CMP_LT_OQ),
                                            large, small);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), out, x);
}

static AVX512 void gelu_tanh_mul_avx512(float *g, const float *u, int n) {
    const __m512 beta = _mm512_set1_ps(GELU_BETA), kappa = _mm512_set1_ps(GELU_KAPPA);
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
        const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, cube)));
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh16(inner)));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

static AVX512 float softcap_max_avx512(float *x, int n, float cap) {
    const __m512 vc = _mm512_set1_ps(cap);
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 v = _mm512_mul_ps(tanh16(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i), vc)), vc);
        _mm512_mask_storeu_ps(x + i, m, v);
        mx = _mm512_mask_max_ps(mx, m, v, mx);   /* a NaN in v keeps mx, as the scalar loop does */
    }
    return _mm512_reduce_max_ps(mx);
}

/* The float kernels every AVX-512 path shares (they differ in their
 * matmuls). */
#define AVX512_FLOAT_KERNELS                                                                                  \
    .key_scores = key_scores_avx512, .exp_sum = exp_sum_avx512, .scale_max = scale_max_avx512,              \
    .scale = scale_avx512, .weighted_sum = weighted_sum_avx512, .delta_rule = delta_rule_avx512,            \
    .conv_silu = conv_silu_avx512, .rmsnorm = rmsnorm_avx512, .silu_mul = silu_mul_avx512,                  \
    .gelu_tanh_mul = gelu_tanh_mul_avx512, .softcap_max = softcap_max_avx512

static const FlmKernels kernels_avx512 = {
    .name = "avx512",
    .gemm_f32 = flm_gemm_f32_avx512,
    .gemm_bf16 = flm_gemm_bf16_avx512,
    .to_bf16 = NULL,
    .int8_name = "avx512_vnni",
    .qgemm = flm_qgemm_avx512_vnni,
    .quantize_q8 = flm_quantize_q8_avx512,
    AVX512_FLOAT_KERNELS,
    .token_block = 60,
};

/* AVX-512 plus BF16 dot products: bf16 weights take bf16 activations, twice
 * the multiplies per instruction at the cost of rounding the activations. */
static const FlmKernels kernels_avx512_bf16 = {
    .name = "avx512_bf16",
    .gemm_f32 = flm_gemm_f32_avx512,
    .gemm_bf16 = flm_gemm_bf16_dp_avx512,
    .to_bf16 = flm_to_bf16_avx512,
    .int8_name = "avx512_vnni",
    .qgemm = flm_qgemm_avx512_vnni,
    .quantize_q8 = flm_quantize_q8_avx512,
    AVX512_FLOAT_KERNELS,
    .token_block = 60,
};

/* F16C converts the f16 KV cache (every AVX2 CPU has it; compilers cannot
 * all name it to __builtin_cpu_supports). */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}

#ifdef FLM_AMX
/* The same, with the bf16 matmuls on AMX tiles. */
static const FlmKernels kernels_amx_bf16 = {
    .name = "amx_bf16",
    .gemm_f32 = flm_gemm_f32_avx512,
    .gemm_bf16 = flm_gemm_bf16_amx,
    .to_bf16 = flm_to_bf16_avx512,
    .int8_name = "avx512_vnni",
    .qgemm = flm_qgemm_avx512_vnni,
    .quantize_q8 = flm_quantize_q8_avx512,
    AVX512_FLOAT_KERNELS,
    .token_block = 64,
};

/* AMX needs the CPU's tile unit and the kernel's leave to use its 8 KB of
 * tile state (Linux grants it per process on request). */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return 0;
#ifdef __linux__
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}
#endif

/* ---- The paths, as kernels.c chooses among them */

const FlmKernels *const flm_arch_paths[] = {
#ifdef FLM_AMX
    &kernels_amx_bf16,
#endif
    &kernels_avx512_bf16, &kernels_avx512, &kernels_avx2, NULL,
};

int flm_arch_supported(const FlmKernels *k) {
    __builtin_cpu_init();
    if (k == &kernels_avx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("fma");
    if (k == &kernels_avx512) return avx512;
    if (k == &kernels_avx512_bf16) return avx512 && __builtin_cpu_supports("avx512bf16");
#ifdef FLM_AMX
    if (k == &kernels_amx_bf16) return avx512 && __builtin_cpu_supports("avx512bf16") && amx_usable();
#endif
    return 0;
}

/* ---- Prefetching the weights that decoding streams (simd.h) */

int flm_stream_ahead = 2048, flm_stream_l2 = 0;
/* Once the CPU's choice is made, or flm_arch_set_stream_prefetch has
 * replaced it, choosing a path leaves it as it is. */
static int stream_prefetch_chosen = 0;

/* The CPU's maker, from CPUID leaf 0. */
static int cpu_vendor_is(const char *name) {
    unsigned a, b, c, d;
    char v[13] = {0};
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    memcpy(v, &b, 4); memcpy(v + 4, &d, 4); memcpy(v + 8, &c, 4);
    return strcmp(v, name) == 0;
}

/* Intel: 2 KiB ahead into L1. On the 2-core Xeon (AVX-512 VNNI),
 * forward_speed's 1.7B shape decoded, at 1 / 2 threads, q4_k +37% / +37%,
 * q5_k +23% / +22%, q6_k +10% / +10%, q4_0 +8% / +13%, q8_0 level against
 * the hardware prefetcher alone; Phi-4-mini's and Qwen3.5-2B's shapes at
 * q4_k_m +23-28%; the AVX2 kernels on the same CPU q4_k +17%, q4_k_m
 * +14-15%, q8_0 +3%; 1 and 4 KiB ahead no better, the non-temporal hint
 * 40% slower.
 * AMD (Zen 4): the same made decoding slower than the hardware prefetcher
 * alone; 1 KiB ahead into L2 is the fastest of those tried there (figures
 * in benchmarks/README.md). Hygon's CPUs are Zen's. */
static void choose_stream_prefetch(void) {
    const int amd = cpu_vendor_is("AuthenticAMD") || cpu_vendor_is("HygonGenuine");
    flm_stream_ahead = amd ? 1024 : 2048;
    flm_stream_l2 = amd;
    stream_prefetch_chosen = 1;
}

int flm_arch_set_stream_prefetch(int bytes, int level) {
    if (bytes < 0 || bytes > 65536 || bytes % 64 || (level != 1 && level != 2)) return -1;
    flm_stream_ahead = bytes;
    flm_stream_l2 = level == 2;
    stream_prefetch_chosen = 1;
    return 0;
}

int flm_arch_stream_prefetch(int *bytes, int *level) {
    *bytes = flm_stream_ahead;
    *level = flm_stream_l2 ? 2 : 1;
    return 0;
}

/* AVX-512 CPUs without VNNI (Skylake-X) run the avx512 paths' int8 matmul
 * on AVX2's kernel instead. */
void flm_arch_adapt(FlmKernels *k) {
    if (k->qgemm == flm_qgemm_avx512_vnni && !__builtin_cpu_supports("avx512vnni")) {
        k->qgemm = flm_qgemm_avx2;
        k->int8_name = "avx2";
    }
    if (!stream_prefetch_chosen) choose_stream_prefetch();
}
#endif /* x86 */
