/* Matmul tiles, dot and axpy for three paths: generic C, AVX2+FMA, AVX-512. */
#include "kernels.h"

#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------- generic */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Eight partial sums, reduced pairwise at the end: the compiler can keep
 * them in one vector register, and the order is the same for every tile. */
#define GENERIC_LANES 8

static inline float reduce8(const float *acc) {
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

static float dot_generic(const float *a, const float *b, int n) {
    float acc[GENERIC_LANES] = {0};
    int k = 0;
    for (; k + GENERIC_LANES <= n; k += GENERIC_LANES)
        for (int i = 0; i < GENERIC_LANES; i++) acc[i] += a[k + i] * b[k + i];
    for (int i = 0; k < n; k++, i++) acc[i] += a[k] * b[k];
    return reduce8(acc);
}

static void tile_f32_generic(float *out, int ldo, const float *x, int ldx,
                             const void *w, size_t ldw, int K, int nt, int nr) {
    const float *wf = (const float *)w;
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++)
            out[t * ldo + r] = dot_generic(x + (size_t)t * ldx, wf + r * ldw, K);
}

static float exp_sum_generic(float *x, int n, float max) {
    float acc[GENERIC_LANES] = {0};
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        acc[i % GENERIC_LANES] += x[i];
    }
    return reduce8(acc);
}

static void weighted_sum_generic(float *out, const float *p, const float *v, int n, size_t ldv, int dim) {
    for (int d = 0; d < dim; d++) out[d] = 0.0f;
    for (int j = 0; j < n; j++)
        for (int d = 0; d < dim; d++) out[d] += p[j] * v[j * ldv + d];
}

/* Column j of S only ever meets column j of the update, so each column is
 * finished (decay and S^T k, then update and S^T q) before the next. */
static void delta_rule_generic(float *S, const float *q, const float *k, const float *v, float beta,
                               float decay, int dk, int dv, float *o) {
    for (int j = 0; j < dv; j++) {
        float kv = 0.0f;
        for (int i = 0; i < dk; i++) {
            S[(size_t)i * dv + j] *= decay;
            kv += S[(size_t)i * dv + j] * k[i];
        }
        float d = (v[j] - kv) * beta, acc = 0.0f;
        for (int i = 0; i < dk; i++) {
            S[(size_t)i * dv + j] += k[i] * d;
            acc += S[(size_t)i * dv + j] * q[i];
        }
        o[j] = acc;
    }
}

