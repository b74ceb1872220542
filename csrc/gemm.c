/* The matmul over packed panels (layout: gemm.h), for each SIMD path.
 *
 * Every output is summed the same way whatever tile it is computed in: a
 * chain of multiply-adds over each block of KBLOCK consecutive k, and the
 * block sums added in order. So batched and one-token passes agree bit for
 * bit, and the rounding error grows with KBLOCK + K/KBLOCK rather than K. */
#include <string.h>

#include "gemm.h"
#include "quant.h"
#include "simd.h"
#include "types.h"

#define PANEL FLM_PANEL
#define KBLOCK 32

static int imin(int a, int b) { return a < b ? a : b; }

static size_t padded_k(int K, int wtype) { return wtype == FLM_BF16 ? (size_t)(K + 1) / 2 * 2 : (size_t)K; }

size_t flm_packed_bytes(int N, int K, int wtype) {
    if (wtype != FLM_F32 && wtype != FLM_BF16) return flm_quant_packed_bytes(N, K, wtype);
    size_t panels = (size_t)(N + PANEL - 1) / PANEL;
    return panels * padded_k(K, wtype) * PANEL * (wtype == FLM_BF16 ? 2 : 4);
}

void flm_pack(void *dst, const void *src, int N, int K, int wtype, int n_threads) {
    if (wtype != FLM_F32 && wtype != FLM_BF16) {
        flm_quant_pack(dst, src, N, K, wtype, n_threads);
        return;
    }
    const int panels = (N + PANEL - 1) / PANEL;
    const size_t kp = padded_k(K, wtype);
#pragma omp parallel for schedule(static) num_threads(n_threads > 0 ? n_threads : 1)
    for (int p = 0; p < panels; p++) {
        if (wtype == FLM_BF16) {
            uint16_t *d = (uint16_t *)dst + (size_t)p * kp * PANEL;
            const uint16_t *s = (const uint16_t *)src;
            memset(d, 0, kp * PANEL * 2);
            for (int i = 0; i < PANEL && p * PANEL + i < N; i++) {
                const uint16_t *row = s + (size_t)(p * PANEL + i) * K;
                for (int k = 0; k < K; k++) d[((size_t)(k / 2) * PANEL + i) * 2 + (k & 1)] = row[k];
            }
        } else {
            float *d = (float *)dst + (size_t)p * kp * PANEL;
            const float *s = (const float *)src;
            memset(d, 0, kp * PANEL * 4);
            for (int i = 0; i < PANEL && p * PANEL + i < N; i++) {
                const float *row = s + (size_t)(p * PANEL + i) * K;
                for (int k = 0; k < K; k++) d[(size_t)k * PANEL + i] = row[k];
            }
        }
    }
}

/* Row r, column k of a packed matrix (for embedding lookups from a tied head). */
void flm_packed_row(float *out, const void *wp, int r, int K, int wtype) {
    if (wtype != FLM_F32 && wtype != FLM_BF16) {
        flm_quant_packed_row(out, wp, r, K, wtype);
        return;
    }
    const size_t kp = padded_k(K, wtype);
    const int p = r / PANEL, i = r % PANEL;
    if (wtype == FLM_BF16) {
        const uint16_t *b = (const uint16_t *)wp + (size_t)p * kp * PANEL;
        for (int k = 0; k < K; k++) {
            uint32_t u = (uint32_t)b[((size_t)(k / 2) * PANEL + i) * 2 + (k & 1)] << 16;
            memcpy(&out[k], &u, 4);
        }
    } else {
        const float *b = (const float *)wp + (size_t)p * kp * PANEL;
        for (int k = 0; k < K; k++) out[k] = b[(size_t)k * PANEL + i];
    }
}

/* ---------------------------------------------------------------- generic */

