/* Standalone test of the C core, no Python: a small random model run
 *  - in one batched call and one token at a time (must agree bit for bit),
 *  - with 1 and 3 threads (bit for bit),
 *  - on every SIMD path this CPU has, against the portable path (close),
 *  - with fp32 and bf16 weights, q/k norms, biases, the attention output
 *    gate, a Gated DeltaNet layer and sliding-window attention, and Gemma's
 *    switches (GeLU, soft-capped scores and logits, sandwich norms),
 *  - the softmax, SiLU, GeLU, soft-cap, delta-rule and conv kernels of
 *    every path against double precision, to_bf16 and the two-query
 *    attention kernels bit for bit against their references,
 *  - with every quantized weight type: the int8 matmul of each SIMD path
 *    against the portable one (bit for bit), the fp32-activation matmul
 *    against the fp32 matmul of the dequantized matrix (bit for bit), and
 *    whole models as above, each path's bit for bit against itself with the
 *    portable int8 kernels swapped in.
 * Everything it allocates is freed, so it runs clean under LeakSanitizer.
 * Build: cc -O2 -fopenmp, every csrc .c file but the tests, csrc/test_core.c, -lm
 * (aarch64 under emulation: tests/arm64.sh) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fastllm.h"
#include "kernels.h"
#include "quant.h"

static unsigned long long rng_state = 88172645463325252ULL;
static float frand(void) { /* xorshift64, uniform in [-1, 1) */
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) / 8388608.0 - 1.0);
}

/* Every buffer of the model under test, freed when the test is done. */
static void *owned[512];
static int n_owned = 0;
static void *own(void *p) {
    if (n_owned == (int)(sizeof owned / sizeof owned[0])) abort();
    owned[n_owned++] = p;
    return p;
}
static void free_owned(void) {
    while (n_owned) free(owned[--n_owned]);
}

static void *alloc(size_t n, int wtype, float scale);

/* Bytes of a row of K values of a weight type. */
static size_t row_size(int K, int type) {
    const FlmQuantType *q = flm_quant_type(type);
    return q ? (size_t)K / q->ggml_block * q->ggml_bytes : (size_t)K * (type == FLM_BF16 ? 2 : 4);
}

/* n rows of K random weights of a quantized type: random quants and scale
 * bits, with the f16 scales set to small finite values. */
static void *random_blocks(size_t n, int K, int type, float scale) {
    const FlmQuantType *q = flm_quant_type(type);
    const size_t bytes = n * row_size(K, type), blocks = n * (size_t)K / q->ggml_block;
    uint8_t *p = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)(frand() * 128.0f + 128.0f);
    const int d_at = type == FLM_Q6_K ? 208 : 0, has_m = type == FLM_Q4_1 || type == FLM_Q5_1 ||
                                                        type == FLM_Q4_K || type == FLM_Q5_K;
    const float unit = type == FLM_Q8_0 ? 0.004f : type >= FLM_Q4_K ? 0.002f : 0.03f;
    for (size_t b = 0; b < blocks; b++) {
        uint8_t *blk = p + b * q->ggml_bytes;
        uint16_t d = flm_f32_to_f16(scale * unit * (1.0f + 0.5f * frand())), m = flm_f32_to_f16(scale * unit * frand());
        memcpy(blk + d_at, &d, 2);
        if (has_m) memcpy(blk + 2, &m, 2);
    }
    return p;
}

static void *alloc_rows(int N, int K, int type, float scale) {
    if (flm_is_quantized(type)) return random_blocks((size_t)N, K, type, scale);
    return alloc((size_t)N * K, type, scale);
}

static FlmMatrix *matrix(const void *data, int type) {
    FlmMatrix *m = own(malloc(sizeof *m));
    m->data = data;
    m->type = type;
    return m;
}

static void *alloc(size_t n, int wtype, float scale) {
    if (wtype == FLM_F16) {
        uint16_t *p = malloc(n * 2);
        for (size_t i = 0; i < n; i++) p[i] = flm_f32_to_f16(frand() * scale);
        return p;
    }
    if (wtype == FLM_BF16) {
        uint16_t *p = malloc(n * 2);
        for (size_t i = 0; i < n; i++) { float f = frand() * scale; uint32_t u; memcpy(&u, &f, 4); p[i] = u >> 16; }
        return p;
    }
    float *p = malloc(n * 4);
    for (size_t i = 0; i < n; i++) p[i] = frand() * scale;
    return p;
}

static FlmMatrix *packed(const void *m, int N, int K, int wtype) {
    void *p = own(malloc(flm_packed_bytes(N, K, wtype)));
    flm_pack(p, m, N, K, wtype, 2);
    return matrix(p, wtype);
}

static FlmMatrix *mat(int N, int K, int wtype, float scale) {
    void *m = alloc_rows(N, K, wtype, scale);
    FlmMatrix *p = packed(m, N, K, wtype);
    free(m);
    return p;
}

static float *vec(size_t n, float base, float scale) {
    float *p = own(malloc(n * 4));
    for (size_t i = 0; i < n; i++) p[i] = base + frand() * scale;
    return p;
}

/* Every SIMD path of every architecture; those this CPU lacks are skipped. */
static const char *paths[] = {"generic", "avx2", "avx512", "avx512_bf16", "amx_bf16",
                              "neon", "dotprod", "i8mm", "neon_bf16"};
#define N_PATHS (int)(sizeof paths / sizeof paths[0])

static int imin(int a, int b) { return a < b ? a : b; }
static int imax(int a, int b) { return a > b ? a : b; }

static int failures = 0;
#define CHECK(cond, ...) do { if (!(cond)) { printf("FAIL: " __VA_ARGS__); printf("\n"); failures++; } } while (0)

static void run(const FlmConfig *c, const FlmWeights *w, const int32_t *tok, int n, int batch,
                int step, int threads, float *logits) {
    FlmState s;
    float *work = calloc(flm_state_work_floats(c, batch, 4), 4);
    float *cache = calloc(flm_state_cache_floats(c, w->layers), 4);
    flm_state_init(&s, c, w->layers, batch, 4, work, cache);
    if (step) {
        for (int i = 0; i < n; i++)
            flm_forward(c, w, &s, tok + i, 1, i, logits + (size_t)i * c->vocab_size, 0, threads);
    } else {
        flm_forward(c, w, &s, tok, n, 0, logits, 1, threads);
    }
    free(work);
    free(cache);
}

/* A Gated DeltaNet layer's mixer, as in Qwen3.5 (Hv != Hk, dk != dv). */
/* Three run states of 16 tokens a pass and 4 threads, zeroed; bufs gets
 * their memory, to free. */
static void three_states(const FlmConfig *c, const FlmWeights *w, FlmState st[3], float *bufs[6]) {
    for (int i = 0; i < 3; i++) {
        bufs[2 * i] = calloc(flm_state_work_floats(c, 16, 4), 4);
        bufs[2 * i + 1] = calloc(flm_state_cache_floats(c, w->layers), 4);
        flm_state_init(&st[i], c, w->layers, 16, 4, bufs[2 * i], bufs[2 * i + 1]);
    }
}

/* Continuous batching: sequence A prefills 5 tokens, then B joins with 3 while A
 * decodes, then both decode one token per pass. Each sequence's logits must
 * be, bit for bit, those of the same steps run alone. */
static void test_batch(const FlmConfig *c, const FlmWeights *w, const int32_t *tok, const char *path) {
    enum { STEPS = 8 };
    const size_t V = (size_t)c->vocab_size;
    FlmState st[3];
    float *bufs[6];
    three_states(c, w, st, bufs);
    const int32_t *ta = tok, *tb = tok + 20;
    float *batched = malloc(2 * V * 4 * STEPS), *alone = malloc(2 * V * 4 * STEPS), *out = malloc(2 * V * 4);
    int posa = 0, posb = 0, same = 1;
    /* B's state held another sequence before: starting at position 0 must
     * forget it (recurrent states included). */
    flm_forward(c, w, &st[1], tok + 30, 4, 0, out, 0, 1);
    for (int step = 0; step < STEPS; step++) {
        FlmSeq seqs[2];
        int ns = 0, na = step == 0 ? 5 : 1, nb = step == 1 ? 3 : 1;
        seqs[ns++] = (FlmSeq){&st[0], ta + posa, na, posa, 1};
        if (step >= 1) seqs[ns++] = (FlmSeq){&st[1], tb + posb, nb, posb, 1};
        flm_forward_batch(c, w, &st[0], seqs, ns, out, 2);
        memcpy(batched + 2 * V * step, out, ns * V * 4);
        flm_forward(c, w, &st[2], ta + posa, na, posa, alone + 2 * V * step, 0, 1);
        posa += na;
        if (step >= 1) posb += nb;
    }
    /* B alone, in a fresh state, with the same steps. */
    memset(bufs[5], 0, flm_state_cache_floats(c, w->layers) * 4);
    for (int step = 1, pos = 0; step < STEPS; step++) {
        int nb = step == 1 ? 3 : 1;
        flm_forward(c, w, &st[2], tb + pos, nb, pos, alone + 2 * V * step + V, 0, 3);
        pos += nb;
    }
    for (int step = 0; step < STEPS; step++)
        same &= memcmp(batched + 2 * V * step, alone + 2 * V * step, (step ? 2 : 1) * V * 4) == 0;
    CHECK(same, "%s: a sequence in a batch differs from the same sequence alone", path);
    free(batched); free(alone); free(out);
    for (int i = 0; i < 6; i++) free(bufs[i]);
}