static void rmsnorm_generic(float *out, const float *x, const float *weight, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

static void silu_mul_generic(float *g, const float *u, int n) {
    for (int i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static const FlmKernels kernels_generic = {
    "generic", tile_f32_generic, flm_gemm_f32_generic, flm_gemm_bf16_generic, NULL, exp_sum_generic,
    weighted_sum_generic, delta_rule_generic, rmsnorm_generic, silu_mul_generic,
};

/* ------------------------------------------------------------------- x86 */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FLM_HAVE_X86 1
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")))
#define INLINE static inline __attribute__((always_inline))

/* ---- AVX2: 8 lanes */

INLINE AVX2 __m256 load8_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE AVX2 float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Same scheme as the AVX-512 kernels below, 8 lanes wide; the K % 8 tail
 * goes through a zero-padded copy so it is one more full vector step. */
INLINE AVX2 __m256 tail8_x(const float *x, int k, int K) {
    float t[8] = {0};
    for (int i = 0; k + i < K; i++) t[i] = x[k + i];
    return _mm256_loadu_ps(t);
}

INLINE AVX2 __m256 tail8_w_f32(const float *w, int k, int K) { return tail8_x(w, k, K); }

INLINE AVX2 __m256 tail8_w_bf16(const uint16_t *w, int k, int K) {
    float t[8] = {0};
    for (int i = 0; k + i < K; i++) t[i] = bf16_to_f32(w[k + i]);
    return _mm256_loadu_ps(t);
}

#define W8_F32(p, k) _mm256_loadu_ps((const float *)(p) + (k))
#define W8_BF16(p, k) load8_bf16((const uint16_t *)(p) + (k))

#define DEFINE_AVX2_KERNELS(SUF, WT, W8)                                                   \
static AVX2 void k11_##SUF##_avx2(float *out, const float *x, const WT *w, int K) {        \
    __m256 a = _mm256_setzero_ps();                                                        \
    int k = 0;                                                                             \
    for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), W8(w, k), a);   \
    if (k < K) a = _mm256_fmadd_ps(tail8_x(x, k, K), tail8_w_##SUF(w, k, K), a);           \
    *out = hsum8(a);                                                                       \
}                                                                                          \
static AVX2 void k24_##SUF##_avx2(float *out, int ldo, const float *x, int ldx, const WT *w, size_t ldw, int K) { \
    const WT *w0 = w, *w1 = w + ldw, *w2 = w + 2 * (size_t)ldw, *w3 = w + 3 * (size_t)ldw;       \
    const float *x0 = x, *x1 = x + ldx;                                                    \
    __m256 z = _mm256_setzero_ps();                                                        \
    __m256 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;         \
    __m256 v0, v1, v2, v3, xv;                                                             \
    int k = 0;                                                                             \
    for (; k + 8 <= K; k += 8) {                                                           \
        v0 = W8(w0, k); v1 = W8(w1, k); v2 = W8(w2, k); v3 = W8(w3, k);                    \
        xv = _mm256_loadu_ps(x0 + k);                                                      \
        a00 = _mm256_fmadd_ps(xv, v0, a00); a01 = _mm256_fmadd_ps(xv, v1, a01);            \
        a02 = _mm256_fmadd_ps(xv, v2, a02); a03 = _mm256_fmadd_ps(xv, v3, a03);            \
        xv = _mm256_loadu_ps(x1 + k);                                                      \
        a10 = _mm256_fmadd_ps(xv, v0, a10); a11 = _mm256_fmadd_ps(xv, v1, a11);            \
        a12 = _mm256_fmadd_ps(xv, v2, a12); a13 = _mm256_fmadd_ps(xv, v3, a13);            \
    }                                                                                      \
    if (k < K) {                                                                           \
        v0 = tail8_w_##SUF(w0, k, K); v1 = tail8_w_##SUF(w1, k, K);                        \
        v2 = tail8_w_##SUF(w2, k, K); v3 = tail8_w_##SUF(w3, k, K);                        \
        xv = tail8_x(x0, k, K);                                                            \
        a00 = _mm256_fmadd_ps(xv, v0, a00); a01 = _mm256_fmadd_ps(xv, v1, a01);            \
        a02 = _mm256_fmadd_ps(xv, v2, a02); a03 = _mm256_fmadd_ps(xv, v3, a03);            \
        xv = tail8_x(x1, k, K);                                                            \
        a10 = _mm256_fmadd_ps(xv, v0, a10); a11 = _mm256_fmadd_ps(xv, v1, a11);            \
        a12 = _mm256_fmadd_ps(xv, v2, a12); a13 = _mm256_fmadd_ps(xv, v3, a13);            \
    }                                                                                      \
    out[0] = hsum8(a00); out[1] = hsum8(a01); out[2] = hsum8(a02); out[3] = hsum8(a03);    \
    out[ldo] = hsum8(a10); out[ldo + 1] = hsum8(a11);                                      \
    out[ldo + 2] = hsum8(a12); out[ldo + 3] = hsum8(a13);                                  \
}                                                                                          \
static AVX2 void tile_##SUF##_avx2(float *out, int ldo, const float *x, int ldx,           \
                                   const void *wv, size_t ldw, int K, int nt, int nr) {   \
    const WT *w = (const WT *)wv;                                                          \
    int t = 0;                                                                             \
    if (nr == 4)                                                                           \
        for (; t + 2 <= nt; t += 2)                                                        \
            k24_##SUF##_avx2(out + (size_t)t * ldo, ldo, x + (size_t)t * ldx, ldx, w, ldw, K); \
    for (int r = 0; r < nr; r++) /* row after row: see the AVX-512 tile */                 \
        for (int u = t; u < nt; u++)                                                       \
            k11_##SUF##_avx2(out + (size_t)u * ldo + r, x + (size_t)u * ldx, w + r * ldw, K); \
}

DEFINE_AVX2_KERNELS(f32, float, W8_F32)

static AVX2 void weighted_sum_avx2(float *out, const float *p, const float *v, int n, size_t ldv, int dim) {
    int d = 0;
    for (; d + 8 <= dim; d += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * ldv + d), a);
        _mm256_storeu_ps(out + d, a);
    }
    for (; d < dim; d++) {
        float a = 0.0f;
        for (int j = 0; j < n; j++) a = __builtin_fmaf(p[j], v[j * ldv + d], a);
        out[d] = a;
    }
}

static const FlmKernels kernels_avx2 = {
    "avx2", tile_f32_avx2, flm_gemm_f32_avx2, flm_gemm_bf16_avx2, NULL, exp_sum_generic, weighted_sum_avx2,
    delta_rule_generic, rmsnorm_generic, silu_mul_generic,
};

