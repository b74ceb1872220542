/* What every layer of fastllm shares: the storage types of weights and of
 * the KV cache, the weight matrix, and the scalar conversions of the 16-bit
 * formats. The kernels (kernels.h, gemm.h, quant.h) and the forward pass
 * (fastllm.h) both build on it; it depends on nothing of theirs. */
#ifndef FASTLLM_TYPES_H
#define FASTLLM_TYPES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Rows of a packed weight panel (gemm.h, quant.h): every matmul kernel
 * reads its weights 16 rows at a time. */
#define FLM_PANEL 16

/* Storage types of weights (and, the first four, of the KV cache). The
 * quantized ones are GGML's block formats (quant.h). */
enum {
    FLM_F32 = 0, FLM_BF16 = 1, FLM_F16 = 2,
    FLM_Q8_0 = 3, FLM_Q4_0 = 4, FLM_Q4_1 = 5, FLM_Q5_0 = 6, FLM_Q5_1 = 7,
    FLM_Q4_K = 8, FLM_Q5_K = 9, FLM_Q6_K = 10,
    FLM_TYPES
};

/* A weight matrix (N, K): its storage type, and its data packed by flm_pack
 * (an embedding table: plain rows, of GGML blocks where quantized). */
typedef struct {
    const void *data;
    int type;             /* FLM_F32 .. FLM_Q6_K */
} FlmMatrix;

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

/* A q8_0 KV cache holds each 32 values as 32 int8 and their f16 scale
 * (value = scale * int8, the scale max|x| / 127), 34 bytes, the int8 of a
 * unit of the cache before its scales: a block of 16 keys is (head_dim, 16)
 * int8 then (head_dim / 32, 16) scales; a row of values head_dim int8 then
 * head_dim / 32 scales. n: a multiple of 32. */
#define FLM_KV_Q8_BYTES(n) ((size_t)(n) / 32 * 34)

/* Element i of a 32-, 16-bit KV cache array stored as kv. */
static inline float flm_kv_at(const void *p, size_t i, int kv) {
    if (kv == FLM_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return kv == FLM_BF16 ? flm_bf16_to_f32(h) : flm_f16_to_f32(h);
}

#endif