/* Speculative decoding's verification: after a prompt, one pass runs 6
 * drafted tokens beside another sequence, with the logits of each; then
 * only the first j are kept (flm_state_rollback) and the sequence goes on
 * with 3 other tokens. The logits of the pass and of what follows must be,
 * bit for bit, those of the kept tokens run alone. */
static void test_rollback(const FlmConfig *c, const FlmWeights *w, const int32_t *tok, const char *path) {
    enum { PROMPT = 5, DRAFT = 6, MORE = 3, ROWS = 8 };
    const size_t V = (size_t)c->vocab_size;
    FlmState st[3];
    float *bufs[6];
    three_states(c, w, st, bufs);
    float *saved = calloc(flm_state_saved_floats(c) + 1, 4), *kept = calloc(flm_state_keep_floats(c, ROWS) + 1, 4);
    st[0].lin_saved = saved;
    st[0].lin_keep = kept;
    st[0].keep_rows = ROWS;
    float *pass = malloc((DRAFT + 1) * V * 4), *plain = malloc(DRAFT * V * 4);
    float *after = malloc(MORE * V * 4), *ref = malloc(MORE * V * 4);
    const int32_t *draft = tok + 10, *more = tok + 24;
    int same = 1, refused = 1;
    for (int j = 0; j <= DRAFT; j++) {
        flm_forward(c, w, &st[0], tok, PROMPT, 0, pass, 0, 2);
        flm_forward(c, w, &st[1], tok + 30, 2, 0, pass, 0, 2);
        st[0].keep = 1;
        FlmSeq seqs[2] = {{&st[1], tok + 32, 1, 2, 1}, {&st[0], draft, DRAFT, PROMPT, DRAFT}};
        flm_forward_batch(c, w, &st[1], seqs, 2, pass, 2);
        st[0].keep = 0;
        refused &= flm_state_rollback(c, w, &st[0], &st[1], DRAFT + 1, 2) == -1;
        CHECK(flm_state_rollback(c, w, &st[0], &st[1], j, 2) == 0, "%s: rollback to %d refused", path, j);
        flm_forward(c, w, &st[0], more, MORE, PROMPT + j, after, 1, 2);
        /* the same tokens, run plainly */
        flm_forward(c, w, &st[2], tok, PROMPT, 0, ref, 0, 1);
        flm_forward(c, w, &st[2], draft, DRAFT, PROMPT, plain, 1, 1);
        same &= memcmp(pass + V, plain, DRAFT * V * 4) == 0;
        flm_forward(c, w, &st[2], tok, PROMPT, 0, ref, 0, 1);
        if (j) flm_forward(c, w, &st[2], draft, j, PROMPT, ref, 0, 1);
        flm_forward(c, w, &st[2], more, MORE, PROMPT + j, ref, 1, 1);
        same &= memcmp(after, ref, MORE * V * 4) == 0;
    }
    CHECK(same, "%s: a pass rolled back differs from its kept tokens run alone", path);
    CHECK(refused, "%s: a rollback past the kept tokens was not refused", path);
    /* A pass that did not keep leaves nothing to roll back to. */
    flm_forward(c, w, &st[0], tok, PROMPT, 0, pass, 0, 2);
    CHECK(flm_state_rollback(c, w, &st[0], &st[1], 0, 2) == -1, "%s: rollback after a plain pass", path);
    free(pass); free(plain); free(after); free(ref); free(saved); free(kept);
    for (int i = 0; i < 6; i++) free(bufs[i]);
}

static void linear_layer(FlmLayer *L, const FlmConfig *c, int wtype) {
    int kd = c->lin_k_heads * c->lin_k_dim, vd = c->lin_v_heads * c->lin_v_dim, conv = 2 * kd + vd;
    L->kind = FLM_LINEAR_ATTENTION;
    L->w_qkv = mat(conv, c->dim, wtype, 0.3f);
    L->w_z = mat(vd, c->dim, wtype, 0.3f);
    L->w_b = mat(c->lin_v_heads, c->dim, wtype, 0.3f);
    L->w_a = mat(c->lin_v_heads, c->dim, wtype, 0.3f);
    L->conv_w = vec((size_t)conv * c->conv_kernel, 0.0f, 0.5f);
    L->lin_A = vec(c->lin_v_heads, -1.0f, 0.5f);  /* -exp(A_log) < 0 */
    L->dt_bias = vec(c->lin_v_heads, 0.0f, 0.5f);
    L->lin_norm = vec(c->lin_v_dim, 1.0f, 0.2f);
    L->w_out = mat(c->dim, vd, wtype, 0.3f);
}

/* Every attention layer's window: `window` for the first, 14 more for the
 * next (0: all see the whole context). */
static void set_windows(FlmLayer *layers, int n_layers, int window) {
    for (int l = 0; l < n_layers; l++) layers[l].window = window ? window + 14 * l : 0;
}

/* gemma: the GeLU-tanh MLP, attention scores and logits soft-capped (caps
 * the random scores and logits reach), scaled embeddings and norms around
 * both sublayers. */
