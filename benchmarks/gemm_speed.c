/* GFLOP/s of fastllm's matmul, per core, for the matrix shapes of real models.
 *
 * Each case runs flm_matmul (the run loop's own split over threads) on a
 * random packed matrix: T = 512 tokens for prefill, T = 1 for decoding,
 * where it also reports the weight bytes streamed per second. Median of
 * several repetitions.
 *
 *   cc -O3 -fno-fast-math -ffp-contract=off -fopenmp -Icsrc \
 *      $(find csrc -name '*.c' ! -name 'test_*') benchmarks/gemm_speed.c -lm -o /tmp/gemm_speed
 *
 * (setup.py's flags for the C core, so that the kernels timed are the ones
 * users run), then
 *
 *   /tmp/gemm_speed [threads] [path] [f32|bf16|f16|q8_0|q4_0|...|q6_k] [T] [shapes] [copies]
 *
 * path: a SIMD path name (default: the best this CPU has); T: the tokens
 * of one pass (default 512 and 1); shapes: only those whose name contains
 * this text; copies: how many copies of each matrix one repetition runs in
 * turn (default 1). A decoding step reads each matrix once from memory,
 * and a lone matrix of a few MB stays in the last-level cache from one
 * repetition to the next: copies that together outgrow that cache time
 * the kernel as a model's decoding meets it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fastllm.h"
#include "quant.h"

static const struct { const char *what; int N, K; } SHAPES[] = {
    {"135M qkv/o    576x576", 576, 576},
    {"135M up      1536x576", 1536, 576},
    {"135M down    576x1536", 576, 1536},
    {"1.7B q/o    2048x2048", 2048, 2048},
    {"1.7B up     8192x2048", 8192, 2048},
    {"1.7B down   2048x8192", 2048, 8192},
    {"2B up       6144x2048", 6144, 2048},
    {"2B down     2048x6144", 2048, 6144},
    {"7B up     14336x4096", 14336, 4096},
    {"head      49152x2048", 49152, 2048},
    {"3B up      8192x3072", 8192, 3072},
    {"3B down    3072x8192", 3072, 8192},
    {"3B output 128256x3072", 128256, 3072},
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    if (argc > 2 && flm_set_simd_path(argv[2]) != 0) {
        fprintf(stderr, "no SIMD path %s on this CPU\n", argv[2]);
        return 2;
    }
    const char *tname = argc > 3 ? argv[3] : "f32";
    int wtype = !strcmp(tname, "bf16") ? FLM_BF16 : FLM_F32;
    for (int ty = FLM_F16; ty < FLM_TYPES; ty++)
        if (!strcmp(tname, flm_quant_type(ty)->name)) wtype = ty;
    int only_T = argc > 4 ? atoi(argv[4]) : 0;
    const char *only_shapes = argc > 5 ? argv[5] : "";
    const int copies = argc > 6 ? atoi(argv[6]) : 1;
    if (copies < 1) {
        fprintf(stderr, "copies must be 1 or more\n");
        return 2;
    }
    const FlmQuantType *q = flm_is_quantized(wtype) ? flm_quant_type(wtype) : NULL;
    size_t esize = wtype == FLM_F32 ? 4 : 2;
    printf("path %s (int8: %s), %s weights, %d threads\n", flm_simd_path(), flm_int8_name(), tname, threads);
    printf("%-22s %6s %12s %10s\n", "matrix (N x K)", "T", "GFLOP/s/core", "GB/s");
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) {
        const int N = SHAPES[i].N, K = SHAPES[i].K;
        if (!strstr(SHAPES[i].what, only_shapes)) continue;
        if (q && K % q->sb) continue;
        const size_t bytes = q ? (size_t)N * K / q->ggml_block * q->ggml_bytes : (size_t)N * K * esize;
        unsigned char *raw = malloc(bytes);
        for (size_t j = 0; j < (q ? bytes : (size_t)N * K); j++) {
            float f = (float)((j * 2654435761u) % 1000) / 1000.0f - 0.5f;
            uint32_t u; memcpy(&u, &f, 4);
            if (q) raw[j] = (unsigned char)(j * 2654435761u >> 13);
            else if (wtype == FLM_BF16) ((uint16_t *)raw)[j] = u >> 16;
            else if (wtype == FLM_F16) ((uint16_t *)raw)[j] = (uint16_t)(0x2000 | (j * 40503u & 0x83FF));
            else ((float *)raw)[j] = f;
        }
        /* Small f16 scales (and K-quant mins): random ones would be NaNs,
         * infinities and subnormals, whose float work is not a model's. */
        for (size_t b = 0; q && b < (size_t)N * K / q->ggml_block; b++) {
            raw[b * q->ggml_bytes + (wtype == FLM_Q6_K ? 209 : 1)] = 0x18;
            if (wtype == FLM_Q4_K || wtype == FLM_Q5_K) raw[b * q->ggml_bytes + 3] = 0x18;
        }
        FlmMatrix *w = malloc(sizeof *w * copies);
        for (int c = 0; c < copies; c++) {
            w[c] = (FlmMatrix){malloc(flm_packed_bytes(N, K, wtype)), wtype};
            flm_pack((void *)w[c].data, raw, N, K, wtype, threads);
        }
        free(raw);
        const int Ts[2] = {only_T > 0 ? only_T : 512, 1};
        for (int ti = 0; ti < 2; ti++) {
            const int T = Ts[ti];
            if (only_T && T != only_T) continue;
            float *x = malloc(sizeof(float) * T * K), *out = malloc(sizeof(float) * T * N);
            FlmConfig c = {.dim = K, .hidden_dim = K, .n_layers = 1, .n_heads = 1, .n_kv_heads = 1,
                           .head_dim = 16, .vocab_size = N, .seq_len = 16, .rope_dim = 16};
            FlmState st;
            float *work = calloc(flm_state_work_floats(&c, T, threads), 4);
            flm_state_init(&st, &c, NULL, T, threads, work, NULL);
            for (size_t j = 0; j < (size_t)T * K; j++) x[j] = (float)(j % 97) / 97.0f - 0.5f;
            double flop = 2.0 * T * N * K, t[9];
            int reps = 0;
            double start = now();
            for (int c = 0; c < copies; c++) flm_matmul(out, x, &w[c], T, K, N, &st, 0, threads);  /* warm-up */
            while (reps < 9 && (reps < 3 || now() - start < 2.0)) {
                double t0 = now();
                for (int c = 0; c < copies; c++) flm_matmul(out, x, &w[c], T, K, N, &st, 0, threads);
                t[reps++] = now() - t0;
            }
            qsort(t, reps, sizeof t[0], cmp);
            double med = t[reps / 2] / copies;
            printf("%-22s %6d %12.1f %10.1f\n", SHAPES[i].what, T, flop / med / threads * 1e-9,
                   (double)flm_packed_bytes(N, K, wtype) / med * 1e-9);
            free(x); free(out); free(work);
        }
        for (int c = 0; c < copies; c++) free((void *)w[c].data);
        free(w);
    }
    return 0;
}
