/* llama.cpp's load time, as llama-cli meets it: llama_model_load_from_file,
 * llama_init_from_model and one llama_decode of a one-token prompt, timed
 * from the start of the load. The first decode is part of it because with
 * mmap the weights are read only when a pass first touches them.
 *
 *   llama_load FILE.gguf mmap|none THREADS
 *
 * prints {"load_s": ..., "first_token_s": ...}. moe_speed.py builds it against
 * llama.cpp's libllama (see there). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc != 4 || (strcmp(argv[2], "mmap") && strcmp(argv[2], "none"))) {
        fprintf(stderr, "usage: %s FILE.gguf mmap|none THREADS\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[3]);
    llama_log_set(quiet, NULL);
    llama_backend_init();

    double t0 = now();
    struct llama_model_params mp = llama_model_default_params();
    mp.load_mode = strcmp(argv[2], "mmap") == 0 ? LLAMA_LOAD_MODE_MMAP : LLAMA_LOAD_MODE_NONE;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    double t1 = now();

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = threads;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }
    llama_token token = 0;
    if (llama_decode(ctx, llama_batch_get_one(&token, 1))) { fprintf(stderr, "decode failed\n"); return 1; }
    double t2 = now();

    printf("{\"load_s\": %.4f, \"first_token_s\": %.4f}\n", t1 - t0, t2 - t0);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