static void test_model(int wtype, int qk_norm, int bias, int gate, int linear, int window, int gemma) {
    FlmConfig c = {.dim = 71, .hidden_dim = 100, .n_layers = 2, .n_heads = 6, .n_kv_heads = 2,
                   .head_dim = 20, .vocab_size = 97, .seq_len = 40, .rope_dim = 16,
                   .norm_eps = 1e-5f, .attn_scale = 1.0f / sqrtf(20.0f),
                   .embed_scale = 1.0f, .residual_scale = 1.0f, .logits_div = 1.0f};
    if (gemma) {
        c.activation = FLM_GELU_TANH;
        c.attn_softcap = 0.5f;
        c.logit_softcap = 2.0f;
        c.embed_scale = 3.0f;
    }
    if (linear) {
        c.lin_k_heads = 2; c.lin_v_heads = 4; c.lin_k_dim = 12; c.lin_v_dim = 10; c.conv_kernel = 4;
    }
    if (flm_is_quantized(wtype) || wtype == FLM_F16) {
        /* Every matmul input a whole number of superblocks (256). */
        c.dim = 256; c.hidden_dim = 512; c.n_heads = 8; c.head_dim = 32;
        c.attn_scale = 1.0f / sqrtf(32.0f);
        if (linear) { c.lin_k_dim = 16; c.lin_v_dim = 64; }
    }
    int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
    FlmLayer layers[2];
    for (int l = 0; l < c.n_layers; l++) {
        FlmLayer *L = &layers[l];
        memset(L, 0, sizeof *L);
        L->head_dim = c.head_dim; L->n_kv_heads = c.n_kv_heads; L->rope_dim = c.rope_dim;
        L->hidden_dim = c.hidden_dim; L->kv_layer = l;
        L->w_gate = mat(c.hidden_dim, c.dim, wtype, 0.3f);
        L->w_up = mat(c.hidden_dim, c.dim, wtype, 0.3f);
        L->w_down = mat(c.dim, c.hidden_dim, wtype, 0.3f);
        L->attn_norm = vec(c.dim, 1.0f, 0.2f);
        L->ffn_norm = vec(c.dim, 1.0f, 0.2f);
        if (gemma) {
            L->post_attn_norm = vec(c.dim, 1.0f, 0.2f);
            L->post_ffn_norm = vec(c.dim, 1.0f, 0.2f);
        }
        if (linear && l == 0) {
            linear_layer(L, &c, wtype);
            continue;
        }
        if (gate) L->w_attn_gate = mat(qd, c.dim, wtype, 0.3f);
        L->wq = mat(qd, c.dim, wtype, 0.3f);
        L->wk = mat(kvd, c.dim, wtype, 0.3f);
        L->wv = mat(kvd, c.dim, wtype, 0.3f);
        L->wo = mat(c.dim, qd, wtype, 0.3f);
        if (qk_norm) { L->q_norm = vec(c.head_dim, 1.0f, 0.2f); L->k_norm = vec(c.head_dim, 1.0f, 0.2f); }
        if (bias) {
            L->bq = vec(qd, 0, 0.1f); L->bk = vec(kvd, 0, 0.1f); L->bv = vec(kvd, 0, 0.1f);
            L->bo = vec(c.dim, 0, 0.1f); L->b_gate = vec(c.hidden_dim, 0, 0.1f);
            L->b_up = vec(c.hidden_dim, 0, 0.1f); L->b_down = vec(c.dim, 0, 0.1f);
        }
    }
    set_windows(layers, c.n_layers, window);
    float *cosv = own(malloc((size_t)c.seq_len * c.rope_dim / 2 * 4)), *sinv = own(malloc((size_t)c.seq_len * c.rope_dim / 2 * 4));
    for (int p = 0; p < c.seq_len; p++)
        for (int i = 0; i < c.rope_dim / 2; i++) {
            float a = p * powf(10000.0f, -2.0f * i / c.rope_dim);
            cosv[p * c.rope_dim / 2 + i] = cosf(a);
            sinv[p * c.rope_dim / 2 + i] = sinf(a);
        }
    const void *table = own(alloc_rows(c.vocab_size, c.dim, wtype, 1.0f));
    for (int l = 0; l < c.n_layers; l++) { layers[l].rope_cos = cosv; layers[l].rope_sin = sinv; }
    FlmWeights w = {.embed = matrix(table, wtype), .layers = layers, .norm = vec(c.dim, 1.0f, 0.2f)};
    w.lm_head = packed(table, c.vocab_size, c.dim, wtype);

    int n = 37;
    int32_t tok[37];
    for (int i = 0; i < n; i++) tok[i] = (int32_t)((i * 31 + 7) % c.vocab_size);
    size_t sz = (size_t)n * c.vocab_size;
    float *full = own(malloc(sz * 4)), *other = own(malloc(sz * 4)), *generic = own(malloc(sz * 4));

    flm_set_simd_path("generic");
    run(&c, &w, tok, n, 64, 0, 2, generic);
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        run(&c, &w, tok, n, 64, 0, 2, full);
        run(&c, &w, tok, n, 64, 1, 1, other);
        CHECK(memcmp(full, other, sz * 4) == 0, "%s wtype=%d: one token at a time differs from batched", paths[pi], wtype);
        run(&c, &w, tok, n, 5, 0, 3, other);
        CHECK(memcmp(full, other, sz * 4) == 0, "%s wtype=%d: 3 threads / batch 5 differ", paths[pi], wtype);
        /* bf16 weights on the BF16 dot-product and AMX paths also round
         * the activations to bf16 (8 significant bits): a bound to match.
         * The portable path is the reference the others are held to. */
        const int bf16_dots = flm_kernels->to_bf16 != NULL;
        double tol = (wtype == FLM_BF16 && bf16_dots) ? 0.25 : 1e-4;
        if (flm_is_quantized(wtype)) tol = 0.05; /* reported only: see below */
        double maxerr = 0;
        for (size_t i = 0; pi > 0 && i < sz; i++) {
            double e = fabs(full[i] - generic[i]) / (tol + tol * fabs(generic[i]));
            if (e > maxerr) maxerr = e;
        }
        if (flm_is_quantized(wtype)) {
            /* Int8 activations turn the float kernels' last-bit differences
             * (a path's FMA where the portable loop multiplies, then adds)
             * into whole quantization steps of an activation now and then,
             * a logit moved far past any bound for rounding: of 16 draws of
             * this model at Q6_K, 8 did so on AVX-512 and 4 on NEON. So the
             * int8 kernels are held to the portable pair under this path's
             * own float kernels, bit for bit; the float kernels are held to
             * the portable path by the fp32 and bf16 models of each shape. */
            const FlmKernels *path = flm_kernels;
            FlmKernels portable_int8 = *path;
            portable_int8.qgemm = flm_kernels_generic.qgemm;
            portable_int8.quantize_q8 = flm_kernels_generic.quantize_q8;
            flm_kernels = &portable_int8;
            run(&c, &w, tok, n, 64, 0, 2, other);
            flm_kernels = path;
            CHECK(memcmp(full, other, sz * 4) == 0, "%s wtype=%d: differs from the portable int8 kernels", paths[pi],
                  wtype);
        } else {
            CHECK(maxerr <= 1.0, "%s wtype=%d: differs from the portable path (err/bound %.2f)", paths[pi], wtype,
                  maxerr);
        }
        test_batch(&c, &w, tok, paths[pi]);
        test_rollback(&c, &w, tok, paths[pi]);
        const FlmMatrix *embed = w.embed;
        w.embed = NULL; /* tied: rows come from the packed head, same values */
        run(&c, &w, tok, n, 64, 0, 2, other);
        w.embed = embed;
        CHECK(memcmp(full, other, sz * 4) == 0, "%s wtype=%d: rows of the packed head differ", paths[pi], wtype);
        int finite = 1;
        for (size_t i = 0; i < sz; i++) finite &= isfinite(full[i]);
        CHECK(finite, "%s: non-finite logits", paths[pi]);
        if (window) {
            /* The window takes effect, and one wider than the context is
             * the whole context, bit for bit. */
            float *whole = own(malloc(sz * 4));
            set_windows(layers, c.n_layers, 0);
            run(&c, &w, tok, n, 64, 0, 2, whole);
            for (int l = 0; l < c.n_layers; l++) layers[l].window = c.seq_len;
            run(&c, &w, tok, n, 64, 0, 2, other);
            set_windows(layers, c.n_layers, window);
            CHECK(memcmp(whole, other, sz * 4) == 0, "%s: a window of the whole context differs from none", paths[pi]);
            CHECK(memcmp(whole, full, sz * 4) != 0, "%s: the sliding window changes nothing", paths[pi]);
        }
        printf("ok  %-11s wtype=%d qk_norm=%d bias=%d gate=%d linear=%d window=%d gemma=%d  "
               "(err/bound vs portable %.3f)\n", paths[pi], wtype, qk_norm, bias, gate, linear, window, gemma, maxerr);
        /* A 16-bit KV cache: keys and values rounded once when written, then
         * read exactly, so every run of it agrees with itself bit for bit,
         * and it stays near the fp32 cache (bf16 keeps 8 bits, f16 11; where
         * activations are rounded to bf16 too, the bound is that path's).
         * Not with int8 activations, which turn its rounding into whole
         * quantization steps: the cache is the same for every weight type. */
        for (int kv = FLM_BF16; kv <= (c.head_dim % 32 ? FLM_F16 : FLM_Q8_0) && !flm_is_quantized(wtype); kv++) {
            FlmConfig c16 = c;
            c16.kv_type = kv;
            float *half = own(malloc(sz * 4));
            run(&c16, &w, tok, n, 64, 0, 2, half);
            run(&c16, &w, tok, n, 64, 1, 1, other);
            CHECK(memcmp(half, other, sz * 4) == 0, "%s kv_type=%d: one token at a time differs", paths[pi], kv);
            run(&c16, &w, tok, n, 5, 0, 3, other);
            CHECK(memcmp(half, other, sz * 4) == 0, "%s kv_type=%d: 3 threads / batch 5 differ", paths[pi], kv);
            double kvtol = kv == FLM_Q8_0 ? 0.5 : bf16_dots && wtype == FLM_BF16 ? 0.3 : kv == FLM_BF16 ? 0.15 : 0.1;
            double kverr = 0;
            for (size_t i = 0; i < sz; i++) {
                double e = fabs(half[i] - full[i]) / (kvtol + kvtol * fabs(full[i]));
                if (e > kverr) kverr = e;
            }
            CHECK(kverr <= 1.0, "%s kv_type=%d: too far from the fp32 cache (err/bound %.2f)", paths[pi], kv, kverr);
            printf("    kv_type=%d: err/bound vs fp32 cache %.3f\n", kv, kverr);
        }
    }
    free_owned();
}

/* One state of a test, its buffers freed with free_owned. */
static FlmState *new_state(const FlmConfig *c, const FlmWeights *w, int batch) {
    FlmState *s = own(malloc(sizeof *s));
    flm_state_init(s, c, w->layers, batch, 4, own(calloc(flm_state_work_floats(c, batch, 4), 4)),
                   own(calloc(flm_state_cache_floats(c, w->layers), 4)));
    return s;
}

/* Long sequences: keys in several blocks (both schedules of attention: the
 * tiles of a prompt's passes and the split blocks of short passes), GQA
 * groups of 3, and sliding windows held in rings (of 512 and 256 slots for
 * windows of 218 and 473, passes of at most 40 tokens: one slot more than
 * the least each needs, and none), beside a layer that
 * sees the whole context. Bit for bit the same logits: whole passes, one
 * token at a time, 3 threads and passes of 5, caches that hold every
 * position instead of rings, a sequence batched with another, a copy of a
 * state some tokens on, and a ring's window saved and put back after the
 * rings have moved on. */