static float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void flm_gemm_f32_generic(float *out, int ldo, const float *x, int ldx, const void *wp, int K,
                          int T, int p0, int np, int N) {
    for (int p = p0; p < p0 + np; p++) {
        const float *b = (const float *)wp + (size_t)p * K * PANEL;
        for (int t = 0; t < T; t++) {
            float sum[PANEL] = {0};
            const float *xt = x + (size_t)t * ldx;
            for (int kb = 0; kb < K; kb += KBLOCK) {
                float acc[PANEL] = {0};
                for (int k = kb; k < imin(K, kb + KBLOCK); k++)
                    for (int i = 0; i < PANEL; i++) acc[i] += xt[k] * b[(size_t)k * PANEL + i];
                for (int i = 0; i < PANEL; i++) sum[i] = kb ? sum[i] + acc[i] : acc[i];
            }
            for (int i = 0; i < PANEL && p * PANEL + i < N; i++) out[(size_t)t * ldo + p * PANEL + i] = sum[i];
        }
    }
}

void flm_gemm_bf16_generic(float *out, int ldo, const float *x, int ldx, const void *wp, int K,
                           int T, int p0, int np, int N) {
    const size_t kp = padded_k(K, FLM_BF16);
    for (int p = p0; p < p0 + np; p++) {
        const uint16_t *b = (const uint16_t *)wp + (size_t)p * kp * PANEL;
        for (int t = 0; t < T; t++) {
            float sum[PANEL] = {0};
            const float *xt = x + (size_t)t * ldx;
            for (int kb = 0; kb < K; kb += KBLOCK) {
                float acc[PANEL] = {0};
                for (int k = kb; k < imin(K, kb + KBLOCK); k++)
                    for (int i = 0; i < PANEL; i++)
                        acc[i] += xt[k] * bf16f(b[((size_t)(k / 2) * PANEL + i) * 2 + (k & 1)]);
                for (int i = 0; i < PANEL; i++) sum[i] = kb ? sum[i] + acc[i] : acc[i];
            }
            for (int i = 0; i < PANEL && p * PANEL + i < N; i++) out[(size_t)t * ldo + p * PANEL + i] = sum[i];
        }
    }
}

#ifdef FLM_X86

/* ---- AVX-512: a panel is one vector. Tiles of 6 tokens x 4 panels keep 24
 * accumulators in registers; smaller tiles take the same steps.
 *
 * A batch of tokens walks K in chunks of KC: the 4 panels' weights of one
 * chunk (32 KB of fp32) stay in L1 while every 6-token tile of the batch
 * passes over them, instead of streaming the whole panels from L2 or L3 once
 * per tile. bf16 weights are widened to fp32 once per chunk for the same
 * reason: the tiles then spend their cycles on multiply-adds. Chunks are
 * whole KBLOCKs, and the block sums are added in order, so the chunking does
 * not change a bit of the result. Decoding (T < 6) reads each weight once
 * anyway, and walks K in one piece. */
#define KC 128
#define TILE_T 6

static inline AVX512 __mmask16 row_mask(int p, int N) { return tail_mask(N - p * PANEL); }

/* Add one block's sums into the output (the first block of the row stores). */
static inline AVX512 void flush16(float *o, __m512 acc, __mmask16 m, int first) {
    _mm512_mask_storeu_ps(o, m, first ? acc : _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), acc));
}

/* The kernels take x and the panels already offset to the chunk's first k,
 * nk k steps (a whole number of KBLOCKs except at the end of K), and first
 * when the chunk starts at k = 0. */
#define F32_STEP(W, k) _mm512_loadu_ps((W) + (size_t)(k) * PANEL)

/* The 24 accumulators of a 6-token x 4-panel tile (a<token><panel>), and
 * adding them into the output rows (masks m0..m3) at the end of a block. */
#define TILE_6x4_ZERO                                                                       \
    __m512 z = _mm512_setzero_ps();                                                         \
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;         \
    __m512 a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;         \
    __m512 a40 = z, a41 = z, a42 = z, a43 = z, a50 = z, a51 = z, a52 = z, a53 = z;
