/* Quantized weight matrices, and the int8 activations they multiply.
 *
 * A GGUF file stores a quantized matrix as rows of GGML blocks. flm_pack
 * repacks them into panels of FLM_PANEL rows, as it does fp32 and bf16
 * matrices, so that one 64-byte load brings 16 rows' quants side by side:
 *
 *   panel = superblocks of `sb` k (32, or 256 for the K-quants), each
 *     header: the scales of its 16 rows (layout per type, in quant.c)
 *     then one record of `data` bytes per 32 k:
 *       8-bit quants: [8 groups of 4 k][16 rows][4]           512 bytes
 *       4-bit and up: [4 groups of 8 k][16 rows][4] nibbles   256 bytes,
 *         low nibble k = 8g+j, high nibble k = 8g+4+j (j < 4),
 *         then for 5-bit quants a bit plane of 8 masks of 64 bits, mask m
 *         for k = 4m..4m+3, bit 4r+j for row r, k 4m+j; for 6-bit quants
 *         two vectors of 64 bytes holding each quant's top two bits, byte
 *         4r+j of vector h bits 2c..2c+1 for row r, k = 4(4h+c)+j: so that
 *         shifting a vector by 4-2c and masking it puts the top bits of
 *         group m = 4h+c in place for all 16 rows at once.
 *
 * Every quant is stored unsigned (u = q + offset), so that an int8 dot
 * product multiplies unsigned weights by signed activations (vpdpbusd);
 * the offset comes back exactly, in integers, through the sums of the
 * activation blocks. Each row keeps the exact values GGML's dequantizers
 * give: d * (u - offset), d * u + m, (d*sc) * u - dmin*mn, (d*sc) * (u - 32). */
#ifndef FASTLLM_QUANT_H
#define FASTLLM_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "types.h"

/* 32 activations quantized to int8: x[k] ~ d * q[k]; s[h] is the sum of
 * q[16h .. 16h+15]. */
typedef struct {
    float d;
    float ds;        /* d * (float)(s[0] + s[1]), formed once for every row's kernel */
    int32_t s32[2];  /* -32 * s[h]: Q6_K's offset terms, which the SIMD kernels
                      * broadcast from memory instead of forming per row panel */
    int16_t s[2];
    int8_t q[32];
} FlmQ8;

/* A block's sums and what the kernels derive from them, once d and q[]
 * are set: every path's quantizer ends a block with this. */
static inline void flm_q8_set_sums(FlmQ8 *b, int s0, int s1) {
    b->s[0] = (int16_t)s0;
    b->s[1] = (int16_t)s1;
    b->s32[0] = -32 * s0;
    b->s32[1] = -32 * s1;
    b->ds = b->d * (float)(s0 + s1);
}

typedef struct {
    const char *name;
    int sb;          /* k per superblock of scales: 32 or 256 (F16: 1) */
    int header;      /* bytes of a panel superblock's scales */
    int data;        /* bytes per 32 k of a panel: quants and bit planes */
    int bits;        /* bits per quant (16, 32: the float types) */
    int offset;      /* subtracted from every quant, or 0 where a min is added */
    int ggml_block;  /* values per GGML block, and its bytes */
    int ggml_bytes;
} FlmQuantType;

/* What fastllm knows of a weight type (FLM_F32 .. FLM_Q6_K), NULL for
 * others: the one table of names and block sizes, which Python reads too.
 * The panel fields (header, data, offset) describe quant.c's panels, of
 * FLM_F16 and up; f32 and bf16 are packed by gemm.c. In the header so that
 * a kernel compiled for one type has its layout as constants. */
static const FlmQuantType flm_quant_types[FLM_TYPES] = {
    [FLM_F32] = {"f32", 1, 0, 0, 32, 0, 1, 4},   /* panels of gemm.c, not quant.c */
    [FLM_BF16] = {"bf16", 1, 0, 0, 16, 0, 1, 2},
    [FLM_F16] = {"f16", 1, 0, 32, 16, 0, 1, 2},   /* [k][16] halves, any K */
    [FLM_Q8_0] = {"q8_0", 32, 32, 512, 8, 128, 32, 34},
    [FLM_Q4_0] = {"q4_0", 32, 32, 256, 4, 8, 32, 18},
    [FLM_Q4_1] = {"q4_1", 32, 64, 256, 4, 0, 32, 20},
    [FLM_Q5_0] = {"q5_0", 32, 32, 320, 5, 16, 32, 22},
    [FLM_Q5_1] = {"q5_1", 32, 64, 320, 5, 0, 32, 24},
    [FLM_Q4_K] = {"q4_k", 256, 256, 256, 4, 0, 256, 144},
    [FLM_Q5_K] = {"q5_k", 256, 256, 320, 5, 0, 256, 176},
    [FLM_Q6_K] = {"q6_k", 256, 288, 384, 6, 32, 256, 210},
};

