/* How one core's rate of an instruction mix changes when another core runs
 * the same mix: scalar multiply-adds, and 256-bit and 512-bit int8 dot
 * products (vpdpbusd, each with its memory broadcast, as the int8 matmul
 * issues them), 8 independent chains each. Prints operations per second on
 * each core, at 1 and at THREADS threads, REPS alternating runs.
 *
 *   cc -O2 -fopenmp benchmarks/core_scaling.c -o /tmp/core_scaling
 *   /tmp/core_scaling [THREADS [REPS]]
 *
 * Needs AVX512-VNNI and AVX-VNNI (the 2-core Xeon VM has both).
 */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define STEPS 4000000000L

static int32_t words[16] __attribute__((aligned(64))) = {1, 2, 3, 4, 5, 6, 7, 8};
static volatile long sink;

/* 8 chains of `a = a * 3 + 1` (scalar), one step each; the empty asm keeps
 * the compiler from vectorizing them. */
static void scalar(void) {
    uint64_t a = 1, b = 2, c = 3, d = 4, e = 5, f = 6, g = 7, h = 8;
    for (long i = 0; i < STEPS / 8; i++) {
        __asm__ volatile("" : "+r"(a), "+r"(b), "+r"(c), "+r"(d), "+r"(e), "+r"(f), "+r"(g), "+r"(h));
        a = a * 3 + 1; b = b * 3 + 1; c = c * 3 + 1; d = d * 3 + 1;
        e = e * 3 + 1; f = f * 3 + 1; g = g * 3 + 1; h = h * 3 + 1;
    }
    sink = (long)(a + b + c + d + e + f + g + h);
}

/* 8 chains of vpdpbusd on REG (ymm or zmm), each step's second operand a
 * 32-bit word broadcast from memory, as the int8 matmul's dot products. */
#define DOT8(REG, B)                                                                                    \
    "vpdpbusd (%0)%{1to" B "%}, %%" REG "8, %%" REG "0\n\t"                                           \
    "vpdpbusd 4(%0)%{1to" B "%}, %%" REG "8, %%" REG "1\n\t"                                          \
    "vpdpbusd 8(%0)%{1to" B "%}, %%" REG "8, %%" REG "2\n\t"                                          \
    "vpdpbusd 12(%0)%{1to" B "%}, %%" REG "8, %%" REG "3\n\t"                                         \
    "vpdpbusd 16(%0)%{1to" B "%}, %%" REG "8, %%" REG "4\n\t"                                         \
    "vpdpbusd 20(%0)%{1to" B "%}, %%" REG "8, %%" REG "5\n\t"                                         \
    "vpdpbusd 24(%0)%{1to" B "%}, %%" REG "8, %%" REG "6\n\t"                                         \
    "vpdpbusd 28(%0)%{1to" B "%}, %%" REG "8, %%" REG "7\n\t"
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8"

static void dot256(void) {
    for (long i = 0; i < STEPS / 8; i++) __asm__ volatile(DOT8("ymm", "8") : : "r"(words) : CLOBBERS);
}
static void dot512(void) {
    for (long i = 0; i < STEPS / 8; i++) __asm__ volatile(DOT8("zmm", "16") : : "r"(words) : CLOBBERS);
}

/* Operations per second on each core, n threads running fn at once. */
static double rate(void (*fn)(void), int n) {
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(n)
    fn();
    return STEPS / (omp_get_wtime() - t0);
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2, reps = argc > 2 ? atoi(argv[2]) : 3;
    const struct { const char *name; void (*fn)(void); } mixes[] = {
        {"scalar a = 3a + 1", scalar}, {"vpdpbusd ymm", dot256}, {"vpdpbusd zmm", dot512}};
    printf("%-20s %4s  G/s per core at 1 thread, at %d\n", "mix", "rep", threads);
    for (int r = 0; r < reps; r++)
        for (int m = 0; m < 3; m++) {
            const double one = rate(mixes[m].fn, 1), many = rate(mixes[m].fn, threads);
            printf("%-20s %4d  %.2f  %.2f  (%.2fx in all)\n", mixes[m].name, r + 1, one / 1e9, many / 1e9,
                   threads * many / one);
        }
    return 0;
}
