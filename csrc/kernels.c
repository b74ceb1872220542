/* Matmul tiles, dot and axpy for three paths: generic C, AVX2+FMA, AVX-512. */
#include "kernels.h"

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

static float dot_bf16_generic(const float *a, const uint16_t *b, int n) {
    float acc[GENERIC_LANES] = {0};
    int k = 0;
    for (; k + GENERIC_LANES <= n; k += GENERIC_LANES)
        for (int i = 0; i < GENERIC_LANES; i++) acc[i] += a[k + i] * bf16_to_f32(b[k + i]);
    for (int i = 0; k < n; k++, i++) acc[i] += a[k] * bf16_to_f32(b[k]);
    return reduce8(acc);
}

static void tile_f32_generic(float *out, int ldo, const float *x, int ldx,
                             const void *w, int K, int nt, int nr) {
    const float *wf = (const float *)w;
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++)
            out[t * ldo + r] = dot_generic(x + (size_t)t * ldx, wf + (size_t)r * K, K);
}

static void tile_bf16_generic(float *out, int ldo, const float *x, int ldx,
                              const void *w, int K, int nt, int nr) {
    const uint16_t *wh = (const uint16_t *)w;
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++)
            out[t * ldo + r] = dot_bf16_generic(x + (size_t)t * ldx, wh + (size_t)r * K, K);
}

static void axpy_generic(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static const FlmKernels kernels_generic = {
    "generic", tile_f32_generic, tile_bf16_generic, dot_generic, axpy_generic,
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

/* The K % 8 tail goes through a zero-padded copy so that it is one more
 * vector step, identical whatever the tile shape. */
INLINE AVX2 void tile8(int NT, int NR, int bf16, float *out, int ldo, const float *x, int ldx,
                       const void *w, int K) {
    __m256 acc[FLM_TILE_T][FLM_TILE_R];
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) acc[t][r] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[FLM_TILE_R];
        for (int r = 0; r < NR; r++)
            wv[r] = bf16 ? load8_bf16((const uint16_t *)w + (size_t)r * K + k)
                         : _mm256_loadu_ps((const float *)w + (size_t)r * K + k);
        for (int t = 0; t < NT; t++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)t * ldx + k);
            for (int r = 0; r < NR; r++) acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
        }
    }
    if (k < K) {
        int rem = K - k;
        float xt[FLM_TILE_T][8] = {{0}}, wt[FLM_TILE_R][8] = {{0}};
        for (int r = 0; r < NR; r++)
            for (int i = 0; i < rem; i++)
                wt[r][i] = bf16 ? bf16_to_f32(((const uint16_t *)w)[(size_t)r * K + k + i])
                                : ((const float *)w)[(size_t)r * K + k + i];
        for (int t = 0; t < NT; t++)
            for (int i = 0; i < rem; i++) xt[t][i] = x[(size_t)t * ldx + k + i];
        for (int t = 0; t < NT; t++) {
            __m256 xv = _mm256_loadu_ps(xt[t]);
            for (int r = 0; r < NR; r++)
                acc[t][r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wt[r]), acc[t][r]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) out[t * ldo + r] = hsum8(acc[t][r]);
}

