/* SIMD kernels behind one table, chosen at run time by CPU feature detection,
 * so a wheel built without -march=native still runs the widest path the CPU
 * has. Each path computes every output with a fixed order of operations that
 * does not depend on how many rows or tokens are processed together: batched
 * prefill and one-token decoding give identical results. */
#ifndef FASTLLM_KERNELS_H
#define FASTLLM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

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
    /* att[j] = q . key j for j < n, keys in blocks of 16 ((hd, 16) each);
     * att must have room for n rounded up to 16. */
    void (*key_scores)(float *att, const float *q, const float *kblocks, int n, int hd);
    /* x[i] = exp(x[i] - max) for i < n; returns the sum of the new x. */
    float (*exp_sum)(float *x, int n, float max);
    /* out[d] = sum_j p[j] * v[j*ldv + d] for d < dim, j < n (j in order). */
    void (*weighted_sum)(float *out, const float *p, const float *v, int n, size_t ldv, int dim);
    /* One token of the gated delta rule on a (dk, dv) state S:
     * S = decay*S; d = beta*(v - S^T k); S += k d^T; o = S^T q. */
    void (*delta_rule)(float *S, const float *q, const float *k, const float *v, float beta,
                       float decay, int dk, int dv, float *o);
    /* out = weight * (x / sqrt(mean(x^2) + eps)); out may be x. */
    void (*rmsnorm)(float *out, const float *x, const float *weight, int n, float eps);
    /* g = silu(g) * u */
    void (*silu_mul)(float *g, const float *u, int n);
    /* Tokens per parallel work item of a batched matmul: a whole number
     * of the gemm's token tiles. */
    int token_block;
} FlmKernels;

extern const FlmKernels *flm_kernels;

void flm_kernels_init(void);
int flm_kernels_select(const char *name);

#endif
