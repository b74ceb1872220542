/* The forward pass: embedding, n_layers x (RMSNorm, attention with RoPE over a
 * KV cache, RMSNorm, SwiGLU MLP), final RMSNorm, LM head.
 *
 * One OpenMP parallel region covers a whole pass; each step inside is an
 * `omp for` whose iterations are independent, so the result never depends on
 * the number of threads. */
#include "fastllm.h"

#include <math.h>
#include <string.h>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static int imax(int a, int b) { return a > b ? a : b; }
static int imin(int a, int b) { return a < b ? a : b; }

/* ------------------------------------------------------------ run state */

static int q_dim(const FlmConfig *c) { return c->n_heads * c->head_dim; }
static int kv_dim(const FlmConfig *c) { return c->n_kv_heads * c->head_dim; }

size_t flm_state_work_floats(const FlmConfig *c, int max_batch) {
    size_t b = (size_t)max_batch;
    return b * c->dim                         /* x */
         + b * imax(c->dim, q_dim(c))         /* xb */
         + b * c->dim                         /* xb2 */
         + b * q_dim(c) + 2 * b * kv_dim(c)   /* q, k, v */
         + 2 * b * c->hidden_dim              /* hb, hb2 */
         + b * c->n_heads * (size_t)c->seq_len; /* att */
}

size_t flm_state_cache_floats(const FlmConfig *c) {
    return 2 * (size_t)c->n_layers * c->seq_len * kv_dim(c);
}

void flm_state_init(FlmState *s, const FlmConfig *c, int max_batch, float *work, float *cache) {
    size_t b = (size_t)max_batch;
    s->max_batch = max_batch;
    s->x = work;    work += b * c->dim;
    s->xb = work;   work += b * imax(c->dim, q_dim(c));
    s->xb2 = work;  work += b * c->dim;
    s->q = work;    work += b * q_dim(c);
    s->k = work;    work += b * kv_dim(c);
    s->v = work;    work += b * kv_dim(c);
    s->hb = work;   work += b * c->hidden_dim;
    s->hb2 = work;  work += b * c->hidden_dim;
    s->att = work;
    s->trace = NULL;
    s->trace_tokens = s->trace_offset = 0;
    s->key_cache = cache;
    s->value_cache = cache + (size_t)c->n_layers * c->seq_len * kv_dim(c);
}

/* --------------------------------------------------------------- kernels */

/* Rows r0 .. r0+nr-1 of out (T, N) = x (T, K) @ w (N, K)^T (+ bias): one
 * group of weight rows meets every token while it is still in cache. */
static void matmul_rows(float *out, const float *x, const void *w, const float *bias,
                        int T, int K, int N, int wtype, int r0, int nr) {
    flm_tile_fn tile = wtype == FLM_BF16 ? flm_kernels->tile_bf16 : flm_kernels->tile_f32;
    size_t esize = wtype == FLM_BF16 ? 2 : 4;
    const void *wr = (const char *)w + (size_t)r0 * K * esize;
    for (int t0 = 0; t0 < T; t0 += FLM_TILE_T)
        tile(out + (size_t)t0 * N + r0, N, x + (size_t)t0 * K, K, wr, K, K,
             imin(FLM_TILE_T, T - t0), nr);
    if (bias)
        for (int t = 0; t < T; t++)
            for (int r = r0; r < r0 + nr; r++) out[(size_t)t * N + r] += bias[r];
}

typedef struct {
    float *out;
    const void *w;
    const float *bias;
    int N;
} MatJob;

/* Several products of the same input (q, k and v) in one parallel loop, so
 * the threads meet at one barrier instead of three. Called inside a
 * parallel region. */
static void matmul_multi(const float *x, int T, int K, int wtype, const MatJob *jobs, int njobs) {
    int total = 0;
    for (int i = 0; i < njobs; i++) total += (jobs[i].N + FLM_TILE_R - 1) / FLM_TILE_R;
#pragma omp for schedule(static)
    for (int g = 0; g < total; g++) {
        int i = 0, local = g;
        while (local >= (jobs[i].N + FLM_TILE_R - 1) / FLM_TILE_R) {
            local -= (jobs[i].N + FLM_TILE_R - 1) / FLM_TILE_R;
            i++;
        }
        int r0 = local * FLM_TILE_R;
        matmul_rows(jobs[i].out, x, jobs[i].w, jobs[i].bias, T, K, jobs[i].N, wtype, r0,
                    imin(FLM_TILE_R, jobs[i].N - r0));
    }
}

