/* Weight matrices packed in panels of FLM_PANEL rows, and the matmul
 * kernels over them (gemm.c).
 *
 * A panel holds, for each k, the weights W[p*16 + i][k] of its 16 rows side
 * by side (bf16: pairs of k, [k/2][16][2]), so one 64-byte load brings 16
 * rows' weights and each row sums in its own lane. */
#ifndef FASTLLM_GEMM_H
#define FASTLLM_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "types.h"   /* FLM_PANEL */

/* The version of what flm_pack writes (every type's panel layout): packed
 * weights kept on disk are only reused by a build whose version is the same,
 * so it goes up with any change to the layout. */
#define FLM_PACK_LAYOUT 3

/* Bytes of an (N, K) matrix of a type packed in panels, and the packing
 * itself, from rows of fp32, bf16 or f16 values or of GGML blocks. Quantized
 * types need K to be a whole number of their superblocks (32 or 256). */
size_t flm_packed_bytes(int N, int K, int type);
void flm_pack(void *dst, const void *src, int N, int K, int type, int n_threads);

/* out[t*ldo + r] = sum_k x[t*ldx + k] * W[r][k] for t < T and the rows r of
 * panels p0 .. p0+np-1 that are below N; W packed by flm_pack. Every path
 * sums each output in a fixed order, whatever T, p0 and np are. */
typedef void (*flm_gemm_fn)(float *out, int ldo, const float *x, int ldx, const void *wp, int K,
                            int T, int p0, int np, int N);

void flm_gemm_f32_generic(float *, int, const float *, int, const void *, int, int, int, int, int);
void flm_gemm_bf16_generic(float *, int, const float *, int, const void *, int, int, int, int, int);
void flm_gemm_f32_avx2(float *, int, const float *, int, const void *, int, int, int, int, int);
void flm_gemm_bf16_avx2(float *, int, const float *, int, const void *, int, int, int, int, int);
void flm_gemm_f32_avx512(float *, int, const float *, int, const void *, int, int, int, int, int);
void flm_gemm_bf16_avx512(float *, int, const float *, int, const void *, int, int, int, int, int);
/* x as bf16 pairs (ldx counted in pairs), made by flm_to_bf16_avx512. */
void flm_gemm_bf16_dp_avx512(float *, int, const float *, int, const void *, int, int, int, int, int);
void flm_gemm_bf16_amx(float *, int, const float *, int, const void *, int, int, int, int, int);
/* n floats to bf16, nearest-even, zero-padded to even n. */
void flm_to_bf16_avx512(uint16_t *dst, const float *src, int n);

/* Row r of a packed (., K) matrix, as fp32 (embedding rows of a tied head). */
void flm_packed_row(float *out, const void *wp, int r, int K, int wtype);

#endif