static void test_long(int kv_type) {
    enum { N = 700 };
    FlmConfig c = {.dim = 48, .hidden_dim = 64, .n_layers = 3, .n_heads = 6, .n_kv_heads = 2,
                   .head_dim = kv_type == FLM_Q8_0 ? 32 : 16,   /* q8_0: whole blocks of 32 */
                   .vocab_size = 61, .seq_len = N, .rope_dim = 16, .kv_type = kv_type, .max_pass = 40,
                   .norm_eps = 1e-5f, .attn_scale = 0.25f, .embed_scale = 1.0f, .residual_scale = 1.0f,
                   .logits_div = 1.0f};
    const int qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim, windows[3] = {0, 218, 473};
    FlmLayer layers[3];
    float *cosv = own(malloc((size_t)N * 8 * 4)), *sinv = own(malloc((size_t)N * 8 * 4));
    for (int p = 0; p < N; p++)
        for (int i = 0; i < 8; i++) {
            cosv[p * 8 + i] = cosf(p * powf(10000.0f, -i / 8.0f));
            sinv[p * 8 + i] = sinf(p * powf(10000.0f, -i / 8.0f));
        }
    for (int l = 0; l < 3; l++) {
        FlmLayer *L = &layers[l];
        memset(L, 0, sizeof *L);
        L->head_dim = c.head_dim; L->n_kv_heads = c.n_kv_heads; L->rope_dim = c.rope_dim;
        L->hidden_dim = c.hidden_dim; L->kv_layer = l; L->window = windows[l];
        L->rope_cos = cosv; L->rope_sin = sinv;
        L->wq = mat(qd, c.dim, FLM_F32, 0.5f);
        L->wk = mat(kvd, c.dim, FLM_F32, 0.5f);
        L->wv = mat(kvd, c.dim, FLM_F32, 0.5f);
        L->wo = mat(c.dim, qd, FLM_F32, 0.3f);
        L->w_gate = mat(c.hidden_dim, c.dim, FLM_F32, 0.3f);
        L->w_up = mat(c.hidden_dim, c.dim, FLM_F32, 0.3f);
        L->w_down = mat(c.dim, c.hidden_dim, FLM_F32, 0.3f);
        L->attn_norm = vec(c.dim, 1.0f, 0.2f);
        L->ffn_norm = vec(c.dim, 1.0f, 0.2f);
    }
    const void *table = own(alloc_rows(c.vocab_size, c.dim, FLM_F32, 1.0f));
    FlmWeights w = {.embed = matrix(table, FLM_F32), .layers = layers, .norm = vec(c.dim, 1.0f, 0.2f)};
    w.lm_head = packed(table, c.vocab_size, c.dim, FLM_F32);
    int32_t tok[N];
    for (int i = 0; i < N; i++) tok[i] = (int32_t)((i * 37 + i / 7) % c.vocab_size);
    const size_t V = c.vocab_size, sz = (size_t)N * V;
    float *ref = own(malloc(sz * 4)), *out = own(malloc(sz * 4));

    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        FlmState *a = new_state(&c, &w, 64), *b = new_state(&c, &w, 64), *d = new_state(&c, &w, 64);
        CHECK(flm_state_rewind_room(&c, a) == 40, "%s: rings of the wrong size", paths[pi]);
        flm_forward(&c, &w, a, tok, N, 0, ref, 1, 2);
        int same = 1;
        for (int i = 0; i < N; i++) flm_forward(&c, &w, b, tok + i, 1, i, out + i * V, 0, 1);
        same &= memcmp(ref, out, sz * 4) == 0;
        CHECK(same, "%s kv_type=%d: one token at a time differs from whole passes", paths[pi], kv_type);
        FlmState *five = new_state(&c, &w, 5);
        flm_forward(&c, &w, five, tok, N, 0, out, 1, 3);
        CHECK(memcmp(ref, out, sz * 4) == 0, "%s kv_type=%d: 3 threads / passes of 5 differ", paths[pi], kv_type);
        FlmConfig whole = c;
        whole.max_pass = 0;
        FlmState *full = new_state(&whole, &w, 64);
        CHECK(flm_state_rewind_room(&whole, full) == -1, "%s: a ring where every position is held", paths[pi]);
        flm_forward(&whole, &w, full, tok, N, 0, out, 1, 2);
        CHECK(memcmp(ref, out, sz * 4) == 0, "%s kv_type=%d: rings differ from whole caches", paths[pi], kv_type);

        /* Sequence b in passes of 1, 3, 17 and 40 tokens beside sequence d's
         * (the same tokens, 250 positions behind, in passes of 9). */
        static const int sizes[] = {1, 3, 17, 40};
        float *both = own(malloc(2 * 40 * V * 4));
        same = 1;
        for (int pb = 0, pd = 0, step = 0; pb < N; step++) {
            const int nb = imin(sizes[step % 4], N - pb), nd = pb >= 250 ? imin(9, N - pd) : 0;
            FlmSeq seqs[2] = {{b, tok + pb, nb, pb, nb}, {d, tok + pd, imax(nd, 1), pd, imax(nd, 1)}};
            flm_forward_batch(&c, &w, a, seqs, nd ? 2 : 1, both, 3);
            same &= memcmp(both, ref + (size_t)pb * V, nb * V * 4) == 0;
            if (nd) same &= memcmp(both + nb * V, ref + (size_t)pd * V, nd * V * 4) == 0;
            pb += nb;
            pd += nd;
        }
        CHECK(same, "%s kv_type=%d: batched sequences differ from a sequence alone", paths[pi], kv_type);

        /* d holds what b held 40 positions back (its rings still hold the
         * window before), and goes on from there; b goes back to position
         * 300, saved with its rings' windows, 400 positions later. */
        flm_state_copy(&c, d, b, N - 40, 0);
        flm_forward(&c, &w, d, tok + N - 40, 40, N - 40, out, 1, 2);
        CHECK(memcmp(ref + (N - 40) * V, out, 40 * V * 4) == 0, "%s: a copied state differs", paths[pi]);
        float *saved = own(malloc(flm_state_window_floats(&c, b) * 4));
        flm_forward(&c, &w, b, tok, 300, 0, out, 0, 2);
        flm_state_window(&c, b, 300, saved, 1);
        flm_forward(&c, &w, b, tok + 300, 400, 300, out, 0, 2);
        flm_state_window(&c, b, 300, saved, 0);
        flm_forward(&c, &w, b, tok + 300, 400, 300, out, 1, 2);
        CHECK(memcmp(ref + 300 * V, out, 400 * V * 4) == 0, "%s: a window put back differs", paths[pi]);

        /* A fresh state takes b's first 300 positions as a file would keep
         * them: the whole caches' blocks (flm_state_prefix) and the rings'
         * windows, and goes on from there. */
        FlmState *e = new_state(&c, &w, 64);
        const size_t prefix_bytes = flm_state_prefix_bytes(&c, b, 300);
        CHECK(kv_type != FLM_F32 || prefix_bytes == 2 * 304 * (size_t)kvd * 4,   /* layer 0's 19 blocks */
              "%s: the prefix of the whole cache is %zu bytes", paths[pi], prefix_bytes);
        void *prefix = own(malloc(prefix_bytes));
        flm_forward(&c, &w, b, tok, 300, 0, out, 0, 2);
        flm_state_prefix(&c, b, 300, prefix, 1);
        flm_state_window(&c, b, 300, saved, 1);
        flm_state_prefix(&c, e, 300, prefix, 0);
        flm_state_window(&c, e, 300, saved, 0);
        flm_forward(&c, &w, e, tok + 300, 400, 300, out, 1, 2);
        CHECK(memcmp(ref + 300 * V, out, 400 * V * 4) == 0, "%s: a state put back from its prefix differs",
              paths[pi]);

        /* What flm_state_tail names past position 300 is never read before
         * it is written again: filled with NaNs, the run from 300 is the same. */
        size_t ranges[2 * 16];
        const int nr = flm_state_tail(&c, e, 300, ranges, 16);
        CHECK(nr == 2 * c.n_kv_heads, "%s: %d tail ranges (one per head, keys and values, of layer 0)",
              paths[pi], nr);
        for (int r = 0; r < nr && r < 16; r++)
            memset((char *)e->lin_state + ranges[2 * r], 0xFF, ranges[2 * r + 1]);
        flm_state_window(&c, e, 300, saved, 0);
        flm_forward(&c, &w, e, tok + 300, 400, 300, out, 1, 2);
        CHECK(memcmp(ref + 300 * V, out, 400 * V * 4) == 0, "%s: a tail filled with NaNs was read", paths[pi]);
        printf("ok  %-11s long sequences, kv_type=%d: rings, blocks, batches, copies, prefixes\n", paths[pi],
               kv_type);
    }
    free_owned();
}

/* The KV cache's f16 and bf16 conversions against the compiler's own
 * (_Float16 where it has one; bf16 by its definition: the top half of a
 * float, rounded to nearest-even). */
static void test_conversions(void) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = flm_f16_to_f32((uint16_t)h);
#ifdef __FLT16_MAX__
        _Float16 ref;
        uint16_t hb = (uint16_t)h;
        memcpy(&ref, &hb, 2);
        if (!((float)ref == f || (f != f && ref != ref))) bad++;
#endif
        if (f == f && flm_f32_to_f16(f) != h) bad++;  /* every f16 value goes back to itself */
    }
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)i * 2654435761u ^ (uint32_t)i << 7;
        float f;
        memcpy(&f, &u, 4);
        if (f != f) continue;
#ifdef __FLT16_MAX__
        _Float16 ref = (_Float16)f;
        uint16_t hb;
        memcpy(&hb, &ref, 2);
        if (flm_f32_to_f16(f) != hb) bad++;
#endif
        double lo = flm_bf16_to_f32((uint16_t)(u >> 16)), hi = flm_bf16_to_f32((uint16_t)((u >> 16) + 1));
        float got = flm_bf16_to_f32(flm_f32_to_bf16(f));
        if (fabsf(f) < 3e38f && got != (fabs(f - lo) < fabs(hi - f) ? lo : fabs(f - lo) > fabs(hi - f) ? hi
                                        : ((u >> 16) & 1) ? hi : lo)) bad++;
    }
    CHECK(bad == 0, "f16/bf16 conversions: %d wrong", bad);
    printf("ok  f16/bf16 conversions\n");
}