/* ---- AVX-512: 16 lanes, masked tail.
 * Every output is one 16-lane accumulator over k = 0, 16, 32, ... (the last
 * step masked), reduced by hsum4_16's fixed tree. The 4x4, 1x4 and 1x1
 * kernels below all follow that sequence, so how rows and tokens are grouped
 * never changes a result. Accumulators are named variables: as an array,
 * GCC stores them to the stack on every step. */

/* Four horizontal sums at once. Each sum's tree depends on its own vector
 * only, so a lone sum (the others zero) rounds exactly like one of four. */
INLINE AVX512 __m128 hsum4_16(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

INLINE AVX512 float hsum16(__m512 a) {
    __m512 z = _mm512_setzero_ps();
    return _mm_cvtss_f32(hsum4_16(a, z, z, z));
}

INLINE AVX512 __m512 load16_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE AVX512 __m512 loadm16_bf16(__mmask16 m, const uint16_t *p) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define W16_F32(p, k) _mm512_loadu_ps((const float *)(p) + (k))
#define W16_BF16(p, k) load16_bf16((const uint16_t *)(p) + (k))
#define WM16_F32(m, p, k) _mm512_maskz_loadu_ps(m, (const float *)(p) + (k))
#define WM16_BF16(m, p, k) loadm16_bf16(m, (const uint16_t *)(p) + (k))

#define DEFINE_AVX512_KERNELS(SUF, WT, W16, WM16)                                         \
static AVX512 void k11_##SUF(float *out, const float *x, const WT *w, int K) {             \
    __m512 a = _mm512_setzero_ps();                                                        \
    int k = 0;                                                                             \
    for (; k + 16 <= K; k += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), W16(w, k), a); \
    if (k < K) {                                                                           \
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);                                    \
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), WM16(m, w, k), a);            \
    }                                                                                      \
    *out = hsum16(a);                                                                      \
}                                                                                          \
static AVX512 void k14_##SUF(float *out, const float *x, const WT *w, size_t ldw, int K) { \
    const WT *w0 = w, *w1 = w + ldw, *w2 = w + 2 * ldw, *w3 = w + 3 * ldw;                 \
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                            \
    int k = 0;                                                                             \
    for (; k + 16 <= K; k += 16) {                                                         \
        __m512 xv = _mm512_loadu_ps(x + k);                                                \
        a0 = _mm512_fmadd_ps(xv, W16(w0, k), a0);                                          \
        a1 = _mm512_fmadd_ps(xv, W16(w1, k), a1);                                          \
        a2 = _mm512_fmadd_ps(xv, W16(w2, k), a2);                                          \
        a3 = _mm512_fmadd_ps(xv, W16(w3, k), a3);                                          \
    }                                                                                      \
    if (k < K) {                                                                           \
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);                                    \
        __m512 xv = _mm512_maskz_loadu_ps(m, x + k);                                       \
        a0 = _mm512_fmadd_ps(xv, WM16(m, w0, k), a0);                                      \
        a1 = _mm512_fmadd_ps(xv, WM16(m, w1, k), a1);                                      \
        a2 = _mm512_fmadd_ps(xv, WM16(m, w2, k), a2);                                      \
        a3 = _mm512_fmadd_ps(xv, WM16(m, w3, k), a3);                                      \
    }                                                                                      \
    _mm_storeu_ps(out, hsum4_16(a0, a1, a2, a3));                                          \
}                                                                                          \
static AVX512 void k44_##SUF(float *out, int ldo, const float *x, int ldx, const WT *w, size_t ldw, int K) { \
    const WT *w0 = w, *w1 = w + ldw, *w2 = w + 2 * (size_t)ldw, *w3 = w + 3 * (size_t)ldw;       \
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * (size_t)ldx, *x3 = x + 3 * (size_t)ldx; \
    __m512 z = _mm512_setzero_ps();                                                        \
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;         \
    __m512 a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;         \
    __m512 v0, v1, v2, v3, xv;                                                             \
    int k = 0;                                                                             \
    __mmask16 m = 0xFFFF;                                                                  \
    for (;;) {                                                                             \
        if (k + 16 <= K) {                                                                 \
            v0 = W16(w0, k); v1 = W16(w1, k); v2 = W16(w2, k); v3 = W16(w3, k);            \
        } else if (k < K) {                                                                \
            m = (__mmask16)((1u << (K - k)) - 1);                                          \
            v0 = WM16(m, w0, k); v1 = WM16(m, w1, k); v2 = WM16(m, w2, k); v3 = WM16(m, w3, k); \
        } else break;                                                                      \
        xv = _mm512_maskz_loadu_ps(m, x0 + k);                                             \
        a00 = _mm512_fmadd_ps(xv, v0, a00); a01 = _mm512_fmadd_ps(xv, v1, a01);            \
        a02 = _mm512_fmadd_ps(xv, v2, a02); a03 = _mm512_fmadd_ps(xv, v3, a03);            \
        xv = _mm512_maskz_loadu_ps(m, x1 + k);                                             \
        a10 = _mm512_fmadd_ps(xv, v0, a10); a11 = _mm512_fmadd_ps(xv, v1, a11);            \
        a12 = _mm512_fmadd_ps(xv, v2, a12); a13 = _mm512_fmadd_ps(xv, v3, a13);            \
        xv = _mm512_maskz_loadu_ps(m, x2 + k);                                             \
        a20 = _mm512_fmadd_ps(xv, v0, a20); a21 = _mm512_fmadd_ps(xv, v1, a21);            \
        a22 = _mm512_fmadd_ps(xv, v2, a22); a23 = _mm512_fmadd_ps(xv, v3, a23);            \
        xv = _mm512_maskz_loadu_ps(m, x3 + k);                                             \
        a30 = _mm512_fmadd_ps(xv, v0, a30); a31 = _mm512_fmadd_ps(xv, v1, a31);            \
        a32 = _mm512_fmadd_ps(xv, v2, a32); a33 = _mm512_fmadd_ps(xv, v3, a33);            \
        k += 16;                                                                           \
    }                                                                                      \
    float *o0 = out, *o1 = out + ldo, *o2 = out + 2 * (size_t)ldo, *o3 = out + 3 * (size_t)ldo; \
    _mm_storeu_ps(o0, hsum4_16(a00, a01, a02, a03));                                       \
    _mm_storeu_ps(o1, hsum4_16(a10, a11, a12, a13));                                       \
    _mm_storeu_ps(o2, hsum4_16(a20, a21, a22, a23));                                       \
    _mm_storeu_ps(o3, hsum4_16(a30, a31, a32, a33));                                       \
}                                                                                          \
static AVX512 void tile_##SUF##_avx512(float *out, int ldo, const float *x, int ldx,       \
                                       const void *wv, size_t ldw, int K, int nt, int nr) { \
    const WT *w = (const WT *)wv;                                                          \
    if (nt == 4 && nr == 4) { k44_##SUF(out, ldo, x, ldx, w, ldw, K); return; }            \
    if (nr == 4 && K <= 256) { /* short rows in cache, e.g. attention keys */              \
        for (int t = 0; t < nt; t++) k14_##SUF(out + (size_t)t * ldo, x + (size_t)t * ldx, w, ldw, K); \
        return;                                                                            \
    }                                                                                      \
    /* Row after row: one sequential stream through the weights is what the    */        \
    /* hardware prefetcher follows best when decoding (nearly twice as fast as  */        \
    /* four interleaved rows).                                                   */        \
    for (int r = 0; r < nr; r++)                                                           \
        for (int t = 0; t < nt; t++)                                                       \
            k11_##SUF(out + (size_t)t * ldo + r, x + (size_t)t * ldx, w + r * ldw, K);     \
}

DEFINE_AVX512_KERNELS(f32, float, W16_F32, WM16_F32)

/* exp(x) as 2^n * p(r), x = n*ln2 + r, |r| <= ln2/2, with a degree-6
 * polynomial for exp(r): about 1 ulp, and exactly 0 far below. */
INLINE AVX512 __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
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
    return _mm512_scalef_ps(p, n);
}

