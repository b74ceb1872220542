/* Tokens/s of the C run loop alone on a model of a real shape, with the time
 * of each phase of the pass (matmuls, attention, norms, ...): the profile
 * that says where a slow configuration spends it. Random weights, made here:
 * no checkpoint, no Python.
 *
 *   cc -O2 -fopenmp -Icsrc $(find csrc -name '*.c' ! -name 'test_*') \
 *      benchmarks/forward_speed.c -lm -o /tmp/forward_speed
 *   /tmp/forward_speed SHAPE f32|bf16 THREADS [PP [TG [PATH [KV]]]]
 *
 * SHAPE: 135m, 360m, 1.7b (SmolLM2), 0.5b (Qwen2.5), 7b (Llama-2), qwen3.5-2b (Gated
 * DeltaNet layers, three to each gated full-attention layer, a tied LM head
 * of 248,320 rows) or phi4-mini (heads of 128, three quarters rotated, a
 * head of 200,064 rows); the weight type may also be the mix q4_k_m, which gives
 * each matrix the type llama-quantize's Q4_K_M gives it (Q6_K for the LM
 * head, and for ffn_down and attn_qkv/attn_v in the layers llama.cpp gives
 * more bits; Q4_K elsewhere). PP prompt tokens
 * (default 512, 0 skips), TG generated tokens (default 64, 0 skips); PATH a
 * SIMD path; KV f32, bf16 or f16. pp is one pass over PP tokens from an
 * empty cache, tg TG one-token steps from an empty cache; the median of
 * FS_REPS runs (default 3) after a warm-up. Each phase is printed as its
 * share of the time and its mean wall time per pass (for tg, per token).
 * FS_PREFETCH=BYTES:LEVEL sets how far ahead, into L1 or L2, the kernels
 * ask for streamed weights (flm_set_stream_prefetch) instead of the CPU's
 * own choice.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>

#include "fastllm.h"
#include "quant.h"

static const char *PHASE_NAMES[FLM_PHASES] = {"norms", "qkv", "attention", "recurrence",
                                              "out_proj", "mlp_up", "mlp_down", "lm_head"};

/* The weight type of a name: f32, bf16, f16, q8_0, q4_0, ... q6_k. */
static int type_by_name(const char *name) {
    if (!strcmp(name, "f32")) return FLM_F32;
    if (!strcmp(name, "bf16")) return FLM_BF16;
    for (int t = FLM_F16; t < FLM_TYPES; t++)
        if (!strcmp(name, flm_quant_type(t)->name)) return t;
    return -1;
}

/* An (N, K) matrix of small pseudo-random values (or quants, with small f16
 * scales), packed. */
static FlmMatrix *random_matrix(int N, int K, int wtype, unsigned seed, int threads) {
    const FlmQuantType *q = flm_is_quantized(wtype) ? flm_quant_type(wtype) : NULL;
    size_t n = (size_t)N * K, bytes = q ? n / q->ggml_block * q->ggml_bytes : n * (wtype == FLM_F32 ? 4 : 2);
    unsigned char *raw = malloc(bytes);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < (q ? bytes : n); i++) {
        unsigned h = (unsigned)(i * 2654435761u) ^ (seed * 40503u);
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        float f = ((float)(h & 0xFFFF) / 65536.0f - 0.5f) * 0.1f;
        unsigned u; memcpy(&u, &f, 4);
        if (q) raw[i] = (unsigned char)h;
        else if (wtype == FLM_BF16) ((unsigned short *)raw)[i] = (unsigned short)(u >> 16);
        else if (wtype == FLM_F16) ((unsigned short *)raw)[i] = (unsigned short)(0x2000 | (h & 0x83FF));
        else ((float *)raw)[i] = f;
    }
    /* Every f16 scale of a block (at its start; Q6_K's at its end) small. */
    for (size_t b = 0; q && b < n / q->ggml_block; b++) {
        unsigned char *blk = raw + b * q->ggml_bytes + (wtype == FLM_Q6_K ? 208 : 0);
        blk[1] = 0x18;
        if (wtype != FLM_Q6_K && wtype != FLM_Q8_0 && wtype != FLM_Q4_0 && wtype != FLM_Q5_0) blk[3] = 0x98;
    }
    FlmMatrix *m = malloc(sizeof *m);
    void *p = malloc(flm_packed_bytes(N, K, wtype));
    flm_pack(p, raw, N, K, wtype, threads);
    free(raw);
    m->data = p;
    m->type = wtype;
    return m;
}