/* GeLU-tanh and soft-capping on every path: each value within a few ulp of
 * the double-precision function, over the range where tanh turns from its
 * polynomial to its exponential form and saturates, with ragged tails. */
static void test_elementwise(void) {
    enum { N = 1037 };
    float x[N], u[N], g[N], capped[N];
    for (int i = 0; i < N; i++) {
        x[i] = (i - N / 2) * 0.025f + 0.001f * frand();   /* about -13 .. 13 */
        u[i] = 0.5f + frand();
    }
    const float cap = 3.0f;
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        for (int n = N; n >= N - 21; n -= 7) {   /* whole vectors and tails */
            memcpy(g, x, sizeof g);
            memcpy(capped, x, sizeof capped);
            flm_kernels->gelu_tanh_mul(g, u, n);
            float max = flm_kernels->softcap_max(capped, n, cap), want_max = -INFINITY;
            double gelu_err = 0, cap_err = 0;
            for (int i = 0; i < n; i++) {
                double v = x[i], inner = 0.7978845608028654 * (v + 0.044715 * v * v * v);
                double want_g = 0.5 * v * (1.0 + tanh(inner)) * u[i], want_c = tanh(v / cap) * cap;
                gelu_err = fmax(gelu_err, fabs(g[i] - want_g) / (1e-6 + 1e-6 * fabs(want_g)));
                cap_err = fmax(cap_err, fabs(capped[i] - want_c) / (1e-6 * cap));
                if (capped[i] > want_max) want_max = capped[i];
            }
            CHECK(gelu_err <= 1.0, "%s n=%d: gelu_tanh_mul off by %.2f of its bound", paths[pi], n, gelu_err);
            CHECK(cap_err <= 1.0, "%s n=%d: softcap_max off by %.2f of its bound", paths[pi], n, cap_err);
            CHECK(max == want_max, "%s n=%d: softcap_max returns %g, the largest value is %g", paths[pi], n, max,
                  want_max);
            CHECK(memcmp(g + n, x + n, sizeof(float) * (N - n)) == 0 &&
                  memcmp(capped + n, x + n, sizeof(float) * (N - n)) == 0, "%s n=%d: wrote past n", paths[pi], n);
        }
        float nan_in[3] = {NAN, 1.0f, -2.0f};
        CHECK(flm_kernels->softcap_max(nan_in, 3, cap) == nan_in[1] && isnan(nan_in[0]),
              "%s: softcap_max does not keep NaN as NaN and out of the max", paths[pi]);
        printf("ok  %-11s gelu_tanh_mul, softcap_max\n", paths[pi]);
    }
}

/* Softmax's kernels on every path: exp_sum's values and sum against
 * double precision, down to where exp underflows (below EXP_LOWEST a path
 * may give exactly 0 instead: kernels.h says why), and scale_max's
 * products and largest value exactly as the scalar loop gives them, NaN
 * ignored; with ragged tails. */
static void test_softmax_kernels(void) {
    enum { N = 1037 };
    float x[N], got[N];
    const float max = -20.0f;   /* a lane past n read as 0 would add exp(20) */
    for (int i = 0; i < N; i++) x[i] = max - 112.0f * (float)i / N + 0.5f * frand();   /* x - max: 0.5 .. -112 */
    x[N / 2] = max;
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        double worst = 0;
        for (int n = N; n >= N - 21; n -= 7) {
            memcpy(got, x, sizeof got);
            const float sum = flm_kernels->exp_sum(got, n, max);
            double want_sum = 0, err = 0;
            for (int i = 0; i < n; i++) {
                const double want = exp((double)(x[i] - max));
                want_sum += want;
                /* about an ulp, and at most one step of the subnormals (1.4e-45);
                 * or exactly 0 below EXP_LOWEST */
                if (x[i] - max < EXP_LOWEST && got[i] == 0.0f) continue;
                err = fmax(err, fabs(got[i] - want) / (1e-6 * want + 1.5e-45));
            }
            CHECK(err <= 1.0, "%s n=%d: exp_sum's values off by %.2f of their bound", paths[pi], n, err);
            worst = fmax(worst, err);
            CHECK(fabs(sum - want_sum) <= 1e-5 * want_sum, "%s n=%d: exp_sum returns %.9g, the sum is %.9g",
                  paths[pi], n, sum, want_sum);
            CHECK(memcmp(got + n, x + n, sizeof(float) * (N - n)) == 0, "%s n=%d: exp_sum wrote past n", paths[pi], n);
        }
        for (int n = 0; n <= 40; n += n < 9 ? 1 : 31) {
            for (int sign = 1; sign >= -1; sign -= 2) {
                const float s = 0.125f * sign;
                float want_max = -INFINITY;
                memcpy(got, x, sizeof got);
                for (int i = 3; i < n; i += 5) got[i] = NAN;
                float before[41];
                memcpy(before, got, sizeof before);
                const float mx = flm_kernels->scale_max(got, n, s);
                int same = 1;
                for (int i = 0; i < n; i++) {
                    const float want = before[i] * s;
                    same &= isnan(want) ? isnan(got[i]) : memcmp(&want, &got[i], 4) == 0;
                    if (want > want_max) want_max = want;
                }
                CHECK(same, "%s n=%d s=%g: scale_max's products differ from x * s", paths[pi], n, s);
                CHECK(mx == want_max, "%s n=%d s=%g: scale_max returns %g, the largest value is %g", paths[pi], n,
                      s, mx, want_max);
                CHECK(memcmp(got + n, before + n, sizeof(float) * (41 - n)) == 0, "%s n=%d: scale_max wrote past n",
                      paths[pi], n);
            }
        }
        float nans[5] = {NAN, NAN, NAN, NAN, NAN};
        CHECK(flm_kernels->scale_max(nans, 5, 2.0f) == -INFINITY, "%s: scale_max of NaNs is not -inf", paths[pi]);
        printf("ok  %-11s exp_sum (err/bound %.3f), scale_max\n", paths[pi], worst);
    }
}

/* SiLU-gating on every path against double precision, through exp's
 * overflow and underflow, with ragged tails; NaN stays NaN. */
static void test_silu(void) {
    enum { N = 1037 };
    float x[N], u[N], g[N];
    for (int i = 0; i < N; i++) {
        x[i] = (i - N / 2) * 0.05f + 0.01f * frand();   /* about -26 .. 26 */
        u[i] = 0.5f + frand();
    }
    x[0] = -100.0f;
    x[1] = 100.0f;
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        double err = 0;
        for (int n = N; n >= N - 21; n -= 7) {
            memcpy(g, x, sizeof g);
            flm_kernels->silu_mul(g, u, n);
            for (int i = 0; i < n; i++) {
                const double v = x[i], want = v / (1.0 + exp(-v)) * u[i];
                err = fmax(err, fabs(g[i] - want) / (1e-6 * fabs(want) + 1e-30));
            }
            CHECK(err <= 1.0, "%s n=%d: silu_mul off by %.2f of its bound", paths[pi], n, err);
            CHECK(memcmp(g + n, x + n, sizeof(float) * (N - n)) == 0, "%s n=%d: silu_mul wrote past n", paths[pi], n);
        }
        float nan_in[3] = {1.0f, NAN, -2.0f}, one[3] = {1.0f, 1.0f, 1.0f};
        flm_kernels->silu_mul(nan_in, one, 3);
        CHECK(isnan(nan_in[1]) && !isnan(nan_in[0]) && !isnan(nan_in[2]), "%s: silu_mul does not keep NaN as NaN",
              paths[pi]);
        printf("ok  %-11s silu_mul (err/bound %.3f)\n", paths[pi], err);
    }
}

/* to_bf16, on the paths that have it, bit for bit flm_f32_to_bf16: ties
 * both ways, overflow to inf, infinities, quiet and signalling NaNs of
 * either sign, subnormals, random bits; odd n zero-padded, nothing written
 * after. x86's VCVTNEPS2BF16 takes subnormal inputs as zero: there a
 * signed zero is their result too. */