static void matmul(float *out, const float *x, const void *w, const float *bias,
                   int T, int K, int N, int wtype) {
    MatJob job = {out, w, bias, N};
    matmul_multi(x, T, K, wtype, &job, 1);
}

static void rmsnorm(float *out, const float *x, const float *weight, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

/* Rotate adjacent pairs (2i, 2i+1) of the first rope_dim dims of one head.
 * Written as two products and a sum, the way the reference computes
 * q*cos + rotate_half(q)*sin, so rounding matches it closely. */
static void rope(float *h, const float *cos_row, const float *sin_row, int rope_dim) {
    for (int i = 0; i < rope_dim / 2; i++) {
        float a = h[2 * i], b = h[2 * i + 1], c = cos_row[i], s = sin_row[i];
        h[2 * i] = a * c - b * s;
        h[2 * i + 1] = b * c + a * s;
    }
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* hb = silu(xb @ w_gate^T) * (xb @ w_up^T), group of rows by group of rows,
 * so the gate and up values are combined while still in cache. */
static void gate_up(const FlmConfig *c, const FlmLayer *L, FlmState *s, int T) {
    const int hidden = c->hidden_dim, dim = c->dim;
    const int groups = (hidden + FLM_TILE_R - 1) / FLM_TILE_R;
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
        int r0 = g * FLM_TILE_R, nr = imin(FLM_TILE_R, hidden - r0);
        matmul_rows(s->hb, s->xb, L->w_gate, L->b_gate, T, dim, hidden, c->wtype, r0, nr);
        matmul_rows(s->hb2, s->xb, L->w_up, L->b_up, T, dim, hidden, c->wtype, r0, nr);
        for (int t = 0; t < T; t++) {
            float *gt = s->hb + (size_t)t * hidden, *ut = s->hb2 + (size_t)t * hidden;
            for (int r = r0; r < r0 + nr; r++) gt[r] = silu(gt[r]) * ut[r];
        }
    }
}

static void embed_row(float *out, const void *table, int token, int dim, int wtype) {
    if (wtype == FLM_BF16) {
        const uint16_t *row = (const uint16_t *)table + (size_t)token * dim;
        for (int i = 0; i < dim; i++) {
            uint32_t u = (uint32_t)row[i] << 16;
            memcpy(&out[i], &u, sizeof u);
        }
    } else {
        memcpy(out, (const float *)table + (size_t)token * dim, sizeof(float) * dim);
    }
}

/* One query head of one token against the cached keys/values 0..pos. The
 * scores go through the matmul tile (keys are rows of stride kvd), so each
 * score is computed the same way whether the query came in a batch or not. */
static void attend(float *out, const float *q, const float *kc, const float *vc,
                   float *att, int pos, int head_dim, int kvd, float scale) {
    const int n = pos + 1;
    flm_tile_fn tile = flm_kernels->tile_f32;
    for (int j = 0; j < n; j += FLM_TILE_R)
        tile(att + j, 0, q, 0, kc + (size_t)j * kvd, kvd, head_dim, 1, imin(FLM_TILE_R, n - j));
    float max = -INFINITY;
    for (int j = 0; j < n; j++) {
        att[j] *= scale;
        if (att[j] > max) max = att[j];
    }
    float inv = 1.0f / flm_kernels->exp_sum(att, n, max);
    for (int j = 0; j < n; j++) att[j] *= inv;
    flm_kernels->weighted_sum(out, att, vc, n, kvd, head_dim);
}

/* ---------------------------------------------------------------- forward */

static void forward_chunk(const FlmConfig *c, const FlmWeights *w, FlmState *s,
                          const int32_t *tokens, int T, int pos,
                          float *logits, int all_logits, int n_threads) {
    const int dim = c->dim, hd = c->head_dim, qd = q_dim(c), kvd = kv_dim(c);
    const int hidden = c->hidden_dim, nh = c->n_heads, nkv = c->n_kv_heads;
    const int group = nh / nkv, half = c->rope_dim / 2;
    const size_t layer_cache = (size_t)c->seq_len * kvd;

#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++)
            embed_row(s->x + (size_t)t * dim, w->embed, tokens[t], dim, c->wtype);

        for (int l = 0; l < c->n_layers; l++) {
            const FlmLayer *L = &w->layers[l];
            float *kcache = s->key_cache + l * layer_cache;
            float *vcache = s->value_cache + l * layer_cache;

#pragma omp for schedule(static)
            for (int t = 0; t < T; t++)
                rmsnorm(s->xb + (size_t)t * dim, s->x + (size_t)t * dim, L->attn_norm, dim, c->norm_eps);

            MatJob qkv[3] = {{s->q, L->wq, L->bq, qd}, {s->k, L->wk, L->bk, kvd},
                             {s->v, L->wv, L->bv, kvd}};
            matmul_multi(s->xb, T, dim, c->wtype, qkv, 3);

            /* Per-head norm and RoPE; keys and values go into the cache. */
#pragma omp for schedule(static)
            for (int i = 0; i < T * (nh + nkv); i++) {
                int t = i / (nh + nkv), h = i % (nh + nkv), p = pos + t;
                const float *cr = w->rope_cos + (size_t)p * half, *sr = w->rope_sin + (size_t)p * half;
                if (h < nh) {
                    float *qh = s->q + (size_t)t * qd + h * hd;
                    if (L->q_norm) rmsnorm(qh, qh, L->q_norm, hd, c->norm_eps);
                    rope(qh, cr, sr, c->rope_dim);
                } else {
                    int kh = h - nh;
                    float *kh_src = s->k + (size_t)t * kvd + kh * hd;
                    float *kdst = kcache + (size_t)p * kvd + kh * hd;
                    if (L->k_norm) rmsnorm(kh_src, kh_src, L->k_norm, hd, c->norm_eps);
                    rope(kh_src, cr, sr, c->rope_dim);
                    memcpy(kdst, kh_src, sizeof(float) * hd);
                    memcpy(vcache + (size_t)p * kvd + kh * hd, s->v + (size_t)t * kvd + kh * hd,
                           sizeof(float) * hd);
                }
            }

#pragma omp for schedule(static)
            for (int i = 0; i < T * nh; i++) {
                int t = i / nh, h = i % nh, kvh = h / group;
                attend(s->xb + (size_t)t * qd + h * hd, s->q + (size_t)t * qd + h * hd,
                       kcache + kvh * hd, vcache + kvh * hd,
                       s->att + (size_t)i * c->seq_len, pos + t, hd, kvd, c->attn_scale);
            }

            matmul(s->xb2, s->xb, L->wo, L->bo, T, qd, dim, c->wtype);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *x = s->x + (size_t)t * dim, *o = s->xb2 + (size_t)t * dim;
                for (int i = 0; i < dim; i++) x[i] += o[i];
                rmsnorm(s->xb + (size_t)t * dim, x, L->ffn_norm, dim, c->norm_eps);
            }

            gate_up(c, L, s, T);
            matmul(s->xb2, s->hb, L->w_down, L->b_down, T, hidden, dim, c->wtype);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *x = s->x + (size_t)t * dim, *o = s->xb2 + (size_t)t * dim;
                for (int i = 0; i < dim; i++) x[i] += o[i];
                if (s->trace)
                    memcpy(s->trace + ((size_t)l * s->trace_tokens + s->trace_offset + t) * dim, x,
                           sizeof(float) * dim);
            }
        }

        /* Only the tokens whose logits are wanted go through the LM head. */
        if (logits) {
            int first = all_logits ? 0 : T - 1;
#pragma omp for schedule(static)
            for (int t = first; t < T; t++)
                rmsnorm(s->xb + (size_t)(t - first) * dim, s->x + (size_t)t * dim, w->norm, dim,
                        c->norm_eps);
            matmul(logits, s->xb, w->lm_head, NULL, T - first, dim, c->vocab_size, c->wtype);
        }
    }
}

static int kernels_ready = 0;

void flm_forward(const FlmConfig *c, const FlmWeights *w, FlmState *s,
                 const int32_t *tokens, int n, int pos,
                 float *logits, int all_logits, int n_threads) {
    if (!kernels_ready) { flm_kernels_init(); kernels_ready = 1; }
    if (n_threads < 1) n_threads = 1;
    for (int done = 0; done < n;) {
        int T = imin(s->max_batch, n - done);
        float *out = all_logits ? logits + (size_t)done * c->vocab_size
                   : done + T == n ? logits : NULL;
        s->trace_offset = done;
        forward_chunk(c, w, s, tokens + done, T, pos + done, out, all_logits, n_threads);
        done += T;
    }
}

const char *flm_simd_path(void) {
    if (!kernels_ready) { flm_kernels_init(); kernels_ready = 1; }
    return flm_kernels->name;
}

int flm_set_simd_path(const char *name) {
    if (!kernels_ready) { flm_kernels_init(); kernels_ready = 1; }
    return flm_kernels_select(name);
}