static float *ones(int n) {
    float *p = malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++) p[i] = 1.0f;
    return p;
}

/* CPU seconds of every thread of the process: steadier than wall time on a
 * machine whose cores other work shares. */
static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* llama.cpp's use_more_bits: the first and last eighth of n and every third between. */
static int more_bits(int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; }

/* Where layer l of a qwen3.5-2b shape is a Gated DeltaNet layer, its mixer. */
static void linear_layer(FlmLayer *L, const FlmConfig *c, int type, int qkv_type, unsigned seed, int threads) {
    const int kd = c->lin_k_heads * c->lin_k_dim, vd = c->lin_v_heads * c->lin_v_dim, cd = 2 * kd + vd;
    L->kind = FLM_LINEAR_ATTENTION;
    L->w_qkv = random_matrix(cd, c->dim, qkv_type, seed + 1, threads);
    L->w_z = random_matrix(vd, c->dim, type, seed + 2, threads);
    L->w_b = random_matrix(c->lin_v_heads, c->dim, type, seed + 3, threads);
    L->w_a = random_matrix(c->lin_v_heads, c->dim, type, seed + 4, threads);
    L->w_out = random_matrix(c->dim, vd, type, seed + 8, threads);
    float *conv = malloc(sizeof(float) * cd * c->conv_kernel), *A = malloc(sizeof(float) * c->lin_v_heads);
    float *dt = malloc(sizeof(float) * c->lin_v_heads);
    for (int i = 0; i < cd * c->conv_kernel; i++) conv[i] = 0.1f * (float)((i * 37) % 17 - 8) / 8.0f;
    for (int h = 0; h < c->lin_v_heads; h++) {
        A[h] = -(float)(h + 1) / c->lin_v_heads;
        dt[h] = 0.5f;
    }
    L->conv_w = conv;
    L->lin_A = A;
    L->dt_bias = dt;
    L->lin_norm = ones(c->lin_v_dim);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s SHAPE f32|bf16|f16|q8_0|q4_0|q4_1|q5_0|q5_1|q4_k|q5_k|q6_k THREADS [PP [TG [PATH [KV]]]]\n", argv[0]);
        return 2;
    }
    FlmConfig c = {0};
    if (!strcmp(argv[1], "135m")) {
        c.dim = 576; c.hidden_dim = 1536; c.n_layers = 30; c.n_heads = 9; c.n_kv_heads = 3;
    } else if (!strcmp(argv[1], "360m")) {
        c.dim = 960; c.hidden_dim = 2560; c.n_layers = 32; c.n_heads = 15; c.n_kv_heads = 5;
    } else if (!strcmp(argv[1], "1.7b")) {
        c.dim = 2048; c.hidden_dim = 8192; c.n_layers = 24; c.n_heads = 32; c.n_kv_heads = 32;
    } else if (!strcmp(argv[1], "0.5b")) {
        c.dim = 896; c.hidden_dim = 4864; c.n_layers = 24; c.n_heads = 14; c.n_kv_heads = 2;
    } else if (!strcmp(argv[1], "7b")) {
        c.dim = 4096; c.hidden_dim = 11008; c.n_layers = 32; c.n_heads = 32; c.n_kv_heads = 32;
    } else if (!strcmp(argv[1], "qwen3.5-2b")) {
        c.dim = 2048; c.hidden_dim = 6144; c.n_layers = 24; c.n_heads = 8; c.n_kv_heads = 2;
        c.lin_k_heads = c.lin_v_heads = 16; c.lin_k_dim = c.lin_v_dim = 128; c.conv_kernel = 4;
    } else if (!strcmp(argv[1], "phi4-mini")) {
        c.dim = 3072; c.hidden_dim = 8192; c.n_layers = 32; c.n_heads = 24; c.n_kv_heads = 8;
    } else {
        fprintf(stderr, "unknown shape %s\n", argv[1]);
        return 2;
    }
    const int qwen35 = c.conv_kernel > 0;
    c.head_dim = qwen35 ? 256 : c.dim / c.n_heads;
    const int phi4 = !strcmp(argv[1], "phi4-mini");
    c.vocab_size = !strcmp(argv[1], "7b") ? 32000 : qwen35 ? 248320 : phi4 ? 200064
                 : !strcmp(argv[1], "0.5b") ? 151936 : 49152;
    const int q4_k_m = !strcmp(argv[2], "q4_k_m");
    const int wtype = q4_k_m ? FLM_Q4_K : type_by_name(argv[2]);
    if (wtype < 0) {
        fprintf(stderr, "unknown weight type %s\n", argv[2]);
        return 2;
    }
    if (flm_is_quantized(wtype) && (c.dim % flm_quant_type(wtype)->sb || c.hidden_dim % flm_quant_type(wtype)->sb)) {
        fprintf(stderr, "%s needs matrix rows of whole %d-value blocks\n", argv[2], flm_quant_type(wtype)->sb);
        return 2;
    }
    const int threads = atoi(argv[3]);
    const int pp = argc > 4 ? atoi(argv[4]) : 512, tg = argc > 5 ? atoi(argv[5]) : 64;
    int reps = getenv("FS_REPS") ? atoi(getenv("FS_REPS")) : 3;
    reps = reps < 1 ? 1 : reps > 16 ? 16 : reps;
    if (argc > 6 && flm_set_simd_path(argv[6]) != 0) {
        fprintf(stderr, "no SIMD path %s on this CPU\n", argv[6]);
        return 2;
    }
    const char *prefetch = getenv("FS_PREFETCH");
    int ahead, level;
    if (prefetch && (sscanf(prefetch, "%d:%d", &ahead, &level) != 2 || flm_set_stream_prefetch(ahead, level) != 0)) {
        fprintf(stderr, "FS_PREFETCH=%s: not BYTES:LEVEL (a multiple of 64 up to 65536, 1 or 2) on this CPU\n",
                prefetch);
        return 2;
    }
    c.kv_type = argc > 7 ? (!strcmp(argv[7], "bf16") ? FLM_BF16 : !strcmp(argv[7], "f16") ? FLM_F16 : FLM_F32) : FLM_F32;
    c.seq_len = (pp > tg ? pp : tg) + 1;
    c.rope_dim = qwen35 ? c.head_dim / 4 : phi4 ? c.head_dim * 3 / 4 : c.head_dim;
    c.norm_eps = 1e-5f;
    c.attn_scale = 1.0f / sqrtf((float)c.head_dim);
    c.embed_scale = c.residual_scale = c.logits_div = 1.0f;

    const int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
    FlmLayer *layers = calloc(c.n_layers, sizeof *layers);
    /* llama.cpp counts attn_v and attn_qkv matrices together for more_bits. */
    for (int l = 0, n_v = 0; l < c.n_layers; l++) {
        FlmLayer *L = &layers[l];
        L->head_dim = c.head_dim; L->n_kv_heads = c.n_kv_heads; L->rope_dim = c.rope_dim;
        L->hidden_dim = c.hidden_dim; L->kv_layer = l;
        unsigned seed = 16 * (unsigned)l;
        const int v_type = q4_k_m && more_bits(n_v++, c.n_layers) ? FLM_Q6_K : wtype;
        if (qwen35 && l % 4 != 3) {
            linear_layer(L, &c, wtype, v_type, seed, threads);
        } else {
            L->kind = FLM_ATTENTION;
            L->wq = random_matrix(qd, c.dim, wtype, seed + 1, threads);
            L->wk = random_matrix(kvd, c.dim, wtype, seed + 2, threads);
            L->wv = random_matrix(kvd, c.dim, v_type, seed + 3, threads);
            L->wo = random_matrix(c.dim, qd, wtype, seed + 4, threads);
            if (qwen35) {
                L->w_attn_gate = random_matrix(qd, c.dim, wtype, seed + 9, threads);
                L->q_norm = ones(c.head_dim);
                L->k_norm = ones(c.head_dim);
            }
        }
        L->w_gate = random_matrix(c.hidden_dim, c.dim, wtype, seed + 5, threads);
        L->w_up = random_matrix(c.hidden_dim, c.dim, wtype, seed + 6, threads);
        L->w_down = random_matrix(c.dim, c.hidden_dim, q4_k_m && more_bits(l, c.n_layers) ? FLM_Q6_K : wtype,
                                  seed + 7, threads);
        L->attn_norm = ones(c.dim);
        L->ffn_norm = ones(c.dim);
    }
    const int half = c.rope_dim / 2;
    float *cosv = malloc(sizeof(float) * c.seq_len * half), *sinv = malloc(sizeof(float) * c.seq_len * half);
    for (int p = 0; p < c.seq_len; p++)
        for (int i = 0; i < half; i++) {
            double a = p * pow(10000.0, -2.0 * i / c.rope_dim);
            cosv[p * half + i] = (float)cos(a);
            sinv[p * half + i] = (float)sin(a);
        }
    for (int l = 0; l < c.n_layers; l++) { layers[l].rope_cos = cosv; layers[l].rope_sin = sinv; }
    FlmWeights w = {.embed = NULL, .layers = layers, .norm = ones(c.dim),
                    .lm_head = random_matrix(c.vocab_size, c.dim, q4_k_m ? FLM_Q6_K : wtype, 9999, threads)};

    const int batch = pp > 0 ? pp : 1;
    FlmState s;
    float *work = calloc(flm_state_work_floats(&c, batch, threads), sizeof(float));
    float *cache = calloc(flm_state_cache_floats(&c, layers), sizeof(float));
    flm_state_init(&s, &c, layers, batch, threads, work, cache);
    float *logits = malloc(sizeof(float) * c.vocab_size);
    int32_t *tokens = malloc(sizeof(int32_t) * (batch > tg ? batch : tg));
    for (int i = 0; i < (batch > tg ? batch : tg); i++) tokens[i] = (int32_t)((i * 7919) % c.vocab_size);

    printf("shape %s, %s weights, %s KV, %d threads, path %s (int8: %s)", argv[1], argv[2],
           argc > 7 ? argv[7] : "f32", threads, flm_simd_path(), flm_int8_name());
    if (flm_stream_prefetch(&ahead, &level) == 0) printf(", prefetch %d bytes ahead into L%d", ahead, level);
    printf("\n");
    for (int test = 0; test < 2; test++) {
        const int n = test == 0 ? pp : tg;
        if (n <= 0) continue;
        double times[16], cpu_times[16], profile[FLM_PHASES] = {0};
        for (int rep = -1; rep < reps; rep++) {
            double prof[FLM_PHASES] = {0};
            s.profile = prof;
            double t0 = omp_get_wtime(), c0 = cpu_seconds();
            if (test == 0) flm_forward(&c, &w, &s, tokens, pp, 0, logits, 0, threads);
            else
                for (int i = 0; i < tg; i++) flm_forward(&c, &w, &s, tokens + i, 1, i, logits, 0, threads);
            double dt = omp_get_wtime() - t0;
            if (rep < 0) continue;
            times[rep] = dt;
            cpu_times[rep] = cpu_seconds() - c0;
            for (int k = 0; k < FLM_PHASES; k++) profile[k] += prof[k] / reps;
        }
        qsort(times, reps, sizeof times[0], cmp);
        qsort(cpu_times, reps, sizeof cpu_times[0], cmp);
        double med = times[reps / 2], total = 0;
        for (int k = 0; k < FLM_PHASES; k++) total += profile[k];
        printf("%s%d: %.1f tok/s  (ms per pass: %.2f, CPU ms per pass: %.2f; phases:", test == 0 ? "pp" : "tg", n,
               n / med, med * 1e3 / (test == 0 ? 1 : tg), cpu_times[reps / 2] * 1e3 / (test == 0 ? 1 : tg));
        for (int k = 0; k < FLM_PHASES; k++)
            if (profile[k] > 0)
                printf(" %s %.0f%% %.0f us", PHASE_NAMES[k], 100 * profile[k] / total,
                       profile[k] * 1e6 / (test == 0 ? 1 : tg));
        printf(")\n");
    }
    return 0;
}