static AVX512 float exp_sum_avx512(float *x, int n, float max) {
    __m512 acc = _mm512_setzero_ps(), mx = _mm512_set1_ps(max);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mx));
        _mm512_mask_storeu_ps(x + i, m, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
    }
    return _mm512_reduce_add_ps(acc);
}

static AVX512 void weighted_sum_avx512(float *out, const float *p, const float *v, int n, size_t ldv, int dim) {
    for (int d = 0; d < dim; d += 64) {
        __mmask16 m[4];
        for (int i = 0; i < 4; i++) {
            int left = dim - d - 16 * i;
            m[i] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        }
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *vd = v + d;
        for (int j = 0; j < n; j++, vd += ldv) {
            __m512 pj = _mm512_set1_ps(p[j]);
            a0 = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[0], vd), a0);
            a1 = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[1], vd + 16), a1);
            a2 = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[2], vd + 32), a2);
            a3 = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[3], vd + 48), a3);
        }
        _mm512_mask_storeu_ps(out + d, m[0], a0);
        _mm512_mask_storeu_ps(out + d + 16, m[1], a1);
        _mm512_mask_storeu_ps(out + d + 32, m[2], a2);
        _mm512_mask_storeu_ps(out + d + 48, m[3], a3);
    }
}

static AVX512 void delta_rule_avx512(float *S, const float *q, const float *k, const float *v,
                                     float beta, float decay, int dk, int dv, float *o) {
    const __m512 dec = _mm512_set1_ps(decay);
    for (int j = 0; j < dv; j += 16) {
        __mmask16 m = dv - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (dv - j)) - 1);
        __m512 kv = _mm512_setzero_ps();
        for (int i = 0; i < dk; i++) {
            float *Sij = S + (size_t)i * dv + j;
            __m512 sv = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, Sij), dec);
            _mm512_mask_storeu_ps(Sij, m, sv);
            kv = _mm512_fmadd_ps(sv, _mm512_set1_ps(k[i]), kv);
        }
        __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + j), kv), _mm512_set1_ps(beta));
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < dk; i++) {
            float *Sij = S + (size_t)i * dv + j;
            __m512 sv = _mm512_fmadd_ps(_mm512_set1_ps(k[i]), d, _mm512_maskz_loadu_ps(m, Sij));
            _mm512_mask_storeu_ps(Sij, m, sv);
            acc = _mm512_fmadd_ps(sv, _mm512_set1_ps(q[i]), acc);
        }
        _mm512_mask_storeu_ps(o + j, m, acc);
    }
}

