/* SIMD kernels behind one table, chosen at run time by CPU feature detection,
 * so a wheel built without -march=native still runs the widest path the CPU
 * has. Each path computes every output with a fixed order of operations that
 * does not depend on how many rows or tokens are processed together: batched
 * prefill and one-token decoding give identical results. */
#ifndef FASTLLM_KERNELS_H
#define FASTLLM_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fastllm.h"
#include "gemm.h"

typedef struct {
    const char *name;
    flm_gemm_fn gemm_f32;     /* packed weights */
    flm_gemm_fn gemm_bf16;
    /* Where set, bf16 weights multiply bf16 activations (AVX512_BF16
     * dot products): matmul inputs are first rounded by to_bf16 (n values,
     * nearest-even, zero-padded to even n), and gemm_bf16 then reads x as
     * pairs of bf16, with ldx counted in pairs. */
    void (*to_bf16)(uint16_t *dst, const float *src, int n);
    /* att[j] = q . key j for j < n, keys in blocks of 16 ((hd, 16) each),
     * stored as kv (FLM_F32, FLM_BF16, FLM_F16); att must have room for n
     * rounded up to 16. */
    void (*key_scores)(float *att, const float *q, const void *kblocks, int n, int hd, int kv);
    /* x[i] = exp(x[i] - max) for i < n; returns the sum of the new x. */
    float (*exp_sum)(float *x, int n, float max);
    /* Two queries of one head at consecutive positions, where a path has
     * them (else NULL): key_scores of q0 and of q1 over the same n keys,
     * and weighted_sum of p0 over n keys and of p1 over n + 1, each output
     * summed exactly as the one-query kernels sum it. */
    void (*key_scores2)(float *att0, float *att1, const float *q0, const float *q1, const void *kblocks, int n,
                        int hd, int kv);
    void (*weighted_sum2)(float *out0, float *out1, const float *p0, const float *p1, const void *v, int n,
                          size_t ldv, int dim, int kv);
    /* x[i] *= s for i < n; returns the largest new x (NaN ignored). */
    float (*scale_max)(float *x, int n, float s);
    /* x[i] *= s for i < n. */
    void (*scale)(float *x, int n, float s);
    /* out[d] = sum_j p[j] * v[j*ldv + d] for d < dim, j < n (j in order), v
     * stored as kv. */
    void (*weighted_sum)(float *out, const float *p, const void *v, int n, size_t ldv, int dim, int kv);
    /* One token of the gated delta rule on a (dk, dv) state S:
     * S = decay*S; d = beta*(v - S^T k); S += k d^T; o = S^T q. */
    void (*delta_rule)(float *S, const float *q, const float *k, const float *v, float beta,
                       float decay, int dk, int dv, float *o);
    /* Causal depthwise conv of kernel K and SiLU over n channels of T
     * consecutive tokens: x[t*ldx + c] becomes silu(sum_j w[c*K + j] *
     * in[t-K+1+j][c]), summed j = 0 .. K-1 in order, where the inputs before
     * token 0 are win[j*ldw + c] (j < K-1, oldest first); win ends holding
     * the last K-1 inputs. */
    void (*conv_silu)(float *x, size_t ldx, int T, float *win, size_t ldw, const float *w, int K, int n);
    /* out = weight * (x / sqrt(mean(x^2) + eps)); out may be x. */
    void (*rmsnorm)(float *out, const float *x, const float *weight, int n, float eps);
    /* g = silu(g) * u */
    void (*silu_mul)(float *g, const float *u, int n);
    /* g = gelu(g) * u, GeLU's tanh approximation:
     * gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    void (*gelu_tanh_mul)(float *g, const float *u, int n);
    /* x[i] = cap * tanh(x[i] / cap) for i < n (soft-capping); returns the
     * largest new x (NaN ignored). */
    float (*softcap_max)(float *x, int n, float cap);
    /* Tokens per parallel work item of a batched matmul: a whole number
     * of the gemm's token tiles. */
    int token_block;
} FlmKernels;

extern const FlmKernels *flm_kernels;

/* Scalar conversions of the 16-bit formats, rounding to nearest-even. */
static inline float flm_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t flm_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float flm_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    float f;
    if (exp == 0x1F) {
        u = sign | 0x7F800000 | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else {  /* zero or subnormal: man * 2^-24, exact in fp32 */
        f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t flm_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7FFFFFFF;
    if (u > 0x7F800000) return sign | 0x7E00;              /* NaN */
    if (u >= 0x477FF000) return sign | 0x7C00;             /* rounds past 65504: infinity */
    if (u < 0x38800000) {                                  /* below 2^-14: subnormal */
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint16_t)lrintf(a * 16777216.0f);   /* in units of 2^-24 */
    }
    return sign | (uint16_t)((u + 0xFFF + ((u >> 13) & 1) - 0x38000000) >> 13);
}

/* Element i of a KV cache array stored as kv. */
static inline float flm_kv_at(const void *p, size_t i, int kv) {
    if (kv == FLM_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return kv == FLM_BF16 ? flm_bf16_to_f32(h) : flm_f16_to_f32(h);
}

void flm_kernels_init(void);
int flm_kernels_select(const char *name);

#endif
