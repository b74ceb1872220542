/* The int8 matmul on aarch64, bit for bit the portable one of quant.c, at
 * three feature levels: NEON widening multiplies (every aarch64 CPU), SDOT
 * (dotprod: Armv8.2 and later, Graviton 2, Apple M1) and SMMLA for pairs of
 * tokens (i8mm: Graviton 3, Apple M2). They read quant.h's panels as they
 * are: a 16-byte vector holds 4 rows x 4 k of a record.
 *
 * The quants are stored unsigned, but no quant of up to 6 bits exceeds 63,
 * so they are valid signed bytes as they are, and 8-bit quants become
 * signed again (u - 128, the offset then dropped), so the signed-by-signed
 * SDOT and SMMLA serve every type. The integer sums are exact in any order;
 * the float operations on them are fma_block's, in its order. */
#include <string.h>

#include "simd_arm64.h"

#ifdef FLM_ARM64

#define PANEL FLM_PANEL

ARM_INLINE size_t sb_bytes(const FlmQuantType *L) { return (size_t)L->header + (size_t)L->sb / 32 * L->data; }

/* v[m]: rows 4q .. 4q+3 of a record's quants for k = 4m .. 4m+3, as signed bytes. */
ARM_INLINE void unpack4(int8x16_t v[8], const uint8_t *rec, const int bits, int q) {
    if (bits == 8) {
        for (int m = 0; m < 8; m++) v[m] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(rec + 64 * m + 16 * q), vdupq_n_u8(0x80)));
        return;
    }
    uint8x16_t u[8];
    for (int g = 0; g < 4; g++) {
        const uint8x16_t b = vld1q_u8(rec + 64 * g + 16 * q);
        u[2 * g] = vandq_u8(b, vdupq_n_u8(0x0F));
        u[2 * g + 1] = vshrq_n_u8(b, 4);
    }
    if (bits == 6) {
        /* Both top bits of 4 groups from one vector (layout: quant.h). */
        const uint8x16_t top = vdupq_n_u8(0x30);
        for (int h = 0; h < 2; h++) {
            const uint8x16_t c = vld1q_u8(rec + 256 + 64 * h + 16 * q);
            u[4 * h] = vorrq_u8(u[4 * h], vandq_u8(vshlq_n_u8(c, 4), top));
            u[4 * h + 1] = vorrq_u8(u[4 * h + 1], vandq_u8(vshlq_n_u8(c, 2), top));
            u[4 * h + 2] = vorrq_u8(u[4 * h + 2], vandq_u8(c, top));
            u[4 * h + 3] = vorrq_u8(u[4 * h + 3], vandq_u8(vshrq_n_u8(c, 2), top));
        }
        for (int m = 0; m < 8; m++) v[m] = vreinterpretq_s8_u8(u[m]);
        return;
    }
    /* Byte 4r+j of the 16 takes bit 4r+j of the group's 16 mask bits. */
    static const uint8_t sel_bits[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t sel = vld1q_u8(sel_bits);
    for (int plane = 0; plane < bits - 4; plane++)
        for (int m = 0; m < 8; m++) {
            const uint8_t *mask = rec + 256 + 64 * plane + 8 * m + 2 * q;
            const uint8x16_t spread = vcombine_u8(vdup_n_u8(mask[0]), vdup_n_u8(mask[1]));
            u[m] = vaddq_u8(u[m], vandq_u8(vtstq_u8(spread, sel), vdupq_n_u8((uint8_t)(16 << plane))));
        }
    for (int m = 0; m < 8; m++) v[m] = vreinterpretq_s8_u8(u[m]);
}

ARM_INLINE float32x4_t f16x4(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(p))); }
/* A Q4_K/Q5_K superblock's 6-bit scales and mins (flm_k_scale in quant.h)
 * as bytes, once for its 8 blocks: f[16i + r] the scale, f[128 + 16i + r]
 * the min of row r's sub-block i. */
ARM_INLINE void k_fields(uint8_t f[256], const uint8_t *h) {
    const uint8x16_t six = vdupq_n_u8(63), nib = vdupq_n_u8(15);
    for (int j = 0; j < 4; j++) {
        const uint8x16_t P = vld1q_u8(h + 64 + 16 * j), M = vld1q_u8(h + 128 + 16 * j), L = vld1q_u8(h + 192 + 16 * j);
        vst1q_u8(f + 16 * j, vandq_u8(P, six));
        vst1q_u8(f + 64 + 16 * j, vorrq_u8(vandq_u8(L, nib), vshlq_n_u8(vshrq_n_u8(P, 6), 4)));
        vst1q_u8(f + 128 + 16 * j, vandq_u8(M, six));
        vst1q_u8(f + 192 + 16 * j, vorrq_u8(vshrq_n_u8(L, 4), vshlq_n_u8(vshrq_n_u8(M, 6), 4)));
    }
}

