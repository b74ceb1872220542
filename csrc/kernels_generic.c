/* The portable kernels: attention, softmax, the delta rule, the conv and
 * the elementwise kernels (SiLU, GeLU, tanh soft-cap) in plain C, and the
 * generic path's table. The SIMD paths (kernels_x86.c, kernels_arm64.c)
 * keep the ones they have no faster form of. */
#include "kernels.h"
#include "quant.h"

#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------- generic */

/* Eight partial sums, reduced pairwise at the end. */
#define GENERIC_LANES 8

static inline float reduce8(const float *acc) {
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* exp(x), 0 below EXP_LOWEST (kernels.h says why; the AVX2 path runs
 * these loops). */
static inline float exp_normal(float x) { return x < EXP_LOWEST ? 0.0f : expf(x); }

static void key_scores_generic(float *att, size_t lda, const float *const *q, int nq, const void *kb, int n,
                               int hd, int kv) {
    if (kv == FLM_Q8_0) {
        flm_key_scores_q8(att, lda, q, nq, kb, n, hd);
        return;
    }
    for (int i = 0; i < nq; i++)
        for (int b = 0; b < n; b += 16) {
            float acc[16] = {0};
            const size_t blk = (size_t)b * hd;
            for (int d = 0; d < hd; d++)
                for (int j = 0; j < 16; j++) acc[j] += q[i][d] * flm_kv_at(kb, blk + d * 16 + j, kv);
            for (int j = 0; j < 16; j++) att[i * lda + b + j] = acc[j];
        }
}

float flm_exp_sum_generic(float *x, int n, float max) {
    float acc[GENERIC_LANES] = {0};
    for (int i = 0; i < n; i++) {
        x[i] = exp_normal(x[i] - max);
        acc[i % GENERIC_LANES] += x[i];
    }
    return reduce8(acc);
}

float flm_scale_max_generic(float *x, int n, float s) {
    float max = -INFINITY;
    for (int i = 0; i < n; i++) {
        x[i] *= s;
        if (x[i] > max) max = x[i];
    }
    return max;
}

void flm_scale_generic(float *x, int n, float s) {
    for (int i = 0; i < n; i++) x[i] *= s;
}

static void weighted_sum_generic(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v, int n,
                                 size_t ldv, int dim, int kv) {
    if (kv == FLM_Q8_0) {
        flm_weighted_sum_q8(out, ldo, p, ldp, nq, v, n, ldv, dim);
        return;
    }
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < n; j++)
            for (int d = 0; d < dim; d++) out[i * ldo + d] += p[i * ldp + j] * flm_kv_at(v, j * ldv + d, kv);
}

/* Column j of S only ever meets column j of the update, so each column is
 * finished (decay and S^T k, then update and S^T q) before the next. */
void flm_delta_rule_generic(float *S, const float *q, const float *k, const float *v, float beta,
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

void flm_conv_silu_generic(float *x, size_t ldx, int T, float *win, size_t ldw, const float *w, int K, int n) {
    for (int c = 0; c < n; c++) {
        const float *wc = w + (size_t)c * K;
        for (int t = 0; t < T; t++) {
            const float m = x[(size_t)t * ldx + c];
            float acc = 0.0f;
            for (int j = 0; j < K - 1; j++) acc += wc[j] * win[j * ldw + c];
            acc += wc[K - 1] * m;
            for (int j = 0; j + 1 < K - 1; j++) win[j * ldw + c] = win[(j + 1) * ldw + c];
            if (K > 1) win[(K - 2) * ldw + c] = m;
            x[(size_t)t * ldx + c] = acc / (1.0f + exp_normal(-acc));
        }
    }
}

void flm_rmsnorm_generic(float *out, const float *x, const float *weight, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

void flm_silu_mul_generic(float *g, const float *u, int n) {
    for (int i = 0; i < n; i++) g[i] = g[i] / (1.0f + exp_normal(-g[i])) * u[i];
}

static void gelu_tanh_mul_generic(float *g, const float *u, int n) {
    for (int i = 0; i < n; i++) {
        const float x = g[i], inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
        g[i] = 0.5f * x * (1.0f + tanhf(inner)) * u[i];
    }
}

static float softcap_max_generic(float *x, int n, float cap) {
    float max = -INFINITY;
    for (int i = 0; i < n; i++) {
        x[i] = tanhf(x[i] / cap) * cap;
        if (x[i] > max) max = x[i];
    }
    return max;
}

const FlmKernels flm_kernels_generic = {
    .name = "generic",
    .gemm_f32 = flm_gemm_f32_generic,
    .gemm_bf16 = flm_gemm_bf16_generic,
    .to_bf16 = NULL,
    .int8_name = "generic",
    .qgemm = flm_qgemm_generic,
    .quantize_q8 = flm_quantize_q8_generic,
    .key_scores = key_scores_generic,
    .exp_sum = flm_exp_sum_generic,
    .scale_max = flm_scale_max_generic,
    .scale = flm_scale_generic,
    .weighted_sum = weighted_sum_generic,
    .delta_rule = flm_delta_rule_generic,
    .conv_silu = flm_conv_silu_generic,
    .rmsnorm = flm_rmsnorm_generic,
    .silu_mul = flm_silu_mul_generic,
    .gelu_tanh_mul = gelu_tanh_mul_generic,
    .softcap_max = softcap_max_generic,
    .token_block = 60,
};