#define TILE_ROW_FLUSH(t, f)                                                                \
    flush16(out + (size_t)t * ldo, a##t##0, m0, f);                                         \
    flush16(out + (size_t)t * ldo + 16, a##t##1, m1, f);                                    \
    flush16(out + (size_t)t * ldo + 32, a##t##2, m2, f);                                    \
    flush16(out + (size_t)t * ldo + 48, a##t##3, m3, f);
#define TILE_6x4_FLUSH(first)                                                               \
    {                                                                                       \
        const int f = (first);                                                              \
        TILE_ROW_FLUSH(0, f) TILE_ROW_FLUSH(1, f) TILE_ROW_FLUSH(2, f)                      \
        TILE_ROW_FLUSH(3, f) TILE_ROW_FLUSH(4, f) TILE_ROW_FLUSH(5, f)                      \
    }

static AVX512 void f32_6x4(float *out, int ldo, const float *x, int ldx, const float *b0, size_t ps,
                           int nk, int first, int p, int N) {
    const float *b1 = b0 + ps, *b2 = b1 + ps, *b3 = b2 + ps;
    const float *x0 = x, *x1 = x + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx, *x5 = x4 + ldx;
    const __mmask16 m0 = row_mask(p, N), m1 = row_mask(p + 1, N), m2 = row_mask(p + 2, N), m3 = row_mask(p + 3, N);
    for (int kb = 0; kb < nk; kb += KBLOCK) {
    TILE_6x4_ZERO
    for (int k = kb; k < imin(nk, kb + KBLOCK); k++) {
        __m512 w0 = F32_STEP(b0, k), w1 = F32_STEP(b1, k), w2 = F32_STEP(b2, k), w3 = F32_STEP(b3, k);
        __m512 v;
#define ROW(t)                                                          \
        v = _mm512_set1_ps(x##t[k]);                                    \
        a##t##0 = _mm512_fmadd_ps(v, w0, a##t##0);                      \
        a##t##1 = _mm512_fmadd_ps(v, w1, a##t##1);                      \
        a##t##2 = _mm512_fmadd_ps(v, w2, a##t##2);                      \
        a##t##3 = _mm512_fmadd_ps(v, w3, a##t##3);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
    TILE_6x4_FLUSH(first && kb == 0)
    }
}

/* Decoding streams each panel once, 4 panels side by side: each stream asks
 * for its weights ahead (stream_prefetch, simd.h), which the hardware
 * prefetcher alone does not keep up with. On the 2-core Xeon, 2 KiB ahead
 * into L1, forward_speed's 1.7B shape, tg at 1 / 2 threads: bf16 +13% /
 * +16% (AVX512-BF16) and +17% / +13% (AVX-512), f32 +6% / +6%; the 135M
 * shape's bf16 +11% and f32 level at 2 threads. */
#define PREFETCH(W) stream_prefetch(pf, W)   /* pf: the kernel's stream_prefetch_now() */

static AVX512 void f32_1x4(float *out, const float *x, const float *b0, size_t ps, int nk, int first,
                           int p, int N) {
    const StreamPrefetch pf = stream_prefetch_now();
    const float *b1 = b0 + ps, *b2 = b1 + ps, *b3 = b2 + ps;
    for (int kb = 0; kb < nk; kb += KBLOCK) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int k = kb; k < imin(nk, kb + KBLOCK); k++) {
            __m512 v = _mm512_set1_ps(x[k]);
            PREFETCH(b0 + (size_t)k * PANEL); PREFETCH(b1 + (size_t)k * PANEL);
            PREFETCH(b2 + (size_t)k * PANEL); PREFETCH(b3 + (size_t)k * PANEL);
            a0 = _mm512_fmadd_ps(v, F32_STEP(b0, k), a0);
            a1 = _mm512_fmadd_ps(v, F32_STEP(b1, k), a1);
            a2 = _mm512_fmadd_ps(v, F32_STEP(b2, k), a2);
            a3 = _mm512_fmadd_ps(v, F32_STEP(b3, k), a3);
        }
        const int f = first && kb == 0;
        flush16(out, a0, row_mask(p, N), f);
        flush16(out + 16, a1, row_mask(p + 1, N), f);
        flush16(out + 32, a2, row_mask(p + 2, N), f);
        flush16(out + 48, a3, row_mask(p + 3, N), f);
    }
}

static AVX512 void f32_1x1(float *out, const float *x, const float *b0, int nk, int first, int p, int N) {
    for (int kb = 0; kb < nk; kb += KBLOCK) {
        __m512 a = _mm512_setzero_ps();
        for (int k = kb; k < imin(nk, kb + KBLOCK); k++)
            a = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), F32_STEP(b0, k), a);
        flush16(out, a, row_mask(p, N), first && kb == 0);
    }
}

/* bf16 pairs: the low half of each 32-bit lane is k even, the high half k odd. */
#define BF_LO(v) _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
#define BF_HI(v) _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)))
#define BF_PAIR(W, j) _mm512_loadu_si512((const void *)((W) + (size_t)(j) * 2 * PANEL))

/* Decoding with bf16 weights: one token, panels read straight from memory. */
static AVX512 void bf16_1x1(float *out, const float *x, const uint16_t *b0, int K, int p, int N) {
    const StreamPrefetch pf = stream_prefetch_now();
    for (int kb = 0; kb < K; kb += KBLOCK) {
        __m512 a = _mm512_setzero_ps();
        for (int k = kb; k < imin(K, kb + KBLOCK); k += 2) {
            PREFETCH(b0 + (size_t)k * PANEL);
            __m512i q = BF_PAIR(b0, k / 2);
            a = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), BF_LO(q), a);
            if (k + 1 < K) a = _mm512_fmadd_ps(_mm512_set1_ps(x[k + 1]), BF_HI(q), a);
        }
        flush16(out, a, row_mask(p, N), kb == 0);
    }
}