ARM_INLINE float32x4_t u8x4(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return vcvtq_f32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(w)))));
}
ARM_INLINE float32x4_t i8x4(const uint8_t *p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u8(vcreate_u8(w))))));
}

/* The scales of rows 4q .. 4q+3 for block i of a superblock header h, as
 * quant.c's row_scale forms them: a for k < 16, a2 for k >= 16 (Q6_K),
 * mn the min (Q4_1, Q5_1) or dmin*mn (Q4_K, Q5_K); f: the superblock's
 * k_fields (Q4_K, Q5_K). */
typedef struct { float32x4_t d, a, a2, mn; } RowScales;

ARM_INLINE RowScales row_scales(const uint8_t *h, const uint8_t *f, const int type, int i, int q) {
    RowScales s;
    s.d = s.a = s.a2 = s.mn = f16x4(h + 8 * q);
    if (type == FLM_Q4_1 || type == FLM_Q5_1) s.mn = f16x4(h + 32 + 8 * q);
    if (type == FLM_Q4_K || type == FLM_Q5_K) {
        s.a = vmulq_f32(s.d, u8x4(f + 16 * i + 4 * q));
        s.mn = vmulq_f32(f16x4(h + 32 + 8 * q), u8x4(f + 128 + 16 * i + 4 * q));
    }
    if (type == FLM_Q6_K) {
        s.a = vmulq_f32(s.d, i8x4(h + 32 + (2 * i) * 16 + 4 * q));
        s.a2 = vmulq_f32(s.d, i8x4(h + 32 + (2 * i + 1) * 16 + 4 * q));
    }
    return s;
}

/* One block of one token added to 4 rows' sums, from the integer sums of
 * its first (I0) and last (I1) 16 k: fma_block's operations. */
ARM_INLINE float32x4_t block_fma(float32x4_t acc, int32x4_t I0, int32x4_t I1, RowScales s, const int type, int off,
                                 const FlmQ8 *x) {
    const float xd = x->d;
    if (type == FLM_Q6_K) {
        I0 = vaddq_s32(I0, vdupq_n_s32(x->s32[0]));
        I1 = vaddq_s32(I1, vdupq_n_s32(x->s32[1]));
        acc = vfmaq_f32(acc, vcvtq_f32_s32(I0), vmulq_n_f32(s.a, xd));
        return vfmaq_f32(acc, vcvtq_f32_s32(I1), vmulq_n_f32(s.a2, xd));
    }
    const int S = x->s[0] + x->s[1];
    const int32x4_t I = vaddq_s32(vaddq_s32(I0, I1), vdupq_n_s32(-off * S));
    acc = vfmaq_f32(acc, vcvtq_f32_s32(I), vmulq_n_f32(s.a, xd));
    if (type == FLM_Q4_1 || type == FLM_Q5_1) acc = vfmaq_f32(acc, s.mn, vdupq_n_f32(x->ds));
    if (type == FLM_Q4_K || type == FLM_Q5_K) acc = vfmsq_f32(acc, s.mn, vdupq_n_f32(x->ds));
    return acc;
}

#define SUFFIX neon
#define TARGET NEON
#define MODE 0
#include "quant_arm64_body.h"
#undef SUFFIX
#undef TARGET
#undef MODE

#define SUFFIX dotprod
#define TARGET DOTPROD
#define MODE 1
#include "quant_arm64_body.h"
#undef SUFFIX
#undef TARGET
#undef MODE

#define SUFFIX i8mm
#define TARGET I8MM
#define MODE 2
#include "quant_arm64_body.h"
#undef SUFFIX
#undef TARGET
#undef MODE

/* quant.c's flm_quantize_q8_generic, 4 lanes at a time: the same max
 * (maxNum ignores NaN as fmaxf does), the same scale, rounding to nearest
 * even as nearbyintf does. */
void flm_quantize_q8_neon(FlmQ8 *dst, const float *x, int K) {
    for (int b = 0; b < K / 32; b++, x += 32) {
        float32x4_t v[8], m = vdupq_n_f32(0.0f);
        for (int j = 0; j < 8; j++) {
            v[j] = vld1q_f32(x + 4 * j);
            m = vmaxnmq_f32(m, vabsq_f32(v[j]));
        }
        const float amax = vmaxnmvq_f32(m);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        dst[b].d = amax / 127.0f;
        int32x4_t s[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int j = 0; j < 8; j += 2) {
            const int32x4_t i0 = vcvtnq_s32_f32(vmulq_n_f32(v[j], id)), i1 = vcvtnq_s32_f32(vmulq_n_f32(v[j + 1], id));
            s[j / 4] = vaddq_s32(s[j / 4], vaddq_s32(i0, i1));
            vst1_s8(dst[b].q + 4 * j, vmovn_s16(vcombine_s16(vmovn_s32(i0), vmovn_s32(i1))));
        }
        flm_q8_set_sums(&dst[b], vaddvq_s32(s[0]), vaddvq_s32(s[1]));
    }
}

#endif