static void test_to_bf16(void) {
    enum { N = 1037 };
    static const uint32_t special[] = {0x00000000, 0x80000000, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001,
                                       0xBF818000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000,
                                       0x7FC00000, 0x7F800001, 0xFF800001, 0xFFA00000, 0x7FFFFFFF, 0x00800000,
                                       0x00000001, 0x807FFFFF, 0x00008000, 0x00018000};
    const int n_special = (int)(sizeof special / sizeof special[0]);
    float x[N];
    uint16_t got[N + 2];
    for (int i = 0; i < N; i++) {
        frand();
        uint32_t u = i < n_special ? special[i] : (uint32_t)(rng_state >> 32);
        if (i % 8 == 7) u &= 0x807FFFFF;   /* subnormals */
        memcpy(&x[i], &u, 4);
    }
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0 || !flm_kernels->to_bf16) continue;
        const int daz = strncmp(paths[pi], "avx512", 6) == 0 || strcmp(paths[pi], "amx_bf16") == 0;
        int bad = 0;
        for (int n = 1; n <= N; n += n < 40 ? 1 : 331) {
            for (int i = 0; i < N + 2; i++) got[i] = 0xABCD;
            flm_kernels->to_bf16(got, x, n);
            for (int i = 0; i < n; i++) {
                const int subnormal = x[i] != 0.0f && fabsf(x[i]) < 1.17549435e-38f;
                const uint16_t zero = signbit(x[i]) ? 0x8000 : 0;
                bad += got[i] != flm_f32_to_bf16(x[i]) && !(daz && subnormal && got[i] == zero);
            }
            bad += (n & 1) && got[n] != 0;
            for (int i = n + (n & 1); i < N + 2; i++) bad += got[i] != 0xABCD;
        }
        CHECK(bad == 0, "%s: to_bf16 differs from flm_f32_to_bf16 or writes past its padding (%d)", paths[pi], bad);
        printf("ok  %-11s to_bf16\n", paths[pi]);
    }
}

/* One token of the gated delta rule on every path against double
 * precision, the state and the output, for widths with ragged ends. */
static void test_delta_rule(void) {
    enum { DK = 12, DV_MAX = 70 };
    static const int dvs[] = {10, 37, 70};
    float q[DK], k[DK], v[DV_MAX], S0[DK * DV_MAX], S[DK * DV_MAX], o[DV_MAX];
    const float beta = 0.6f, decay = 0.9f;
    for (int i = 0; i < DK; i++) { q[i] = 0.3f * frand(); k[i] = 0.3f * frand(); }
    for (int j = 0; j < DV_MAX; j++) v[j] = frand();
    for (int i = 0; i < DK * DV_MAX; i++) S0[i] = 0.5f * frand();
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        double s_err = 0, o_err = 0;
        for (int t = 0; t < 3; t++) {
            const int dv = dvs[t];
            memcpy(S, S0, sizeof S);
            flm_kernels->delta_rule(S, q, k, v, beta, decay, DK, dv, o);
            for (int j = 0; j < dv; j++) {
                double kv = 0, kv_mag = 0, out = 0, out_mag = 0, Sn[DK];
                for (int i = 0; i < DK; i++) {
                    kv += decay * (double)S0[i * dv + j] * k[i];
                    kv_mag += fabs(decay * (double)S0[i * dv + j] * k[i]);
                }
                const double d = beta * (v[j] - kv), d_mag = beta * (fabs(v[j]) + kv_mag);
                for (int i = 0; i < DK; i++) {
                    const double mag = fabs(decay * (double)S0[i * dv + j]) + fabs(k[i]) * d_mag;
                    Sn[i] = decay * (double)S0[i * dv + j] + k[i] * d;
                    s_err = fmax(s_err, fabs(S[i * dv + j] - Sn[i]) / (1e-6 * mag + 1e-30));
                    out += Sn[i] * q[i];
                    out_mag += mag * fabs(q[i]);
                }
                o_err = fmax(o_err, fabs(o[j] - out) / (1e-6 * out_mag + 1e-30));
            }
        }
        CHECK(s_err <= 1.0 && o_err <= 1.0, "%s: delta_rule off by %.2f (state), %.2f (output) of its bound",
              paths[pi], s_err, o_err);
        printf("ok  %-11s delta_rule (err/bound %.3f state, %.3f output)\n", paths[pi], s_err, o_err);
    }
}

/* The causal conv and SiLU on every path against double precision, for
 * kernels of 1 to 9 taps (past the vector kernels' CONV_MAX_K) and channels
 * with ragged ends; the window it leaves is the last inputs, exactly, and
 * a run split in two gives the same bits as one. */
static void test_conv_silu(void) {
    enum { C = 37, T = 5, LDX = C + 3, LDW = C + 5, KMAX = 9 };
    static const int ks[] = {4, 3, 2, 1, 9};
    float x0[T * LDX], win0[KMAX * LDW], w[C * KMAX], x[T * LDX], win[KMAX * LDW], x2[T * LDX], win2[KMAX * LDW];
    for (int i = 0; i < T * LDX; i++) x0[i] = frand();
    for (int i = 0; i < KMAX * LDW; i++) win0[i] = frand();
    for (int i = 0; i < C * KMAX; i++) w[i] = 0.5f * frand();
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        double err = 0;
        int exact = 1;
        for (int ki = 0; ki < 5; ki++) {
            const int K = ks[ki];
            memcpy(x, x0, sizeof x);
            memcpy(win, win0, sizeof win);
            flm_kernels->conv_silu(x, LDX, T, win, LDW, w, K, C);
            for (int c = 0; c < C; c++) {
                float in[KMAX - 1 + T];   /* the window's inputs, oldest first, then the tokens' */
                for (int j = 0; j < K - 1; j++) in[j] = win0[j * LDW + c];
                for (int t = 0; t < T; t++) in[K - 1 + t] = x0[t * LDX + c];
                for (int t = 0; t < T; t++) {
                    double acc = 0, mag = 0;
                    for (int j = 0; j < K; j++) {
                        acc += (double)w[c * K + j] * in[t + j];
                        mag += fabs((double)w[c * K + j] * in[t + j]);
                    }
                    const double want = acc / (1.0 + exp(-acc));
                    err = fmax(err, fabs(x[t * LDX + c] - want) / (2e-6 * (mag + fabs(want)) + 1e-30));
                }
                for (int j = 0; j < K - 1; j++) exact &= win[j * LDW + c] == in[T + j];
            }
            memcpy(x2, x0, sizeof x2);
            memcpy(win2, win0, sizeof win2);
            flm_kernels->conv_silu(x2, LDX, 2, win2, LDW, w, K, C);
            flm_kernels->conv_silu(x2 + 2 * LDX, LDX, T - 2, win2, LDW, w, K, C);
            exact &= memcmp(x, x2, sizeof x) == 0 && memcmp(win, win2, sizeof win) == 0;
            for (int t = 0; t < T; t++) exact &= memcmp(x + t * LDX + C, x0 + t * LDX + C, (LDX - C) * 4) == 0;
        }
        CHECK(err <= 1.0, "%s: conv_silu off by %.2f of its bound", paths[pi], err);
        CHECK(exact, "%s: conv_silu's window, split runs or strides wrong", paths[pi]);
        printf("ok  %-11s conv_silu (err/bound %.3f)\n", paths[pi], err);
    }
}

/* The attention kernels of every path, for each KV cache type, with
 * ragged blocks and dimensions: the scores and weighted sums of several
 * queries at once are bit for bit those of each query alone, a weighted
 * sum in two calls is that of one, and both are near double precision. */
/* Every path's table fills every kernel (only to_bf16 may be absent, where
 * bf16 weights take fp32 activations): a field left out of a designated
 * initializer would otherwise be a NULL call at run time. */
static void test_kernel_tables(void) {
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        const FlmKernels *k = flm_kernels;
        const void *fns[] = {(const void *)k->gemm_f32, (const void *)k->gemm_bf16, (const void *)k->qgemm,
                             (const void *)k->quantize_q8, (const void *)k->key_scores, (const void *)k->exp_sum,
                             (const void *)k->scale_max, (const void *)k->scale, (const void *)k->weighted_sum,
                             (const void *)k->delta_rule, (const void *)k->conv_silu, (const void *)k->rmsnorm,
                             (const void *)k->silu_mul, (const void *)k->gelu_tanh_mul, (const void *)k->softcap_max};
        int missing = 0;
        for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) missing += fns[i] == NULL;
        CHECK(missing == 0 && k->name && k->int8_name && k->token_block > 0,
              "%s: %d kernels missing from its table", paths[pi], missing);
    }
    printf("ok  every path's kernel table is whole\n");
}

/* The q8_0 cache's kernels: every path gives the portable loops' bits
 * (kernels.h), for any number of queries and a range of values summed in
 * parts, within rounding of the double-precision sums of what the int8
 * and scales stand for. */