/* Panel p's bf16 weights for k = 0 .. nk-1 (from a chunk start), as fp32 panel rows. */
static AVX512 void widen_panel(float *dst, const uint16_t *src, int nk) {
    for (int j = 0; j < (nk + 1) / 2; j++) {
        __m512i q = BF_PAIR(src, j);
        _mm512_storeu_ps(dst + (size_t)2 * j * PANEL, BF_LO(q));
        _mm512_storeu_ps(dst + (size_t)(2 * j + 1) * PANEL, BF_HI(q));
    }
}

/* Panels p .. p+g-1 (g <= 4) of a chunk for tokens 0..T-1: 6x4 tiles where
 * they fit, one token x 4 panels for leftover tokens, one panel at a time
 * for a group of fewer than 4. */
static AVX512 void f32_tiles(float *out, int ldo, const float *x, int ldx, const float *w, size_t ps,
                             int nk, int first, int T, int p, int g, int N) {
    for (int t = 0; t < T;) {
        const int nt = T - t >= TILE_T ? TILE_T : 1;
        float *o = out + (size_t)t * ldo;
        const float *xt = x + (size_t)t * ldx;
        if (g == 4 && nt == TILE_T) f32_6x4(o, ldo, xt, ldx, w, ps, nk, first, p, N);
        else if (g == 4) f32_1x4(o, xt, w, ps, nk, first, p, N);
        else
            for (int u = 0; u < nt; u++)
                for (int i = 0; i < g; i++)
                    f32_1x1(o + (size_t)u * ldo + i * PANEL, xt + (size_t)u * ldx, w + i * ps, nk, first,
                            p + i, N);
        t += nt;
    }
}

static AVX512 void gemm_avx512(int bf16, float *out, int ldo, const float *x, int ldx, const void *wp,
                               int K, int T, int p0, int np, int N) {
    const size_t ps = bf16 ? padded_k(K, FLM_BF16) * PANEL : (size_t)K * PANEL;
    if (bf16 && T < TILE_T) {
        for (int t = 0; t < T; t++)
            for (int p = p0; p < p0 + np; p++)
                bf16_1x1(out + (size_t)t * ldo + p * PANEL, x + (size_t)t * ldx,
                         (const uint16_t *)wp + p * ps, K, p, N);
        return;
    }
    float wide[4 * KC * PANEL] __attribute__((aligned(64)));
    const int chunk = T >= TILE_T ? KC : K;
    for (int kc = 0; kc < K; kc += chunk) {
        const int nk = imin(chunk, K - kc);
        for (int p = p0; p < p0 + np; p += 4) {
            const int g = imin(4, p0 + np - p);
            float *o = out + p * PANEL;
            if (bf16) {
                for (int i = 0; i < g; i++)
                    widen_panel(wide + (size_t)i * KC * PANEL, (const uint16_t *)wp + (p + i) * ps + (size_t)kc * PANEL, nk);
                f32_tiles(o, ldo, x + kc, ldx, wide, (size_t)KC * PANEL, nk, kc == 0, T, p, g, N);
            } else {
                f32_tiles(o, ldo, x + kc, ldx, (const float *)wp + p * ps + (size_t)kc * PANEL, ps, nk,
                          kc == 0, T, p, g, N);
            }
        }
    }
}

