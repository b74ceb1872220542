/* How fast one core runs the int8 dot product that fastllm's AVX-512 VNNI
 * matmul kernels are built on (vpdpbusd on 16 lanes, its activation
 * operand a 4-byte broadcast from memory, as quant.c's dot4), alone and
 * with the float work the K-quant kernels do per token and block of 32
 * weights: the ceiling that prompt processing (compute-bound) is held to.
 *
 *   cc -O2 benchmarks/dot_peak.c -o /tmp/dot_peak && /tmp/dot_peak
 *
 * Prints dot products per second, the int8 operations per second they
 * make (128 per dot product: 64 multiply-adds), and for two mixes the
 * blocks per second as a share of the dot-product peak: the kernel's (8
 * dot products, a conversion, a multiply and two fused multiply-adds per
 * token and block), and the one of kernels that give 256 activations one
 * scale, as llama.cpp's K-quant kernels do (8 dot products, then the
 * block's sum times its 6-bit scale in integers: a 32-bit multiply and an
 * add; the float work, once per 8 blocks, left out). x86-64 with AVX-512
 * VNNI only. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* acc += w . the 4 bytes at x, broadcast (quant.c's dot4). */
#define DOT(acc, w, x) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const unaligned_i32 *)(x)))

static int8_t xs[64 * 64];
static float scales[64 * 4];
/* Where each timing's sums go, so that the compiler keeps their work. */
static volatile int sink;

/* Ten independent sums, so that only throughput bounds them. */
static AVX512VNNI double dots_alone(long n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
            a9 = a0, w = _mm512_set1_epi8(3);
    const double t = now();
    for (long i = 0; i < n; i++) {
        const int8_t *x = xs + (i & 63) * 64;
        __asm__ volatile("" : "+v"(w), "+r"(x));
        DOT(a0, w, x); DOT(a1, w, x + 4); DOT(a2, w, x + 8); DOT(a3, w, x + 12); DOT(a4, w, x + 16);
        DOT(a5, w, x + 20); DOT(a6, w, x + 24); DOT(a7, w, x + 28); DOT(a8, w, x + 32); DOT(a9, w, x + 36);
    }
    const double e = now() - t;
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                 _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    sink += _mm512_reduce_add_epi32(_mm512_add_epi32(s, _mm512_add_epi32(a8, a9)));
    return n * 10.0 / e;
}

/* One token's block: 8 dot products in two chains, added (I). */
#define BLOCK_SUM(I, x)                                                                             \
    do {                                                                                            \
        __m512i J = _mm512_setzero_si512();                                                         \
        I = _mm512_setzero_si512();                                                                 \
        DOT(I, v0, (x)); DOT(J, v1, (x) + 4); DOT(I, v2, (x) + 8); DOT(J, v3, (x) + 12);             \
        DOT(I, v4, (x) + 16); DOT(J, v5, (x) + 20); DOT(I, v6, (x) + 24); DOT(J, v7, (x) + 28);      \
        I = _mm512_add_epi32(I, J);                                                                 \
    } while (0)

/* A block's 16 rows of weights, v0 .. v7, as the kernels hold them in registers. */
#define WEIGHTS                                                                                     \
    __m512i v0 = _mm512_set1_epi8(1), v1 = _mm512_set1_epi8(2), v2 = _mm512_set1_epi8(3),           \
            v3 = _mm512_set1_epi8(4), v4 = _mm512_set1_epi8(5), v5 = _mm512_set1_epi8(6),           \
            v6 = _mm512_set1_epi8(7), v7 = _mm512_set1_epi8(8)
/* Tells the compiler the weights (and more) change each pass: nothing is hoisted. */
#define OPAQUE(...) __asm__ volatile("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3), "+v"(v4), "+v"(v5), \
                                          "+v"(v6), "+v"(v7), __VA_ARGS__)

/* The float work of quant.c's block_dot for Q4_K/Q5_K after the sums
 * (without the chains' shift). */
#define TOKEN_BLOCK(acc, x, f)                                                                      \
    do {                                                                                            \
        __m512i I;                                                                                  \
        BLOCK_SUM(I, x);                                                                            \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(a, _mm512_set1_ps((f)[0])), acc); \
        acc = _mm512_fnmadd_ps(mn, _mm512_set1_ps((f)[1]), acc);                                    \
    } while (0)

static AVX512VNNI double kernel_mix(long n) {
    WEIGHTS;
    __m512 a = _mm512_set1_ps(1e-3f), mn = _mm512_set1_ps(1e-4f);
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    const double t = now();
    for (long i = 0; i < n; i++) {
        const int8_t *x = xs + (i & 63) * 64;
        const float *f = scales + (i & 63) * 4;
        OPAQUE("+r"(x), "+r"(f));
        TOKEN_BLOCK(c0, x, f); TOKEN_BLOCK(c1, x + 32, f + 2);
        TOKEN_BLOCK(c2, x + 1, f + 1); TOKEN_BLOCK(c3, x + 33, f + 3);
    }
    const double e = now() - t;
    sink += (int)_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)));
    return n * 4.0 / e;
}

/* The same dot products, each block's sum then scaled and summed in integers. */
#define TOKEN_BLOCK_INT(isum, x, sc)                                                                \
    do {                                                                                            \
        __m512i I;                                                                                  \
        BLOCK_SUM(I, x);                                                                            \
        isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(I, sc));                                   \
    } while (0)

static AVX512VNNI double integer_mix(long n) {
    WEIGHTS;
    __m512i sc = _mm512_set1_epi32(37);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0;
    const double t = now();
    for (long i = 0; i < n; i++) {
        const int8_t *x = xs + (i & 63) * 64;
        OPAQUE("+v"(sc), "+r"(x));
        TOKEN_BLOCK_INT(c0, x, sc); TOKEN_BLOCK_INT(c1, x + 32, sc);
        TOKEN_BLOCK_INT(c2, x + 1, sc); TOKEN_BLOCK_INT(c3, x + 33, sc);
    }
    const double e = now() - t;
    sink += _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)));
    return n * 4.0 / e;
}

int main(void) {
    if (!__builtin_cpu_supports("avx512vnni")) {
        fprintf(stderr, "this CPU has no AVX-512 VNNI\n");
        return 2;
    }
    for (int i = 0; i < (int)sizeof xs; i++) xs[i] = (int8_t)(i * 7);
    for (int i = 0; i < 64 * 4; i++) scales[i] = 1.0f + i * 1e-3f;
    for (int round = 0; round < 3; round++) {
        const double dots = dots_alone(100000000), blocks = kernel_mix(25000000),
                     integer = integer_mix(25000000);
        printf("dot products alone: %.2f G/s (%.0f int8 GOP/s); kernel mix: %.0f%% of that peak; "
               "integer-scaled mix: %.0f%%\n", dots / 1e9, dots * 128 / 1e9, 100.0 * blocks * 8 / dots,
               100.0 * integer * 8 / dots);
    }
    return 0;
}
