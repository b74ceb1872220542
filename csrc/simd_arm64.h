/* What the aarch64 kernels (kernels_arm64.c, quant_arm64.c) share: the
 * target attributes that compile one function for one feature level, and
 * the paths' tables. As on x86, nothing is built with -march: NEON is part
 * of every aarch64 CPU, and each wider function is called only once
 * kernels_arm64.c has checked the CPU has its features. */
#ifndef FASTLLM_SIMD_ARM64_H
#define FASTLLM_SIMD_ARM64_H

#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define FLM_ARM64 1
#include <arm_neon.h>

#include "kernels.h"
#include "quant.h"

#ifdef __clang__
#define NEON
#define DOTPROD __attribute__((target("dotprod")))
#define I8MM __attribute__((target("dotprod,i8mm")))
#define ARMBF16 __attribute__((target("bf16")))
#else   /* GCC's arm_neon.h asks for the Armv8.2 base of these extensions too */
#define NEON
#define DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#define ARMBF16 __attribute__((target("arch=armv8.2-a+bf16")))
#endif
#define ARM_INLINE static inline __attribute__((always_inline))

/* The first m of 4 lanes of v to out (all 4 when m >= 4). */
ARM_INLINE void store4(float *out, float32x4_t v, int m) {
    if (m >= 4) {
        vst1q_f32(out, v);
        return;
    }
    float t[4];
    vst1q_f32(t, v);
    for (int i = 0; i < m; i++) out[i] = t[i];
}

/* The CPU's features that the paths need, found once. */
enum { FLM_ARM_DOTPROD = 1, FLM_ARM_I8MM = 2, FLM_ARM_BF16 = 4 };
int flm_arm64_features(void);

/* The float kernels (kernels_arm64.c), as kernels.h declares them. */
void flm_gemm_f32_neon(float *, int, const float *, int, const void *, int, int, int, int, int);
void flm_gemm_bf16_neon(float *, int, const float *, int, const void *, int, int, int, int, int);
/* x as bf16 pairs (ldx counted in pairs), made by flm_to_bf16_neon. */
void flm_gemm_bf16_bfdot(float *, int, const float *, int, const void *, int, int, int, int, int);
void flm_to_bf16_neon(uint16_t *dst, const float *src, int n);
void flm_key_scores_neon(float *att, size_t lda, const float *const *q, int nq, const void *kblocks, int n, int hd,
                         int kv);
void flm_weighted_sum_neon(float *out, size_t ldo, const float *p, size_t ldp, int nq, const void *v, int n,
                           size_t ldv, int dim, int kv);
void flm_scale_neon(float *x, int n, float s);
float flm_exp_sum_neon(float *x, int n, float max);
float flm_scale_max_neon(float *x, int n, float s);
float flm_softcap_max_neon(float *x, int n, float cap);
void flm_silu_mul_neon(float *g, const float *u, int n);
void flm_gelu_tanh_mul_neon(float *g, const float *u, int n);
void flm_delta_rule_neon(float *S, const float *q, const float *k, const float *v, float beta, float decay, int dk,
                         int dv, float *o);
void flm_conv_silu_neon(float *x, size_t ldx, int T, float *win, size_t ldw, const float *w, int K, int n);

/* The int8 kernels of each level (quant_arm64.c). */
void flm_qgemm_neon(float *, int, const FlmQ8 *, int, const void *, int, int, int, int, int, int);
void flm_qgemm_dotprod(float *, int, const FlmQ8 *, int, const void *, int, int, int, int, int, int);
void flm_qgemm_i8mm(float *, int, const FlmQ8 *, int, const void *, int, int, int, int, int, int);
void flm_quantize_q8_neon(FlmQ8 *dst, const float *x, int K);
#endif

#endif