#define TILE_CASES(FN, BF16)                                                    \
    switch (nt * 8 + nr) {                                                      \
    case 8 + 1: FN(1, 1, BF16, out, ldo, x, ldx, w, K); break;                  \
    case 8 + 2: FN(1, 2, BF16, out, ldo, x, ldx, w, K); break;                  \
    case 8 + 3: FN(1, 3, BF16, out, ldo, x, ldx, w, K); break;                  \
    case 8 + 4: FN(1, 4, BF16, out, ldo, x, ldx, w, K); break;                  \
    case 16 + 1: FN(2, 1, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 16 + 2: FN(2, 2, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 16 + 3: FN(2, 3, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 16 + 4: FN(2, 4, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 24 + 1: FN(3, 1, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 24 + 2: FN(3, 2, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 24 + 3: FN(3, 3, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 24 + 4: FN(3, 4, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 32 + 1: FN(4, 1, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 32 + 2: FN(4, 2, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 32 + 3: FN(4, 3, BF16, out, ldo, x, ldx, w, K); break;                 \
    case 32 + 4: FN(4, 4, BF16, out, ldo, x, ldx, w, K); break;                 \
    default: break;                                                             \
    }

static AVX2 void tile_f32_avx2(float *out, int ldo, const float *x, int ldx,
                               const void *w, int K, int nt, int nr) {
    TILE_CASES(tile8, 0)
}

static AVX2 void tile_bf16_avx2(float *out, int ldo, const float *x, int ldx,
                                const void *w, int K, int nt, int nr) {
    TILE_CASES(tile8, 1)
}

static AVX2 float dot_avx2(const float *a, const float *b, int n) {
    float out;
    tile8(1, 1, 0, &out, 1, a, n, b, n);
    return out;
}

static AVX2 void axpy_avx2(float *y, float a, const float *x, int n) {
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = __builtin_fmaf(a, x[i], y[i]);
}

static const FlmKernels kernels_avx2 = {
    "avx2", tile_f32_avx2, tile_bf16_avx2, dot_avx2, axpy_avx2,
};

/* ---- AVX-512: 16 lanes, masked tail */

INLINE AVX512 __m512 load16_bf16(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE AVX512 void tile16(int NT, int NR, int bf16, float *out, int ldo, const float *x, int ldx,
                          const void *w, int K) {
    __m512 acc[FLM_TILE_T][FLM_TILE_R];
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) acc[t][r] = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
        __m512 wv[FLM_TILE_R];
        for (int r = 0; r < NR; r++)
            wv[r] = bf16 ? load16_bf16((const uint16_t *)w + (size_t)r * K + k, m)
                         : _mm512_maskz_loadu_ps(m, (const float *)w + (size_t)r * K + k);
        for (int t = 0; t < NT; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)t * ldx + k);
            for (int r = 0; r < NR; r++) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int r = 0; r < NR; r++) out[t * ldo + r] = _mm512_reduce_add_ps(acc[t][r]);
}

static AVX512 void tile_f32_avx512(float *out, int ldo, const float *x, int ldx,
                                   const void *w, int K, int nt, int nr) {
    TILE_CASES(tile16, 0)
}

static AVX512 void tile_bf16_avx512(float *out, int ldo, const float *x, int ldx,
                                    const void *w, int K, int nt, int nr) {
    TILE_CASES(tile16, 1)
}

static AVX512 float dot_avx512(const float *a, const float *b, int n) {
    float out;
    tile16(1, 1, 0, &out, 1, a, n, b, n);
    return out;
}

static AVX512 void axpy_avx512(float *y, float a, const float *x, int n) {
    __m512 av = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 r = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
    }
}

static const FlmKernels kernels_avx512 = {
    "avx512", tile_f32_avx512, tile_bf16_avx512, dot_avx512, axpy_avx512,
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
    if (k == &kernels_avx512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("fma");
#endif
    return 0;
}

static const FlmKernels *const all_paths[] = {
#ifdef FLM_HAVE_X86
    &kernels_avx512, &kernels_avx2,
#endif
    &kernels_generic,
};

void flm_kernels_init(void) {
    for (size_t i = 0; i < sizeof all_paths / sizeof all_paths[0]; i++)
        if (supported(all_paths[i])) { flm_kernels = all_paths[i]; return; }
}

int flm_kernels_select(const char *name) {
    for (size_t i = 0; i < sizeof all_paths / sizeof all_paths[0]; i++)
        if (strcmp(all_paths[i]->name, name) == 0 && supported(all_paths[i])) {
            flm_kernels = all_paths[i];
            return 0;
        }
    return -1;
}