AVX512 void flm_gemm_f32_avx512(float *out, int ldo, const float *x, int ldx, const void *wp, int K,
                                int T, int p0, int np, int N) {
    gemm_avx512(0, out, ldo, x, ldx, wp, K, T, p0, np, N);
}

AVX512 void flm_gemm_bf16_avx512(float *out, int ldo, const float *x, int ldx, const void *wp, int K,
                                 int T, int p0, int np, int N) {
    gemm_avx512(1, out, ldo, x, ldx, wp, K, T, p0, np, N);
}

/* ---- AVX512_BF16: x arrives as bf16 pairs (one 32-bit word per k pair), and
 * one vdpbf16ps adds both products of a pair to each row's lane. The kernels
 * count in pairs: x and the panels offset to the chunk's first pair, nj
 * pairs. */
#define DP(acc, xw, wv) (acc) = _mm512_dpbf16_ps((acc), (__m512bh)_mm512_set1_epi32((int)(xw)), (__m512bh)(wv))
#define JBLOCK (KBLOCK / 2)

static AVX512BF16 void dp_6x4(float *out, int ldo, const uint32_t *x, int ldx, const uint16_t *b0,
                          size_t ps, int nj, int first, int p, int N) {
    const uint16_t *b1 = b0 + ps, *b2 = b1 + ps, *b3 = b2 + ps;
    const uint32_t *x0 = x, *x1 = x + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx, *x5 = x4 + ldx;
    const __mmask16 m0 = row_mask(p, N), m1 = row_mask(p + 1, N), m2 = row_mask(p + 2, N), m3 = row_mask(p + 3, N);
    for (int jb = 0; jb < nj; jb += JBLOCK) {
        TILE_6x4_ZERO
        for (int j = jb; j < imin(nj, jb + JBLOCK); j++) {
            __m512i q0 = BF_PAIR(b0, j), q1 = BF_PAIR(b1, j), q2 = BF_PAIR(b2, j), q3 = BF_PAIR(b3, j);
#define ROW(t) DP(a##t##0, x##t[j], q0); DP(a##t##1, x##t[j], q1); DP(a##t##2, x##t[j], q2); DP(a##t##3, x##t[j], q3);
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
        }
        TILE_6x4_FLUSH(first && jb == 0)
    }
}

static AVX512BF16 void dp_1x4(float *out, const uint32_t *x, const uint16_t *b0, size_t ps, int nj, int first,
                          int p, int N) {
    const StreamPrefetch pf = stream_prefetch_now();
    const uint16_t *b1 = b0 + ps, *b2 = b1 + ps, *b3 = b2 + ps;
    for (int jb = 0; jb < nj; jb += JBLOCK) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int j = jb; j < imin(nj, jb + JBLOCK); j++) {
            PREFETCH(b0 + (size_t)j * 2 * PANEL); PREFETCH(b1 + (size_t)j * 2 * PANEL);
            PREFETCH(b2 + (size_t)j * 2 * PANEL); PREFETCH(b3 + (size_t)j * 2 * PANEL);
            DP(a0, x[j], BF_PAIR(b0, j)); DP(a1, x[j], BF_PAIR(b1, j));
            DP(a2, x[j], BF_PAIR(b2, j)); DP(a3, x[j], BF_PAIR(b3, j));
        }
        const int f = first && jb == 0;
        flush16(out, a0, row_mask(p, N), f);
        flush16(out + 16, a1, row_mask(p + 1, N), f);
        flush16(out + 32, a2, row_mask(p + 2, N), f);
        flush16(out + 48, a3, row_mask(p + 3, N), f);
    }
}