static AVX512 void rmsnorm_avx512(float *out, const float *x, const float *weight, int n, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(hsum16(acc) / (float)n + eps));
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, weight + i), v));
    }
}

static AVX512 void silu_mul_avx512(float *g, const float *u, int n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_loadu_ps(m, g + i);
        __m512 s = _mm512_div_ps(v, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
    }
}

static const FlmKernels kernels_avx512 = {
    "avx512", tile_f32_avx512, flm_gemm_f32_avx512, flm_gemm_bf16_avx512, NULL, exp_sum_avx512,
    weighted_sum_avx512, delta_rule_avx512, rmsnorm_avx512, silu_mul_avx512,
};

/* AVX-512 plus BF16 dot products: bf16 weights take bf16 activations, twice
 * the multiplies per instruction at the cost of rounding the activations. */
static const FlmKernels kernels_avx512_bf16 = {
    "avx512_bf16", tile_f32_avx512, flm_gemm_f32_avx512, flm_gemm_bf16_dp_avx512, flm_to_bf16_avx512,
    exp_sum_avx512, weighted_sum_avx512, delta_rule_avx512, rmsnorm_avx512, silu_mul_avx512,
};
#endif /* x86 */

/* -------------------------------------------------------------- dispatch */

const FlmKernels *flm_kernels = &kernels_generic;

static int supported(const FlmKernels *k) {
    if (k == &kernels_generic) return 1;
#ifdef FLM_HAVE_X86
    __builtin_cpu_init();
    if (k == &kernels_avx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (k == &kernels_avx512 || k == &kernels_avx512_bf16)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("fma") &&
               (k == &kernels_avx512 || __builtin_cpu_supports("avx512bf16"));
#endif
    return 0;
}

static const FlmKernels *const all_paths[] = {
#ifdef FLM_HAVE_X86
    &kernels_avx512_bf16, &kernels_avx512, &kernels_avx2,
#endif
    &kernels_generic,
};

/* The widest path whose results stay within fp32 rounding of the reference.
 * avx512_bf16 rounds activations to bf16 and is only used when asked for. */
void flm_kernels_init(void) {
    for (size_t i = 0; i < sizeof all_paths / sizeof all_paths[0]; i++)
        if (all_paths[i]->to_bf16 == NULL && supported(all_paths[i])) {
            flm_kernels = all_paths[i];
            return;
        }
}

int flm_kernels_select(const char *name) {
    for (size_t i = 0; i < sizeof all_paths / sizeof all_paths[0]; i++)
        if (strcmp(all_paths[i]->name, name) == 0 && supported(all_paths[i])) {
            flm_kernels = all_paths[i];
            return 0;
        }
    return -1;
}