/* A Q4_K or Q5_K panel superblock keeps GGML's 6-bit scales and mins, 12
 * bytes a row as in the file (so a packed row is no larger than GGML's),
 * in byte planes of the panel's 16 rows: one 16-byte load reads a field of
 * every row. After d (16 f16) and dmin (16 f16), for j = 0 .. 3 and row r:
 *   64 + 16j + r:   sc[j] | (sc[j+4] >> 4) << 6
 *   128 + 16j + r:  mn[j] | (mn[j+4] >> 4) << 6
 *   192 + 16j + r:  (sc[j+4] & 15) | (mn[j+4] & 15) << 4
 * The scale and min of row r's sub-block i (0 .. 7) from header h: */
static inline uint8_t flm_k_scale(const uint8_t *h, int i, int r) {
    return i < 4 ? (uint8_t)(h[64 + 16 * i + r] & 63)
                 : (uint8_t)((h[192 + 16 * (i - 4) + r] & 15) | (h[64 + 16 * (i - 4) + r] >> 6) << 4);
}
static inline uint8_t flm_k_min(const uint8_t *h, int i, int r) {
    return i < 4 ? (uint8_t)(h[128 + 16 * i + r] & 63)
                 : (uint8_t)((h[192 + 16 * (i - 4) + r] >> 4) | (h[128 + 16 * (i - 4) + r] >> 6) << 4);
}

static inline const FlmQuantType *flm_quant_type(int type) {
    return type >= 0 && type < FLM_TYPES ? &flm_quant_types[type] : NULL;
}
int flm_is_quantized(int type);

/* Whether n values of a weight type, as a GGUF or safetensors file stores
 * them (plain values, or rows of GGML blocks: n a whole number of blocks),
 * hold no NaN or infinity: every value of the float types; of GGML blocks,
 * their f16 scales (the quants are integers). */
int flm_finite(const void *data, size_t n, int type, int n_threads);

/* Bytes of an (N, K) quantized matrix in panels; K must be a whole number of superblocks. */
size_t flm_quant_packed_bytes(int N, int K, int type);
/* Repack N rows of GGML blocks (F16: N rows of K halves). */
void flm_quant_pack(void *dst, const void *src, int N, int K, int type, int n_threads);
/* Panel p's weights for k = k0 .. k0+nk-1 (multiples of 32) as fp32 panel
 * rows, dst[(k - k0)*16 + r], exactly as GGML dequantizes them. */
void flm_quant_dequant_panel(float *dst, const void *wp, int p, int k0, int nk, int K, int type);
/* One row of GGML blocks (unpacked: an embedding row), dequantized. */
void flm_quant_dequant_row(float *out, const void *row, int K, int type);
/* Row r of a packed quantized matrix, dequantized. */
void flm_quant_packed_row(float *out, const void *wp, int r, int K, int type);

/* K activations (K a multiple of 32) into K/32 blocks. */
void flm_quantize_q8_generic(FlmQ8 *dst, const float *x, int K);

/* out[t*ldo + r] = sum_k x[t][k] * W[r][k] for the rows of panels p0 ..
 * p0+np-1 below N, x as blocks (lda blocks per token). Each output is
 * summed block by block, in order, whatever T and the panels are. */
typedef void (*flm_qgemm_fn)(float *out, int ldo, const FlmQ8 *x, int lda, const void *wp, int K, int T,
                             int p0, int np, int N, int type);
/* Passes of at most this many tokens are decoding: the x86 kernels read
 * their panels side by side, and fastllm.c hands their work items out in
 * runs of consecutive panels, which those kernels' prefetches count on. */
#define FLM_DECODE_TOKENS 2
void flm_qgemm_generic(float *, int, const FlmQ8 *, int, const void *, int, int, int, int, int, int);
void flm_qgemm_avx512_vnni(float *, int, const FlmQ8 *, int, const void *, int, int, int, int, int, int);
void flm_qgemm_avx2(float *, int, const FlmQ8 *, int, const void *, int, int, int, int, int, int);
void flm_quantize_q8_avx512(FlmQ8 *dst, const float *x, int K);

#endif
