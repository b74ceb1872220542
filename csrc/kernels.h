/* SIMD kernels behind one table, chosen at run time by CPU feature detection,
 * so a wheel built without -march=native still runs the widest path the CPU
 * has. Each path computes every output with a fixed order of operations that
 * does not depend on how many rows or tokens are processed together: batched
 * prefill and one-token decoding give identical results. */
#ifndef FASTLLM_KERNELS_H
#define FASTLLM_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* out[t*ldo + r] = sum_k x[t*ldx + k] * w[r*ldw + k]  for t < nt <= 4, r < nr <= 4,
 * k < K. w is float (FLM_F32) or bf16 bit patterns (FLM_BF16). */
typedef void (*flm_tile_fn)(float *out, int ldo, const float *x, int ldx,
                            const void *w, size_t ldw, int K, int nt, int nr);

typedef struct {
    const char *name;
    flm_tile_fn tile_f32;
    flm_tile_fn tile_bf16;
    /* x[i] = exp(x[i] - max) for i < n; returns the sum of the new x. */
    float (*exp_sum)(float *x, int n, float max);
    /* out[d] = sum_j p[j] * v[j*ldv + d] for d < dim, j < n (j in order). */
    void (*weighted_sum)(float *out, const float *p, const float *v, int n, size_t ldv, int dim);
} FlmKernels;

extern const FlmKernels *flm_kernels;
void flm_kernels_init(void);
int flm_kernels_select(const char *name);

#define FLM_TILE_T 4
#define FLM_TILE_R 4

#endif
