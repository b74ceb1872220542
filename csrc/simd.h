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
#endif

#endif