static void test_attention_kernels_q8(void) {
    enum { HD = 64, NMAX = 70, ROOM = 80, NQ = 6 };
    static const int ns[] = {1, 16, 70};
    const size_t kbytes = FLM_KV_Q8_BYTES(16 * HD), rbytes = FLM_KV_Q8_BYTES(HD);
    int8_t *keys = own(malloc(ROOM / 16 * kbytes)), *vals = own(malloc(NMAX * rbytes));
    float q[NQ][HD], p[NQ][NMAX], att[NQ][ROOM], want[NQ][ROOM], out[NQ][HD], ref[HD];
    const float *qs[NQ];
    for (int b = 0; b < ROOM / 16; b++) {
        int8_t *k = keys + b * kbytes;
        for (int i = 0; i < 16 * HD; i++) k[i] = (int8_t)(127 * frand());
        for (int i = 0; i < HD / 2; i++) ((uint16_t *)(k + 16 * HD))[i] = flm_f32_to_f16(0.01f + 0.005f * frand());
    }
    for (int j = 0; j < NMAX; j++) {
        int8_t *r = vals + j * rbytes;
        for (int d = 0; d < HD; d++) r[d] = (int8_t)(127 * frand());
        for (int g = 0; g < HD / 32; g++) ((uint16_t *)(r + HD))[g] = flm_f32_to_f16(0.01f + 0.005f * frand());
    }
    for (int i = 0; i < NQ; i++) {
        qs[i] = q[i];
        for (int d = 0; d < HD; d++) q[i][d] = frand();
        for (int j = 0; j < NMAX; j++) p[i][j] = 0.5f + 0.5f * frand();
    }
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        int same = 1;
        double err = 0;
        for (int t = 0; t < 3; t++) {
            const int n = ns[t];
            flm_key_scores_q8(want[0], ROOM, qs, NQ, keys, n, HD);
            for (int nq = 1; nq <= NQ; nq++) {
                flm_kernels->key_scores(att[0], ROOM, qs, nq, keys, n, HD, FLM_Q8_0);
                for (int i = 0; i < nq; i++) same &= memcmp(att[i], want[i], n * 4) == 0;
                memset(out, 0, sizeof out);
                flm_kernels->weighted_sum(out[0], HD, p[0], NMAX, nq, vals, n, HD, HD, FLM_Q8_0);
                for (int i = 0; i < nq; i++) {
                    memset(ref, 0, sizeof ref);
                    flm_weighted_sum_q8(ref, HD, p[i], NMAX, 1, vals, n / 3, HD, HD);
                    flm_weighted_sum_q8(ref, HD, p[i] + n / 3, NMAX, 1, vals + (n / 3) * rbytes, n - n / 3, HD, HD);
                    same &= memcmp(ref, out[i], sizeof ref) == 0;
                }
            }
            for (int i = 0; i < NQ; i++)
                for (int j = 0; j < n; j++) {
                    const int8_t *k = keys + j / 16 * kbytes;
                    double r = 0, mag = 0;
                    for (int d = 0; d < HD; d++) {
                        const double x = (double)q[i][d] * k[d * 16 + j % 16] *
                                         flm_f16_to_f32(((const uint16_t *)(k + 16 * HD))[d / 32 * 16 + j % 16]);
                        r += x;
                        mag += fabs(x);
                    }
                    err = fmax(err, fabs(want[i][j] - r) / (1e-6 * mag + 1e-30));
                }
            for (int d = 0; d < HD; d++) {
                double r = 0, mag = 0;
                for (int j = 0; j < n; j++) {
                    const int8_t *row = vals + j * rbytes;
                    const double x = (double)p[NQ - 1][j] * row[d] * flm_f16_to_f32(((const uint16_t *)(row + HD))[d / 32]);
                    r += x;
                    mag += fabs(x);
                }
                err = fmax(err, fabs(out[NQ - 1][d] - r) / (1e-6 * mag + 1e-30));
            }
        }
        CHECK(same, "%s: q8_0 attention kernels differ from the portable loops", paths[pi]);
        CHECK(err <= 1.0, "%s: q8_0 attention kernels off by %.2f of their bound", paths[pi], err);
        printf("ok  %-11s key_scores, weighted_sum on a q8_0 cache (err/bound %.3f)\n", paths[pi], err);
    }
    free_owned();
}

static void test_attention_kernels(void) {
    enum { HD = 20, NMAX = 37, ROOM = 48, DIM = 69, NQ = 7 };
    static const int ns[] = {1, 16, 37};
    float q[NQ][HD], p[NQ][NMAX], att[NQ][ROOM], one[ROOM], out[NQ][DIM], ref[DIM];
    const float *qs[NQ];
    for (int i = 0; i < NQ; i++) {
        qs[i] = q[i];
        for (int d = 0; d < HD; d++) q[i][d] = frand();
        for (int j = 0; j < NMAX; j++) p[i][j] = 0.5f + 0.5f * frand();
    }
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        int same = 1;
        double err = 0;
        for (int kv = FLM_F32; kv <= FLM_F16; kv++) {
            void *keys = alloc((size_t)ROOM * HD, kv, 1.0f), *vals = alloc((size_t)NMAX * 2 * DIM, kv, 1.0f);
            for (int t = 0; t < 3; t++) {
                const int n = ns[t];
                for (int nq = 1; nq <= NQ; nq++) {
                    flm_kernels->key_scores(att[0], ROOM, qs, nq, keys, n, HD, kv);
                    for (int i = 0; i < nq; i++) {
                        flm_kernels->key_scores(one, ROOM, qs + i, 1, keys, n, HD, kv);
                        same &= memcmp(one, att[i], n * 4) == 0;
                        for (int j = 0; j < n; j++) {
                            double r = 0;
                            for (int d = 0; d < HD; d++)
                                r += (double)q[i][d] * flm_kv_at(keys, (size_t)(j / 16 * HD + d) * 16 + j % 16, kv);
                            err = fmax(err, fabs(att[i][j] - r) / (1e-5 + 1e-5 * fabs(r)));
                        }
                    }
                    for (int dim = HD; dim <= DIM; dim += DIM - HD) {   /* a value row of 2*DIM, one head's dims */
                        memset(out, 0, sizeof out);
                        flm_kernels->weighted_sum(out[0], DIM, p[0], NMAX, nq, vals, n, 2 * DIM, dim, kv);
                        for (int i = 0; i < nq; i++) {
                            memset(ref, 0, sizeof ref);
                            flm_kernels->weighted_sum(ref, DIM, p[i], NMAX, 1, vals, n / 3, 2 * DIM, dim, kv);
                            flm_kernels->weighted_sum(ref, DIM, p[i] + n / 3, NMAX, 1,
                                                      (const char *)vals + (size_t)(n / 3) * 2 * DIM * (kv ? 2 : 4),
                                                      n - n / 3, 2 * DIM, dim, kv);
                            same &= memcmp(ref, out[i], dim * 4) == 0;
                            for (int d = 0; d < dim; d++) {
                                double r = 0, mag = 0;
                                for (int j = 0; j < n; j++) {
                                    const double x = (double)p[i][j] * flm_kv_at(vals, (size_t)j * 2 * DIM + d, kv);
                                    r += x;
                                    mag += fabs(x);
                                }
                                err = fmax(err, fabs(out[i][d] - r) / (1e-5 * mag + 1e-30));
                            }
                        }
                    }
                }
            }
            free(keys);
            free(vals);
        }
        CHECK(same, "%s: attention kernels of several queries, or in parts, differ from one query at once", paths[pi]);
        CHECK(err <= 1.0, "%s: attention kernels off by %.2f of their bound", paths[pi], err);
        printf("ok  %-11s key_scores, weighted_sum (err/bound %.3f)\n", paths[pi], err);
    }
}

/* The matmul alone, for a quantized type: the int8 path of every SIMD path
 * against the portable one, and the fp32-activation path against the fp32
 * matmul of the dequantized matrix, both bit for bit; packed rows against
 * GGML rows dequantized directly. */
static void test_quant_matmul(int type) {
    /* T: every tile of tokens the int8 kernels have (16 + 8 + 4 + 1), and
     * enough for the AVX2 kernels' unpacked runs of blocks; K: 72 blocks,
     * two such runs (64 + 8). */
    const int N = 37, K = 2304, T = 29, DRAWN = 13;
    FlmConfig c = {.dim = K, .hidden_dim = K, .n_layers = 1, .n_heads = 1, .n_kv_heads = 1, .head_dim = 16,
                   .vocab_size = N, .seq_len = 16, .rope_dim = 16};
    FlmState s;
    float *work = own(calloc(flm_state_work_floats(&c, T, 4), 4));
    flm_state_init(&s, &c, NULL, T, 4, work, NULL);
    void *rows = own(alloc_rows(N, K, type, 1.0f));
    FlmMatrix *q = packed(rows, N, K, type);
    float *deq = own(malloc((size_t)N * K * 4)), *x = own(malloc((size_t)T * K * 4));
    int rows_ok = 1;
    for (int r = 0; r < N; r++) {
        float *row = own(malloc((size_t)K * 4));
        flm_quant_dequant_row(deq + (size_t)r * K, (const char *)rows + r * row_size(K, type), K, type);
        flm_packed_row(row, q->data, r, K, type);
        rows_ok &= memcmp(row, deq + (size_t)r * K, (size_t)K * 4) == 0;
    }
    CHECK(rows_ok, "%s: packed rows differ from the GGML rows", flm_quant_type(type)->name);
    FlmMatrix *f = packed(deq, N, K, FLM_F32);
    /* The tokens past DRAWN are the first ones, rotated and scaled: the
     * random draws, and so the tests after this one, stay as they were. */
    for (size_t i = 0; i < (size_t)DRAWN * K; i++) x[i] = frand() * (i % 7 == 0 ? 3.0f : 1.0f);
    for (size_t i = (size_t)DRAWN * K; i < (size_t)T * K; i++) x[i] = -1.5f * x[(i * 5 + 3) % ((size_t)DRAWN * K)];
    float *ref = own(malloc((size_t)T * N * 4)), *out = own(malloc((size_t)T * N * 4)), *exact = own(malloc((size_t)T * N * 4));
    flm_set_simd_path("generic");
    if (flm_is_quantized(type)) flm_matmul(ref, x, q, T, K, N, &s, 0, 2);
    for (int pi = 0; pi < N_PATHS; pi++) {
        if (flm_set_simd_path(paths[pi]) != 0) continue;
        if (flm_is_quantized(type)) {
            flm_matmul(out, x, q, T, K, N, &s, 0, 2);
            CHECK(memcmp(out, ref, (size_t)T * N * 4) == 0, "%s %s: int8 matmul differs from the portable one",
                  paths[pi], flm_quant_type(type)->name);
            flm_matmul(out, x, q, 1, K, N, &s, 0, 1);
            CHECK(memcmp(out, ref, (size_t)N * 4) == 0, "%s %s: one token differs from a batch", paths[pi],
                  flm_quant_type(type)->name);
        }
        flm_matmul(out, x, q, T, K, N, &s, 1, 2);
        flm_matmul(exact, x, f, T, K, N, &s, 0, 2);
        CHECK(memcmp(out, exact, (size_t)T * N * 4) == 0, "%s %s: fp32 activations differ from the dequantized matrix",
              paths[pi], flm_quant_type(type)->name);
        if (flm_is_quantized(type)) {
            /* int8 activations: near the exact product (a few parts per thousand of its scale). */
            double err = 0, scale = 0;
            for (int i = 0; i < T * N; i++) {
                err = fmax(err, fabs(ref[i] - exact[i]));
                scale = fmax(scale, fabs(exact[i]));
            }
            CHECK(err <= 0.02 * scale, "%s %s: int8 matmul too far from the exact one (%g of %g)", paths[pi],
                  flm_quant_type(type)->name, err, scale);
        }
    }
    printf("ok  %s matmul (int8 bit for bit across paths, fp32 activations exact)\n", flm_quant_type(type)->name);
    free_owned();
}

