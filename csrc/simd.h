/* What the x86 SIMD kernels (kernels_x86.c, gemm.c, quant.c) share: the
 * target attributes that compile one function for one instruction set, and
 * the lane mask of a vector's tail. Nothing is built with -march: each path
 * is compiled by attribute and called only once kernels_x86.c has checked
 * the CPU has it. */
#ifndef FASTLLM_SIMD_H
#define FASTLLM_SIMD_H

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FLM_X86 1
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX512VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define AVX512BF16 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
/* AMX intrinsics need GCC 11 or clang 12; older compilers build without
 * the amx_bf16 path. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define FLM_AMX 1
#define AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#endif
#define INLINE static inline __attribute__((always_inline))

/* The first `left` of 16 lanes (none when left <= 0, all when >= 16). */
INLINE AVX512 __mmask16 tail_mask(int left) {
    return left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : (__mmask16)0;
}

/* How the kernels that stream weights ask for them before they need them:
 * flm_stream_ahead bytes past the bytes in hand, into L1 or, where
 * flm_stream_l2, into L2. The hardware prefetcher alone falls behind a
 * decoding step's streams, but the distance and cache that help differ
 * from CPU to CPU (kernels_x86.c's flm_arch_adapt sets them for this one;
 * flm_set_stream_prefetch, fastllm.h, for benchmarks). */
extern int flm_stream_ahead, flm_stream_l2;

/* What a kernel reads of the two on entry. Where l2 is a constant (the
 * int8 decoding kernels, quant.c) the branch below goes: taken at every
 * prefetch, it cost those kernels 10% of a one-thread decoding step. */
typedef struct {
    int ahead, l2;
} StreamPrefetch;

INLINE StreamPrefetch stream_prefetch_now(void) { return (StreamPrefetch){flm_stream_ahead, flm_stream_l2}; }

INLINE void stream_prefetch(StreamPrefetch pf, const void *p) {
    const char *at = (const char *)p + pf.ahead;
    if (pf.l2) _mm_prefetch(at, _MM_HINT_T1);
    else _mm_prefetch(at, _MM_HINT_T0);
}
#endif

#endif