static AVX512BF16 void dp_1x1(float *out, const uint32_t *x, const uint16_t *b0, int nj, int first, int p, int N) {
    for (int jb = 0; jb < nj; jb += JBLOCK) {
        __m512 a = _mm512_setzero_ps();
        for (int j = jb; j < imin(nj, jb + JBLOCK); j++) DP(a, x[j], BF_PAIR(b0, j));
        flush16(out, a, row_mask(p, N), first && jb == 0);
    }
}

AVX512BF16 void flm_gemm_bf16_dp_avx512(float *out, int ldo, const float *xf, int ldx, const void *wp, int K,
                                    int T, int p0, int np, int N) {
    const uint32_t *x = (const uint32_t *)xf;
    const size_t ps = padded_k(K, FLM_BF16) * PANEL;
    const int pairs = (K + 1) / 2, chunk = T >= TILE_T ? KC : 2 * pairs;
    for (int jc = 0; jc < pairs; jc += chunk / 2) {
        const int nj = imin(chunk / 2, pairs - jc);
        for (int p = p0; p < p0 + np; p += 4) {
            const int g = imin(4, p0 + np - p);
            const uint16_t *w = (const uint16_t *)wp + p * ps + (size_t)jc * 2 * PANEL;
            for (int t = 0; t < T;) {
                const int nt = T - t >= TILE_T ? TILE_T : 1;
                float *o = out + (size_t)t * ldo + p * PANEL;
                const uint32_t *xt = x + (size_t)t * ldx + jc;
                if (g == 4 && nt == TILE_T) dp_6x4(o, ldo, xt, ldx, w, ps, nj, jc == 0, p, N);
                else if (g == 4) dp_1x4(o, xt, w, ps, nj, jc == 0, p, N);
                else
                    for (int u = 0; u < nt; u++)
                        for (int i = 0; i < g; i++)
                            dp_1x1(o + (size_t)u * ldo + i * PANEL, xt + (size_t)u * ldx, w + i * ps, nj,
                                   jc == 0, p + i, N);
                t += nt;
            }
        }
    }
}

AVX512BF16 void flm_to_bf16_avx512(uint16_t *dst, const float *src, int n) {
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
        _mm512_storeu_si512((void *)(dst + i), (__m512i)v);
    }
    for (; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i));
        _mm256_mask_storeu_epi16(dst + i, m, (__m256i)v);
    }
    if (n & 1) dst[n] = 0;
}

#ifdef FLM_AMX
/* ---- AMX-BF16: bf16 weights times bf16 activations on the tile unit.
 *
 * A panel's bf16 pairs ([k/2][16 rows][2]) are already the layout a tile
 * multiply wants for its second operand: 16 pairs of one panel are one 1 KB
 * tile (16 rows of 64 bytes). The activations, rounded to bf16 pairs as for
 * avx512_bf16, give the first operand: up to 16 tokens x 16 pairs. Each
 * product adds into 16 tokens x 16 rows of fp32 sums held in a tile across
 * the whole of K. Tiles: 0-3 sums (token group a, panel b at 2a+b), 4-5 two
 * token groups, 6-7 two panels. A token's sums never depend on the other rows
 * of its tile, so batched and one-token passes agree bit for bit; the last
 * step of an odd K is zero-padded in a copy. */