/* Decoding's int8 matmul, which runs several panels side by side, against
 * the portable one, bit for bit: one and two tokens over 8 panels whose
 * last has 5 rows, on one thread (work items of 4 panels) and on 3. */
/* How far ahead and into which cache the kernels ask for weights, as
 * flm_set_stream_prefetch takes it: none, the nearest, each level, the
 * farthest (past the end of the weights: a prefetch there must not fault). */
static const int PREFETCHES[][2] = {{-1, 0}, {0, 1}, {64, 2}, {2048, 1}, {1024, 2}, {65536, 1}};
#define N_PREFETCHES (int)(sizeof PREFETCHES / sizeof PREFETCHES[0])

static void test_stream_prefetch(void) {
    int ahead, level;
    if (flm_stream_prefetch(&ahead, &level) != 0) {
        CHECK(flm_set_stream_prefetch(1024, 2) == -1, "a CPU whose kernels do not prefetch took a prefetch");
        printf("ok  stream prefetch (none on this CPU)\n");
        return;
    }
    CHECK(ahead >= 0 && ahead <= 65536 && ahead % 64 == 0 && (level == 1 || level == 2),
          "the CPU's prefetch is %d bytes into L%d", ahead, level);
    const int bad[][2] = {{-64, 1}, {100, 1}, {65600, 1}, {1024, 0}, {1024, 3}};
    for (int i = 0; i < 5; i++) {
        CHECK(flm_set_stream_prefetch(bad[i][0], bad[i][1]) == -1, "prefetch %d:%d was taken", bad[i][0], bad[i][1]);
        int a, l;
        flm_stream_prefetch(&a, &l);
        CHECK(a == ahead && l == level, "a refused prefetch %d:%d changed it to %d:%d", bad[i][0], bad[i][1], a, l);
    }
    const char *path = flm_simd_path();
    CHECK(flm_set_stream_prefetch(4096, 2) == 0 && flm_set_simd_path("generic") == 0, "prefetch 4096:2 refused");
    int a = -1, l = -1;
    /* The portable kernels do not prefetch, on this CPU either. */
    CHECK(flm_stream_prefetch(&a, &l) == -1 && flm_set_stream_prefetch(1024, 2) == -1,
          "the generic path reports or takes a prefetch");
    flm_set_simd_path(path);
    flm_stream_prefetch(&a, &l);
    CHECK(a == 4096 && l == 2, "choosing a path undid the prefetch set (%d:%d)", a, l);
    flm_set_stream_prefetch(ahead, level);
    printf("ok  stream prefetch (the CPU's: %d bytes into L%d)\n", ahead, level);
}

static void test_quant_decode(int type) {
    const int N = 117, K = 512;
    int cpu_ahead = 0, cpu_level = 1;
    flm_stream_prefetch(&cpu_ahead, &cpu_level);
    FlmConfig c = {.dim = K, .hidden_dim = K, .n_layers = 1, .n_heads = 1, .n_kv_heads = 1, .head_dim = 16,
                   .vocab_size = N, .seq_len = 16, .rope_dim = 16};
    FlmState s;
    float *work = own(calloc(flm_state_work_floats(&c, 2, 4), 4));
    flm_state_init(&s, &c, NULL, 2, 4, work, NULL);
    void *rows = own(alloc_rows(N, K, type, 1.0f));
    FlmMatrix *q = packed(rows, N, K, type);
    float *x = own(malloc((size_t)2 * K * 4)), *ref = own(malloc((size_t)2 * N * 4)), *out = own(malloc((size_t)2 * N * 4));
    for (int i = 0; i < 2 * K; i++) x[i] = frand() * (i % 7 == 0 ? 3.0f : 1.0f);
    for (int T = 1; T <= 2; T++) {
        flm_set_simd_path("generic");
        flm_matmul(ref, x, q, T, K, N, &s, 0, 1);
        for (int pi = 0; pi < N_PATHS; pi++) {
            if (flm_set_simd_path(paths[pi]) != 0) continue;
            for (int threads = 1; threads <= 3; threads += 2)
                for (int f = 0; f < N_PREFETCHES; f++) {
                    if (f > 0 && flm_set_stream_prefetch(PREFETCHES[f][0], PREFETCHES[f][1]) != 0) continue;
                    flm_matmul(out, x, q, T, K, N, &s, 0, threads);
                    CHECK(memcmp(out, ref, (size_t)T * N * 4) == 0, "%s %s: %d token(s) on %d thread(s), prefetch "
                          "%d:%d, differ from the portable matmul", paths[pi], flm_quant_type(type)->name, T,
                          threads, PREFETCHES[f][0], PREFETCHES[f][1]);
                }
            flm_set_stream_prefetch(cpu_ahead, cpu_level);
        }
    }
    printf("ok  %s decoding matmul (1 and 2 tokens, bit for bit across paths and prefetches)\n",
           flm_quant_type(type)->name);
    free_owned();
}

int main(void) {
    printf("SIMD path of this CPU: %s\n", flm_simd_path());
    test_conversions();
    test_model(FLM_F32, 0, 0, 0, 0, 0, 0);
    test_model(FLM_F32, 1, 1, 0, 0, 0, 0);
    test_model(FLM_BF16, 0, 1, 0, 0, 0, 0);
    test_model(FLM_BF16, 1, 0, 0, 0, 0, 0);
    test_model(FLM_F32, 1, 0, 1, 1, 0, 0);   /* Qwen3.5: gated attention beside a Gated DeltaNet layer */
    test_model(FLM_BF16, 1, 0, 1, 1, 0, 0);
    test_model(FLM_F32, 0, 0, 0, 0, 5, 0);   /* sliding windows of 5 and 19 positions */
    test_model(FLM_BF16, 1, 1, 0, 0, 5, 0);
    test_model(FLM_F32, 1, 0, 1, 1, 5, 0);   /* beside a Gated DeltaNet layer: 19 */
    for (int type = FLM_F16; type < FLM_TYPES; type++) test_quant_matmul(type);
    test_model(FLM_Q4_0, 1, 1, 0, 0, 0, 0);
    test_model(FLM_Q4_K, 0, 0, 0, 0, 0, 0);
    test_model(FLM_Q6_K, 1, 0, 1, 1, 0, 0);
    test_model(FLM_Q8_0, 0, 0, 0, 0, 5, 0);
    /* Gemma 2/3: windows, GeLU, soft-caps, sandwich norms (after the others,
     * whose random weights stay as they were drawn). */
    test_model(FLM_F32, 1, 0, 0, 0, 5, 1);
    test_model(FLM_BF16, 0, 1, 0, 0, 0, 1);
    test_model(FLM_Q4_K, 0, 0, 0, 0, 0, 1);
    test_elementwise();
    test_softmax_kernels();
    test_silu();
    test_to_bf16();
    test_delta_rule();
    test_conv_silu();
    test_kernel_tables();
    test_stream_prefetch();
    test_attention_kernels();
    test_attention_kernels_q8();
    /* last: the random draws of the tests above stay as they were */
    test_long(FLM_F32);
    test_long(FLM_F16);
    test_long(FLM_Q8_0);
    for (int type = FLM_Q8_0; type < FLM_TYPES; type++) test_quant_decode(type);
    printf(failures ? "%d failed\n" : "all passed\n", failures);
    return failures != 0;
}
