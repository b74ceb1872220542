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
#include "quant.h"
#include "types.h"

typedef struct {
    const char *name;
    flm_gemm_fn gemm_f32;     /* packed weights */
    flm_gemm_fn gemm_bf16;
    /* Where set, bf16 weights multiply bf16 activations (AVX512_BF16 or
     * BFDOT dot products): matmul inputs are first rounded by to_bf16 (n
     * values, nearest-even, zero-padded to even n; AVX512_BF16's conversion
     * turns subnormal inputs into signed zeros), and gemm_bf16 then reads x
     * as pairs of bf16, with ldx counted in pairs. */
    void (*to_bf16)(uint16_t *dst, const float *src, int n);
    /* Quantized weights multiply int8 activations (quant.h): quantize_q8
     * makes the blocks, qgemm multiplies them; int8_name names the pair. */
    const char *int8_name;
    flm_qgemm_fn qgemm;
    void (*quantize_q8)(FlmQ8 *dst, const float *x, int K);
    /* Scores of nq queries against the same keys: att[i*lda + j] = q[i] .
     * key j for j < n, keys in blocks of 16 ((hd, 16) each) stored as kv
     * (FLM_F32, FLM_BF16, FLM_F16); each row of att must have room for n
     * rounded up to 16. Each score is one chain of multiply-adds over the
     * dims in order, whatever nq: a query's scores are those it gets alone. */
    void (*key_scores)(float *att, size_t lda, const float *const *q, int nq, const void *kblocks, int n, int hd,
                       int kv);
    /* x[i] = exp(x[i] - max) for i < n; returns the sum of the new x. */
    float (*exp_sum)(float *x, int n, float max);
    /* x[i] *= s for i < n; returns the largest new x (NaN ignored). */
    float (*scale_max)(float *x, int n, float s);
    /* x[i] *= s for i < n. */
    void (*scale)(float *x, int n, float s);
    /* out[i*ldo + d] += sum_j p[i*ldp + j] * v[j*ldv + d] for i < nq, d <
     * dim, j < n, v stored as kv: each output one chain of multiply-adds
     * over j in order, continuing from what out holds (so a range of
     * values summed in parts gives the bits of one call), whatever nq. */
    void (*weighted_sum)(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v, int n,
                         size_t ldv, int dim, int kv);
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

void flm_kernels_init(void);
int flm_kernels_select(const char *name);

/* ---- The paths kernels.c chooses among */

/* The portable path (kernels_generic.c). */
extern const FlmKernels flm_kernels_generic;
/* This architecture's paths (kernels_x86.c, kernels_arm64.c), widest
 * first, NULL-ended; whether this CPU can run path k; and the table as
 * this CPU runs it (an AVX-512 CPU without VNNI takes AVX2's int8 matmul). */
extern const FlmKernels *const flm_arch_paths[];
int flm_arch_supported(const FlmKernels *k);
void flm_arch_adapt(FlmKernels *k);
/* How many bytes ahead, into which cache level (1 or 2), this
 * architecture's kernels ask for the weights they stream: set (for
 * benchmarks; it then holds whatever path is chosen) and read. Both return
 * -1 where the architecture's kernels do not prefetch, or (set) where bytes
 * is not a multiple of 64 in 0 .. 65536 or level not 1 or 2. */
int flm_arch_set_stream_prefetch(int bytes, int level);
int flm_arch_stream_prefetch(int *bytes, int *level);

/* The portable kernels that SIMD paths keep where they have no faster form. */
float flm_exp_sum_generic(float *x, int n, float max);
float flm_scale_max_generic(float *x, int n, float s);
void flm_scale_generic(float *x, int n, float s);
void flm_delta_rule_generic(float *S, const float *q, const float *k, const float *v, float beta, float decay,
                            int dk, int dv, float *o);
void flm_rmsnorm_generic(float *out, const float *x, const float *weight, int n, float eps);
void flm_silu_mul_generic(float *g, const float *u, int n);

/* ---- What the paths' kernels share (kernels_generic.c, kernels_x86.c, kernels_arm64.c) */

/* GeLU's tanh approximation, its terms in the order PyTorch's CPU kernel
 * takes them. */
#define GELU_BETA 0.7978845608028654f   /* sqrt(2/pi) */
#define GELU_KAPPA 0.044715f

/* tanh(x): below |x| = TANH_SMALL an odd polynomial (Cephes' tanhf), above
 * it 1 - 2 / (exp(2|x|) + 1) with x's sign; within a few ulp of tanhf. */
#define TANH_SMALL 0.625f
#define TANH_P4 -5.70498872745e-3f
#define TANH_P3 2.06390887954e-2f
#define TANH_P2 -5.37397155531e-2f
#define TANH_P1 1.33314422036e-1f
#define TANH_P0 -3.33332819422e-1f

/* exp(x) is taken as exactly 0 below EXP_LOWEST: below about -87.3 it is
 * subnormal, and Intel cores take a microcode assist for each subnormal
 * result and for each operation that reads one (in forward_speed's random
 * 1.7B shape, 70% of the softmax's and of SiLU's time on the 2-core Xeon).
 * A sum moves by less than 2e-38. */
#define EXP_LOWEST (-87.0f)

/* Products and sums rounded one by one, as the generic loop rounds them,
 * whatever -ffp-contract the build uses: a fused multiply-add in the conv
 * moves its outputs by an ulp, which int8 activations can turn into a
 * whole quantization step. */
#if defined(__GNUC__) && !defined(__clang__)
#define UNFUSED __attribute__((optimize("fp-contract=off")))
#else
#define UNFUSED
#endif

/* One copy of each loop per storage type of the KV cache, so the type is
 * not tested per load. */
#define KV_DISPATCH(call, kv) \
    do { if ((kv) == FLM_F32) call(FLM_F32); else if ((kv) == FLM_BF16) call(FLM_BF16); else call(FLM_F16); } while (0)

/* Scores and weighted sums over a q8_0 KV cache (FLM_KV_Q8_BYTES: types.h),
 * portably: each score sums q . key over each 32 dims in order, then the
 * groups times their scales in order; each value's weight is p times its
 * group's scale. The vector paths compute the same sums in the same order. */
static inline void flm_key_scores_q8(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n,
                                     int hd) {
    for (int b = 0; b < n; b += 16) {
        const int8_t *k = (const int8_t *)((const char *)kb + b / 16 * FLM_KV_Q8_BYTES(16 * (size_t)hd));
        const uint16_t *sc = (const uint16_t *)(k + 16 * hd);
        for (int i = 0; i < nq; i++) {
            float acc[16] = {0};
            for (int g = 0; g < hd; g += 32) {
                float part[16] = {0};
                for (int d = g; d < g + 32; d++)
                    for (int j = 0; j < 16; j++) part[j] = __builtin_fmaf(q[i][d], (float)k[d * 16 + j], part[j]);
                for (int j = 0; j < 16; j++) acc[j] = __builtin_fmaf(part[j], flm_f16_to_f32(sc[g / 32 * 16 + j]), acc[j]);
            }
            for (int j = 0; j < 16; j++) att[i * lda + b + j] = acc[j];
        }
    }
}

static inline void flm_weighted_sum_q8(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v,
                                       int n, size_t ldv, int dim) {
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < n; j++) {
            const int8_t *r = (const int8_t *)((const char *)v + j * FLM_KV_Q8_BYTES(ldv));
            const uint16_t *sc = (const uint16_t *)(r + ldv);
            for (int d = 0; d < dim; d++)
                out[i * ldo + d] = __builtin_fmaf(p[i * ldp + j] * flm_f16_to_f32(sc[d / 32]), (float)r[d],
                                                  out[i * ldo + d]);
        }
}

/* The vector convs keep a kernel's taps in registers; wider kernels take
 * the portable loop. */
#define CONV_MAX_K 8
void flm_conv_silu_generic(float *x, size_t ldx, int T, float *win, size_t ldw, const float *w, int K, int n);

#endif