typedef struct {
    uint8_t palette, start_row, zero[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile 16 rows of 64 bytes, except the first token group (and its
 * sums) when fewer than 16 tokens are left. */
static AMX void tile_config(int rows) {
    TileConfig c __attribute__((aligned(64)));
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)rows;
    _tile_loadconfig(&c);
}

/* Rows r < rows of a 16x16 sum tile into out (token stride ldo), panel p. */
static AMX void store_sums(float *out, int ldo, const float *sums, int rows, int p, int N) {
    for (int r = 0; r < rows; r++)
        _mm512_mask_storeu_ps(out + (size_t)r * ldo, row_mask(p, N), _mm512_load_ps(sums + r * PANEL));
}

AMX void flm_gemm_bf16_amx(float *out, int ldo, const float *xf, int ldx, const void *wp, int K, int T,
                           int p0, int np, int N) {
    const uint32_t *x = (const uint32_t *)xf;
    const size_t ps = padded_k(K, FLM_BF16) * PANEL;
    const int pairs = (K + 1) / 2, full = pairs / 16 * 16, rem = pairs - full;
    uint32_t xtail[32 * 16] __attribute__((aligned(64)));
    uint16_t wtail[2][16 * 2 * PANEL] __attribute__((aligned(64)));
    float sums[16 * PANEL] __attribute__((aligned(64)));
    int configured = 0;
    for (int t = 0; t < T;) {
        const int two = T - t >= 32, rows = two ? 16 : imin(16, T - t), tokens = two ? 32 : rows;
        if (rows != configured) {
            tile_config(rows);
            configured = rows;
        }
        const uint32_t *xa = x + (size_t)t * ldx, *xb = xa + (size_t)16 * ldx;
        if (rem) {
            memset(xtail, 0, sizeof xtail);
            for (int u = 0; u < tokens; u++) memcpy(xtail + u * 16, xa + (size_t)u * ldx + full, rem * 4);
        }
        for (int p = p0; p < p0 + np; p += 2) {
            const int both = p + 1 < p0 + np;
            const uint16_t *b0 = (const uint16_t *)wp + p * ps, *b1 = b0 + ps;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int j = 0; j < full; j += 16) {
                _tile_loadd(4, xa + j, ldx * 4);
                _tile_loadd(6, b0 + (size_t)j * 2 * PANEL, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(5, xb + j, ldx * 4);
                    _tile_dpbf16ps(2, 5, 6);
                }
                if (both) {
                    _tile_loadd(7, b1 + (size_t)j * 2 * PANEL, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            if (rem) {
                memset(wtail, 0, sizeof wtail);
                memcpy(wtail[0], b0 + (size_t)full * 2 * PANEL, (size_t)rem * 4 * PANEL);
                if (both) memcpy(wtail[1], b1 + (size_t)full * 2 * PANEL, (size_t)rem * 4 * PANEL);
                _tile_loadd(4, xtail, 64);
                _tile_loadd(6, wtail[0], 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(5, xtail + 16 * 16, 64);
                    _tile_dpbf16ps(2, 5, 6);
                }
                if (both) {
                    _tile_loadd(7, wtail[1], 64);
                    _tile_dpbf16ps(1, 4, 7);
                    if (two) _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *o = out + (size_t)t * ldo + p * PANEL;
            _tile_stored(0, sums, 64);
            store_sums(o, ldo, sums, rows, p, N);
            if (both) {
                _tile_stored(1, sums, 64);
                store_sums(o + PANEL, ldo, sums, rows, p + 1, N);
            }
            if (two) {
                _tile_stored(2, sums, 64);
                store_sums(o + (size_t)16 * ldo, ldo, sums, 16, p, N);
                if (both) {
                    _tile_stored(3, sums, 64);
                    store_sums(o + (size_t)16 * ldo + PANEL, ldo, sums, 16, p + 1, N);
                }
            }
        }
        t += tokens;
    }
    _tile_release();
}
#endif /* FLM_AMX */

/* ---- AVX2: a panel is two vectors; tiles of 4 tokens x 1 panel. */

/* Add one block's sums of rows row0.. into the output (the first block stores). */
static inline AVX2 void flush8(float *out, __m256 v, int row0, int N, int first) {
    if (N - row0 >= 8) {
        _mm256_storeu_ps(out, first ? v : _mm256_add_ps(_mm256_loadu_ps(out), v));
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        for (int i = 0; i < N - row0; i++) out[i] = first ? tmp[i] : out[i] + tmp[i];
    }
}

#define BF8_LO(v) _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
#define BF8_HI(v) _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000)))

/* The panel's weights are asked for ahead (PREFETCH, above), as in the
 * AVX-512 kernels: on the 2-core Xeon with
 * FASTLLM_SIMD=avx2, forward_speed's 1.7B shape decoded bf16 +21% / +15%
 * and f32 +14% / +13% at 1 / 2 threads; the 135M shape's f32 prompt
 * (pp128) level. */
/* One panel for nt <= 4 tokens; bf16 selects the weight format. */
static inline __attribute__((always_inline)) AVX2 void panel_avx2(
        int bf16, float *out, int ldo, const float *x, int ldx, const void *b, int K, int nt, int p, int N) {
    const StreamPrefetch pf = stream_prefetch_now();
    const float *x0 = x, *x1 = x + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    const int r = p * PANEL;
    for (int kb = 0; kb < K; kb += KBLOCK) {
        const int kend = imin(K, kb + KBLOCK);
        __m256 z = _mm256_setzero_ps();
        __m256 l0 = z, h0 = z, l1 = z, h1 = z, l2 = z, h2 = z, l3 = z, h3 = z;
#define ACC(t, kk, lo, hi)                                              \
        if (nt > t) {                                                   \
            __m256 v = _mm256_set1_ps(x##t[kk]);                        \
            l##t = _mm256_fmadd_ps(v, lo, l##t);                        \
            h##t = _mm256_fmadd_ps(v, hi, h##t);                        \
        }
        if (bf16) {
            const uint16_t *w = (const uint16_t *)b;
            for (int k = kb; k < kend; k += 2) {
                PREFETCH(w + (size_t)k * PANEL);
                __m256i q0 = _mm256_loadu_si256((const __m256i *)(w + (size_t)k * PANEL));
                __m256i q1 = _mm256_loadu_si256((const __m256i *)(w + (size_t)k * PANEL + 16));
                __m256 lo = BF8_LO(q0), hi = BF8_LO(q1);
                ACC(0, k, lo, hi) ACC(1, k, lo, hi) ACC(2, k, lo, hi) ACC(3, k, lo, hi)
                if (k + 1 < K) {
                    lo = BF8_HI(q0); hi = BF8_HI(q1);
                    ACC(0, k + 1, lo, hi) ACC(1, k + 1, lo, hi) ACC(2, k + 1, lo, hi) ACC(3, k + 1, lo, hi)
                }
            }
        } else {
            const float *w = (const float *)b;
            for (int k = kb; k < kend; k++) {
                PREFETCH(w + (size_t)k * PANEL);
                __m256 lo = _mm256_loadu_ps(w + (size_t)k * PANEL), hi = _mm256_loadu_ps(w + (size_t)k * PANEL + 8);
                ACC(0, k, lo, hi) ACC(1, k, lo, hi) ACC(2, k, lo, hi) ACC(3, k, lo, hi)
            }
        }
#undef ACC
        __m256 ls[4] = {l0, l1, l2, l3}, hs[4] = {h0, h1, h2, h3};
        for (int t = 0; t < nt; t++) {
            flush8(out + (size_t)t * ldo, ls[t], r, N, kb == 0);
            if (N - r > 8) flush8(out + (size_t)t * ldo + 8, hs[t], r + 8, N, kb == 0);
        }
    }
}

/* The AVX2 bf16 pair layout differs from AVX-512's: one k pair of rows 0-7
 * is the first 32 bytes of the 64 (rows' pairs interleaved), so the lanes
 * of q0 are rows 0-7 and q1 rows 8-15, as in the packed format. */
AVX2 void flm_gemm_f32_avx2(float *out, int ldo, const float *x, int ldx, const void *wp, int K,
                       int T, int p0, int np, int N) {
    const size_t ps = (size_t)K * PANEL;
    for (int t = 0; t < T; t += 4)
        for (int p = p0; p < p0 + np; p++)
            panel_avx2(0, out + (size_t)t * ldo + p * PANEL, ldo, x + (size_t)t * ldx, ldx,
                       (const float *)wp + p * ps, K, imin(4, T - t), p, N);
}

AVX2 void flm_gemm_bf16_avx2(float *out, int ldo, const float *x, int ldx, const void *wp, int K,
                        int T, int p0, int np, int N) {
    const size_t ps = padded_k(K, FLM_BF16) * PANEL;
    for (int t = 0; t < T; t += 4)
        for (int p = p0; p < p0 + np; p++)
            panel_avx2(1, out + (size_t)t * ldo + p * PANEL, ldo, x + (size_t)t * ldx, ldx,
                       (const uint16_t *)wp + p * ps, K, imin(4, T - t), p, N);
}
#endif
