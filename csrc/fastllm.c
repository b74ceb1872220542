/* The forward pass: embedding, n_layers x (RMSNorm, attention with RoPE over a
 * KV cache, RMSNorm, SwiGLU MLP or mixture of SwiGLU experts), final RMSNorm,
 * LM head. The families differ
 * only in switches of this one layer (FlmConfig's multipliers, FlmLayer's
 * optional tensors and RoPE tables), never in a path of their own.
 *
 * One OpenMP parallel region covers a whole pass; each step inside is an
 * `omp for` whose iterations are independent, so the result never depends on
 * the number of threads. */
#include "fastllm.h"

#include <limits.h>
#include <math.h>
#include <string.h>
#include <time.h>

#include "kernels.h"
#include "quant.h"
#include "topk.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static int imax(int a, int b) { return a > b ? a : b; }

static int thread_num(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
static int imin(int a, int b) { return a < b ? a : b; }

static int num_threads(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static int kernels_ready = 0;

/* The kernels for this CPU, chosen at the first call that needs them. */
static void kernels_ensure(void) {
    if (!kernels_ready) { flm_kernels_init(); kernels_ready = 1; }
}

static double wall_time(void) {
#ifdef _OPENMP
    return omp_get_wtime();
#else
    return (double)clock() / CLOCKS_PER_SEC;
#endif
}

/* Close the current phase of s->profile. Called by every thread right after
 * a work-sharing loop, whose barrier has just brought them all together. */
static void mark(FlmState *s, int phase) {
    if (!s->profile) return;
#pragma omp master
    {
        double now = wall_time();
        s->profile[phase] += now - s->profile_mark;
        s->profile_mark = now;
    }
}

/* ------------------------------------------------------------ run state */

static int q_dim(const FlmConfig *c) { return c->n_heads * c->head_dim; }
/* Attention is computed block by block of KEY_BLOCK keys (see attention);
 * a tile of at most TILE_QUERIES queries shares the keys and values it
 * reads; a sequence of at most SPLIT_ROWS tokens in a pass splits its key
 * blocks over threads, and SPLIT_BUDGET such rows fit the work buffers. */
#define KEY_BLOCK FLM_KEY_BLOCK
#define TILE_QUERIES 64
#define SPLIT_ROWS 16
#define SPLIT_BUDGET 32
static int key_blocks(const FlmConfig *c) { return (c->seq_len + KEY_BLOCK - 1) / KEY_BLOCK; }
static int split_rows(int max_batch) { return imin(max_batch, SPLIT_BUDGET); }
/* A thread's attention scratch: scores of a tile over a block, and its
 * block partials and running results (head_dim + 2 floats a query). */
static size_t att_floats(const FlmConfig *c) {
    return (size_t)TILE_QUERIES * KEY_BLOCK + 2 * (size_t)TILE_QUERIES * (c->head_dim + 2);
}
/* The FlmKV table, in floats of the work buffers (pointers stay aligned). */
static size_t kv_table_floats(const FlmConfig *c) { return ((size_t)c->n_layers * sizeof(FlmKV) + 7) / 8 * 2; }
static int kv_dim(const FlmConfig *c) { return c->n_kv_heads * c->head_dim; }
static int lin_key_dim(const FlmConfig *c) { return c->lin_k_heads * c->lin_k_dim; }
static int lin_value_dim(const FlmConfig *c) { return c->lin_v_heads * c->lin_v_dim; }
static int conv_dim(const FlmConfig *c) { return 2 * lin_key_dim(c) + lin_value_dim(c); }
static size_t lin_state_floats(const FlmConfig *c) {
    return (size_t)conv_dim(c) * imax(c->conv_kernel - 1, 0)
         + (size_t)c->lin_v_heads * c->lin_k_dim * c->lin_v_dim;
}
/* Width of xb: a mixer's input or output, or a nextn model's joined input. */
static int mixer_dim(const FlmConfig *c) {
    return imax((c->nextn ? 2 : 1) * c->dim, imax(q_dim(c), lin_value_dim(c)));
}
/* Width of the dense MLP's (or the shared expert's) hidden buffers. */
static int mlp_dim(const FlmConfig *c) { return imax(c->hidden_dim, c->shared_dim); }
/* Rows of the work buffers a matmul input may fill: a token per expert it chose. */
static size_t max_rows(const FlmConfig *c, int max_batch) { return (size_t)max_batch * imax(1, c->n_experts_used); }
#define PANEL_FLOATS(c) ((size_t)FLM_PANEL * max_input(c))
static int max_input(const FlmConfig *c) {
    return imax(mixer_dim(c), imax(imax(mlp_dim(c), c->expert_dim), c->per_layer_dim));
}
/* Rows of hb and hb2: the MLP's (or the shared expert's) hidden values, or a per-layer input's gate. */
static int hidden_buf(const FlmConfig *c) { return imax(mlp_dim(c), c->per_layer_dim); }
/* Floats a token of hb and hb2, and of gate, which shares their memory:
 * the mixer's gate is read before the MLP (or the per-layer input) writes
 * hb, so the two are never live at once. */
static size_t mlp_or_gate(const FlmConfig *c) {
    return (size_t)imax(2 * hidden_buf(c), imax(q_dim(c), lin_value_dim(c)));
}
static size_t ple_floats(const FlmConfig *c) { return (size_t)c->n_layers * c->per_layer_dim; }
/* Widest matmul input, rounded up to whole bf16 pairs, and in int8 blocks. */
static int max_input_pairs(const FlmConfig *c) { return (max_input(c) + 1) / 2; }
static size_t max_input_blocks(const FlmConfig *c) { return (size_t)(max_input(c) + 31) / 32; }

/* The mixture of experts' buffers (FlmState.router .. moe_h2). */
static size_t moe_floats(const FlmConfig *c, int max_batch) {
    if (!c->n_experts) return 0;
    const size_t b = (size_t)max_batch, k = (size_t)c->n_experts_used, rows = b * k;
    return b * c->n_experts + 3 * b * k + 3 * ((size_t)c->n_experts + 1)
         + rows * c->dim + 2 * rows * c->expert_dim;
}

size_t flm_state_work_floats(const FlmConfig *c, int max_batch, int max_threads) {
    size_t b = (size_t)max_batch;
    return kv_table_floats(c)                 /* kv */
         + b * c->dim                         /* x */
         + b * mixer_dim(c)                   /* xb */
         + b * c->dim                         /* xb2 */
         + b * q_dim(c) + 2 * b * kv_dim(c)   /* q, k, v */
         + b * mlp_or_gate(c)                 /* hb, hb2; gate */
         + b * ple_floats(c)                  /* ple */
         + b * (conv_dim(c) + 2 * (size_t)c->lin_v_heads) /* lin */
         + max_rows(c, max_batch) * max_input_pairs(c) /* xq (two bf16 per float) */
         + max_rows(c, max_batch) * max_input_blocks(c) * (sizeof(FlmQ8) / 4) /* xa */
         + (size_t)max_threads * PANEL_FLOATS(c) /* wide */
         + 2 * b                              /* row_seq, row_pos */
         + moe_floats(c, max_batch)
         + 3 * (b + 1)                        /* plan */
         + (size_t)split_rows(max_batch) * c->n_heads * key_blocks(c) * (c->head_dim + 2) /* part */
         + (size_t)max_threads * att_floats(c); /* att */
}

/* Bytes of n values of the KV cache (q8_0: n a multiple of 32, as every
 * unit of it is), and the address of element i of it (i the first of a
 * unit). */
static size_t kv_bytes(const FlmConfig *c, size_t n) {
    return c->kv_type == FLM_F32 ? 4 * n : c->kv_type == FLM_Q8_0 ? FLM_KV_Q8_BYTES(n) : 2 * n;
}
static void *kv_elem(const FlmConfig *c, void *base, size_t i) { return (char *)base + kv_bytes(c, i); }

/* Whether layer l keeps keys and values of its own. */
static int owns_cache(const FlmLayer *L, int l) { return L->kind == FLM_ATTENTION && L->kv_layer == l; }

/* The slots of layer L's cache: its window and one pass, in whole key
 * blocks, where that is less than the whole context (a ring), else every
 * position rounded up to 16. */
static int cache_slots(const FlmConfig *c, const FlmLayer *L) {
    const int whole = (c->seq_len + 15) / 16 * 16;
    if (L->window <= 0 || c->max_pass <= 0) return whole;
    const long ring = ((long)L->window - 1 + c->max_pass + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    return ring < whole ? (int)ring : whole;
}

/* Bytes of one layer's keys (or values), rounded up to whole cache lines. */
static size_t layer_bytes(const FlmConfig *c, const FlmLayer *L) {
    return (kv_bytes(c, (size_t)cache_slots(c, L) * L->n_kv_heads * L->head_dim) + 63) / 64 * 64;
}

static size_t kv_floats(const FlmConfig *c, const FlmLayer *layers) {
    size_t bytes = 0;
    for (int l = 0; layers && l < c->n_layers; l++)
        if (owns_cache(&layers[l], l)) bytes += 2 * layer_bytes(c, &layers[l]);
    return bytes / 4;
}

size_t flm_state_saved_floats(const FlmConfig *c) {
    return c->lin_v_heads ? c->n_layers * lin_state_floats(c) : 0;
}
size_t flm_state_keep_floats(const FlmConfig *c, int keep_rows) {
    return c->lin_v_heads ? (size_t)c->n_layers * keep_rows * (conv_dim(c) + 2 * (size_t)c->lin_v_heads) : 0;
}

/* The recurrent states first, then each layer's keys and values (64-byte
 * aligned where the cache is). */
size_t flm_state_cache_floats(const FlmConfig *c, const FlmLayer *layers) {
    return c->n_layers * lin_state_floats(c) + kv_floats(c, layers);
}

void flm_state_init(FlmState *s, const FlmConfig *c, const FlmLayer *layers, int max_batch, int max_threads,
                    float *work, float *cache) {
    size_t b = (size_t)max_batch;
    s->max_batch = max_batch;
    s->max_threads = max_threads;
    s->kv = (FlmKV *)work; work += kv_table_floats(c);
    s->x = work;    work += b * c->dim;
    s->xb = work;   work += b * mixer_dim(c);
    s->xb2 = work;  work += b * c->dim;
    s->q = work;    work += b * q_dim(c);
    s->k = work;    work += b * kv_dim(c);
    s->v = work;    work += b * kv_dim(c);
    s->hb = s->gate = work;
    s->hb2 = work + b * hidden_buf(c);
    work += b * mlp_or_gate(c);
    s->ple = work;  work += b * ple_floats(c);
    s->lin = work;  work += b * (conv_dim(c) + 2 * (size_t)c->lin_v_heads);
    s->xq = (uint16_t *)work; work += max_rows(c, max_batch) * max_input_pairs(c);
    s->xa = work;   work += max_rows(c, max_batch) * max_input_blocks(c) * (sizeof(FlmQ8) / 4);
    s->wide = work; work += (size_t)max_threads * PANEL_FLOATS(c);
    s->row_seq = (int32_t *)work; work += b;
    s->row_pos = (int32_t *)work; work += b;
    s->router = s->chosen_w = s->moe_x = s->moe_h = s->moe_h2 = NULL;
    s->chosen = s->slot_row = s->expert_row = s->item_start = NULL;
    if (c->n_experts) {
        const size_t k = (size_t)c->n_experts_used, rows = b * k;
        s->router = work;                 work += b * c->n_experts;
        s->chosen = (int32_t *)work;      work += b * k;
        s->chosen_w = work;               work += b * k;
        s->slot_row = (int32_t *)work;    work += b * k;
        s->expert_row = (int32_t *)work;  work += (size_t)c->n_experts + 1;
        s->item_start = (int32_t *)work;  work += 2 * ((size_t)c->n_experts + 1);
        s->moe_x = work;                  work += rows * c->dim;
        s->moe_h = work;                  work += rows * c->expert_dim;
        s->moe_h2 = work;                 work += rows * c->expert_dim;
    }
    s->plan = (int32_t *)work; work += 3 * (b + 1);
    s->part = work; work += (size_t)split_rows(max_batch) * c->n_heads * key_blocks(c) * (c->head_dim + 2);
    s->att = work;
    s->trace = NULL;
    s->trace_tokens = s->trace_offset = 0;
    s->rope_long = 0;
    s->profile = NULL;
    s->hidden = s->lin_saved = s->lin_keep = NULL;
    s->nextn_h = NULL;
    s->keep_rows = s->keep = 0;
    s->kept = -1;
    s->lin_state = cache;
    char *at = cache ? (char *)(cache + c->n_layers * lin_state_floats(c)) : NULL;
    for (int l = 0; l < c->n_layers; l++) {
        FlmKV *kv = &s->kv[l];
        memset(kv, 0, sizeof *kv);
        if (!at || !layers || !owns_cache(&layers[l], l)) continue;
        const FlmLayer *L = &layers[l];
        kv->cap = cache_slots(c, L);
        kv->window = kv->cap < c->seq_len ? L->window : 0;
        kv->head_dim = L->head_dim;
        kv->n_kv_heads = L->n_kv_heads;
        kv->keys = at;
        kv->values = at + layer_bytes(c, L);
        at += 2 * layer_bytes(c, L);
    }
}

size_t flm_state_kv_bytes(const FlmConfig *c, const FlmState *s, int n) {
    size_t bytes = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const FlmKV *kv = &s->kv[l];
        bytes += 2 * kv_bytes(c, (size_t)imin((n + 15) / 16 * 16, kv->cap) * kv->n_kv_heads * kv->head_dim);
    }
    return bytes;
}

int flm_state_rewind_room(const FlmConfig *c, const FlmState *s) {
    int room = -1;
    for (int l = 0; l < c->n_layers; l++)
        if (s->kv[l].window) {
            const int r = s->kv[l].cap - s->kv[l].window + 1;
            room = room < 0 ? r : imin(room, r);
        }
    return room;
}

/* Copy n positions' worth of 16-slot blocks of each head of kv's keys and
 * values, from slot block `from` on (wrapping around a ring), between a
 * cache and a buffer laid out block after block: save copies into buf.
 * Returns the elements copied. */
static size_t copy_blocks(const FlmConfig *c, const FlmKV *kv, int from, int blocks, void *buf, int save) {
    const size_t block = 16 * (size_t)kv->head_dim, bytes = kv_bytes(c, block), ring = kv->cap / 16;
    size_t done = 0;
    for (int h = 0; h < kv->n_kv_heads; h++)
        for (int part = 0; part < 2; part++) {
            char *base = kv_elem(c, part ? kv->values : kv->keys, (size_t)h * kv->cap * kv->head_dim);
            for (int i = 0; i < blocks; i++, done += block) {
                char *slot = base + ((size_t)(from + i) % ring) * bytes, *other = kv_elem(c, buf, done);
                if (save) memcpy(other, slot, bytes);
                else memcpy(slot, other, bytes);
            }
        }
    return done;
}

/* The slot blocks of a ring's window before pos: from the block of its
 * first key to the block of pos - 1. */
static int window_first(const FlmKV *kv, int pos) { return imax(0, pos - kv->window + 1) / 16; }
static int window_blocks(const FlmKV *kv, int pos) {
    return pos > 0 ? (pos - 1) / 16 - window_first(kv, pos) + 1 : 0;
}

size_t flm_state_window_floats(const FlmConfig *c, const FlmState *s) {
    size_t elems = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const FlmKV *kv = &s->kv[l];
        if (kv->window)   /* at most: the window's keys fill at most this many blocks */
            elems += 2 * (size_t)((kv->window + 14) / 16 + 1) * 16 * kv->head_dim * kv->n_kv_heads;
    }
    return (kv_bytes(c, elems) + 3) / 4;
}

void flm_state_window(const FlmConfig *c, FlmState *s, int pos, float *buf, int save) {
    size_t done = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const FlmKV *kv = &s->kv[l];
        if (kv->window)
            done += copy_blocks(c, kv, window_first(kv, pos), window_blocks(kv, pos), kv_elem(c, buf, done), save);
    }
}

size_t flm_state_prefix_bytes(const FlmConfig *c, const FlmState *s, int n) {
    size_t elems = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const FlmKV *kv = &s->kv[l];
        if (kv->cap && !kv->window)
            elems += 2 * (size_t)((n + 15) / 16) * 16 * kv->head_dim * kv->n_kv_heads;
    }
    return kv_bytes(c, elems);
}

void flm_state_prefix(const FlmConfig *c, FlmState *s, int n, void *buf, int save) {
    size_t done = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const FlmKV *kv = &s->kv[l];
        if (kv->cap && !kv->window)
            done += copy_blocks(c, kv, 0, (n + 15) / 16, kv_elem(c, buf, done), save);
    }
}

int flm_state_tail(const FlmConfig *c, const FlmState *s, int n, size_t *ranges, int max) {
    const size_t from = (size_t)(n + 15) / 16 * 16;   /* whole blocks: a q8_0 block never straddles it */
    int count = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const FlmKV *kv = &s->kv[l];
        if (!kv->cap || kv->window || from >= (size_t)kv->cap) continue;
        for (int part = 0; part < 2; part++)
            for (int h = 0; h < kv->n_kv_heads; h++, count++) {
                if (count >= max) continue;
                char *base = part ? kv->values : kv->keys;
                const char *start = kv_elem(c, base, ((size_t)h * kv->cap + from) * kv->head_dim);
                const char *end = kv_elem(c, base, (size_t)(h + 1) * kv->cap * kv->head_dim);
                ranges[2 * count] = (size_t)(start - (const char *)s->lin_state);
                ranges[2 * count + 1] = (size_t)(end - start);
            }
    }
    return count;
}

void flm_state_copy(const FlmConfig *c, FlmState *dst, const FlmState *src, int n, int whole) {
    for (int l = 0; l < c->n_layers; l++) {
        const FlmKV *from = &src->kv[l], *to = &dst->kv[l];
        if (!from->cap || n == 0) continue;
        /* Whole blocks of 16 positions (a block's later positions are
         * written before they are ever read); of a ring, the last cap
         * positions before n at most. */
        const int last = (n - 1) / 16, first = imax(0, last + 1 - from->cap / 16);
        for (int h = 0; h < from->n_kv_heads; h++)
            for (int part = 0; part < 2; part++) {
                const size_t head = (size_t)h * from->cap * from->head_dim, block = 16 * (size_t)from->head_dim;
                char *d = kv_elem(c, part ? to->values : to->keys, head);
                const char *f = kv_elem(c, part ? from->values : from->keys, head);
                for (int b = first; b <= last;) {   /* runs of consecutive slots */
                    const int slot = b % (from->cap / 16), run = imin(last + 1 - b, from->cap / 16 - slot);
                    memcpy(d + kv_bytes(c, slot * block), f + kv_bytes(c, slot * block), kv_bytes(c, run * block));
                    b += run;
                }
            }
    }
    dst->rope_long = src->rope_long;
    if (whole)
        memcpy(dst->lin_state, src->lin_state, sizeof(float) * c->n_layers * lin_state_floats(c));
}

/* --------------------------------------------------------------- kernels */

/* A matmul input in every form a weight type may take: fp32 rows, bf16
 * pairs (where bf16 weights take bf16 activations) and int8 blocks (where
 * quantized weights take int8), each made once for all the products that
 * share the input. */
typedef struct {
    const float *x;
    int ldx;
    const float *xb;     /* bf16 pairs, ldb pairs per row */
    int ldb;
    const FlmQ8 *xa;     /* lda blocks per row */
    int lda;
    const FlmState *s;
    int float_acts;
} MatInput;

static int takes_bf16(const FlmMatrix *w) { return w->type == FLM_BF16 && flm_kernels->to_bf16; }
static int takes_int8(const FlmMatrix *w, int float_acts) { return flm_is_quantized(w->type) && !float_acts; }

/* Panels p0 .. p0+np-1 (rows 16*p0 ..) of out (T, N) = x (T, K) @ w (N, K)^T
 * (+ bias), for tokens t0 .. t0+T-1 of the input. */
static void matmul_panels(float *out, int ldo, const MatInput *in, int t0, const FlmMatrix *w,
                          const float *bias, int T, int K, int N, int p0, int np) {
    if (w->type == FLM_F32) {
        flm_kernels->gemm_f32(out, ldo, in->x + (size_t)t0 * in->ldx, in->ldx, w->data, K, T, p0, np, N);
    } else if (w->type == FLM_BF16) {
        if (takes_bf16(w))
            flm_kernels->gemm_bf16(out, ldo, in->xb + (size_t)t0 * in->ldb, in->ldb, w->data, K, T, p0, np, N);
        else
            flm_kernels->gemm_bf16(out, ldo, in->x + (size_t)t0 * in->ldx, in->ldx, w->data, K, T, p0, np, N);
    } else if (takes_int8(w, in->float_acts)) {
        flm_kernels->qgemm(out, ldo, in->xa + (size_t)t0 * in->lda, in->lda, w->data, K, T, p0, np, N, w->type);
    } else {
        /* fp32 activations: each panel dequantized whole, then the fp32
         * kernel, so the products are those of the dequantized fp32 matrix
         * bit for bit (the kernels sum each panel the same way alone). */
        float *wide = in->s->wide + (size_t)thread_num() * FLM_PANEL * K;
        for (int p = p0; p < p0 + np; p++) {
            flm_quant_dequant_panel(wide, w->data, p, 0, K, K, w->type);
            flm_kernels->gemm_f32(out + p * FLM_PANEL, ldo, in->x + (size_t)t0 * in->ldx, in->ldx, wide, K, T, 0,
                                  1, N - p * FLM_PANEL);
        }
    }
    if (bias)
        for (int t = 0; t < T; t++)
            for (int r = p0 * FLM_PANEL; r < imin(N, (p0 + np) * FLM_PANEL); r++)
                out[(size_t)t * ldo + r] += bias[r];
}

/* Matmul work items are handed out a chunk at a time as threads come free
 * (schedule(dynamic)) rather than in fixed shares: a thread that the OS or
 * another process slows down then holds the others at the loop's barrier
 * for one chunk, not for its whole share of a matrix. Which thread computes
 * an item never changes its result. About 16 chunks per thread. */
static int chunk_of(int items) { return imax(1, items / (num_threads() * 16)); }

/* Decoding (one or two tokens a pass) is the exception: its items take a
 * few microseconds each, so taking them one by one from the loop's shared
 * counter (a cache line that travels between the cores at every take) costs
 * a few percent of the pass, and a thread that takes runs of consecutive
 * items lets the int8 kernels prefetch the panels of its next item while
 * finishing the last (quant.c). There the items go out in runs that halve
 * as the loop ends (schedule(guided)): on the 2-core Xeon, forward_speed's
 * Qwen2.5-0.5B shape at Q5_0 decoded 74-76 → 77-80 tokens/s at 2 threads. */
static int decoding(int T) { return T <= FLM_DECODE_TOKENS; }

/* Panels per parallel work item: a batch of tokens wants several panels in
 * cache at once (4 x 16 rows of 576 fp32 are 147 KB, at home in L2);
 * decoding streams each panel once, in calls of 4 panels rather than one,
 * so that the calls' own cost stays small beside a panel's few microseconds
 * (threads are balanced by handing out chunks of items as they come free),
 * and the x86 int8 kernels read a call's 4 panels side by side
 * (DECODE_PANELS in quant.c: fewer per call and they read one at a time). */
static int item_panels(int T) { (void)T; return 4; }

/* Tokens per work item (a whole number of the gemm's token tiles):
 * splitting a long prompt too evens out the threads when a matrix has few
 * panel groups. Items run panel group by panel group, so one thread's
 * consecutive items reuse the same weights from its cache. int8: products
 * whose weights all take int8 activations, whose kernels run tiles of up
 * to 16 tokens (quant.c); the float kernels' blocks (60: ten of their
 * 6-token tiles) would leave every block a tile of 4. */
#define INT8_TOKEN_BLOCK 64
static int token_block(int int8) { return int8 ? INT8_TOKEN_BLOCK : flm_kernels->token_block; }
static int token_blocks(int T, int int8) { return (T + token_block(int8) - 1) / token_block(int8); }

typedef struct {
    float *out;
    const FlmMatrix *w;
    const float *bias;
    int N;     /* rows of w */
    int ldo;   /* row stride of out: N, or more when products share a buffer */
} MatJob;

/* Whether every product of jobs takes int8 activations. */
static int all_int8(const MatJob *jobs, int njobs, int float_acts) {
    int all = 1;
    for (int i = 0; i < njobs; i++) all &= takes_int8(jobs[i].w, float_acts);
    return all;
}

/* The input x (T, K) in the forms the weights of jobs take. Called inside
 * a parallel region. */
static MatInput matmul_input(const FlmState *s, const float *x, int T, int K, const MatJob *jobs, int njobs,
                             int float_acts) {
    MatInput in = {x, K, NULL, 0, NULL, 0, s, float_acts};
    int bf16 = 0, int8 = 0;
    for (int i = 0; i < njobs; i++) {
        bf16 |= takes_bf16(jobs[i].w);
        int8 |= takes_int8(jobs[i].w, float_acts);
    }
    if (bf16) {
        in.ldb = (K + 1) / 2;
        in.xb = (const float *)s->xq;
    }
    if (int8) {
        in.lda = K / 32;
        in.xa = (const FlmQ8 *)s->xa;
    }
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        if (bf16) flm_kernels->to_bf16(s->xq + (size_t)t * in.ldb * 2, x + (size_t)t * K, K);
        if (int8) flm_kernels->quantize_q8((FlmQ8 *)s->xa + (size_t)t * in.lda, x + (size_t)t * K, K);
    }
    return in;
}

/* Item g of matmul_multi's loop: jobs[i] holds items[i] of them, each
 * item_panels(T) panels for token_block(int8) tokens. */
static void multi_item(const MatInput *in, const MatJob *jobs, const int *items, int g, int T, int K, int int8) {
    const int per = item_panels(T), tb = token_blocks(T, int8);
    int i = 0, local = g;
    while (local >= items[i]) local -= items[i++];
    int panels = (jobs[i].N + FLM_PANEL - 1) / FLM_PANEL, p0 = local / tb * per;
    int t0 = local % tb * token_block(int8), nt = imin(token_block(int8), T - t0);
    matmul_panels(jobs[i].out + (size_t)t0 * jobs[i].ldo, jobs[i].ldo, in, t0, jobs[i].w, jobs[i].bias, nt, K,
                  jobs[i].N, p0, imin(per, panels - p0));
}

/* Several products of the same input (q, k and v) in one parallel loop, so
 * the threads meet at one barrier instead of three. Called inside a
 * parallel region. */
static void matmul_multi(const FlmState *s, const float *x, int T, int K, const MatJob *jobs, int njobs,
                         int float_acts) {
    const MatInput in = matmul_input(s, x, T, K, jobs, njobs, float_acts);
    const int int8 = all_int8(jobs, njobs, float_acts), per = item_panels(T), tb = token_blocks(T, int8);
    int items[8] = {0}, total = 0;
    for (int i = 0; i < njobs; i++) {
        items[i] = ((jobs[i].N + FLM_PANEL - 1) / FLM_PANEL + per - 1) / per * tb;
        total += items[i];
    }
    if (decoding(T)) {
#pragma omp for schedule(guided)
        for (int g = 0; g < total; g++) multi_item(&in, jobs, items, g, T, K, int8);
    } else {
#pragma omp for schedule(dynamic, chunk_of(total))
        for (int g = 0; g < total; g++) multi_item(&in, jobs, items, g, T, K, int8);
    }
}

static void matmul(const FlmConfig *c, FlmState *s, float *out, const float *x, const FlmMatrix *w,
                   const float *bias, int T, int K, int N) {
    MatJob job = {out, w, bias, N, N};
    matmul_multi(s, x, T, K, &job, 1, c->float_acts);
}

void flm_matmul(float *out, const float *x, const FlmMatrix *w, int T, int K, int N, FlmState *s,
                int float_acts, int n_threads) {
    kernels_ensure();
    MatJob job = {out, w, NULL, N, N};
#pragma omp parallel num_threads(n_threads > 0 ? n_threads : 1)
    matmul_multi(s, x, T, K, &job, 1, float_acts);
}

static void rmsnorm(float *out, const float *x, const float *weight, int n, float eps) {
    flm_kernels->rmsnorm(out, x, weight, n, eps);
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

static void (*act_mul_of(const FlmConfig *c))(float *, const float *, int) {
    return c->activation == FLM_GELU_TANH ? flm_kernels->gelu_tanh_mul : flm_kernels->silu_mul;
}

/* Item g of gate_up's loop: a group of item_panels(T) panels of both
 * products for token_block(int8) tokens, then their activation. */
static void gate_up_item(const FlmConfig *c, FlmState *s, const MatInput *in, const MatJob jobs[2], int g, int T,
                         int int8) {
    const int dim = c->dim, hidden = jobs[0].N, per = item_panels(T), tb = token_blocks(T, int8);
    const int panels = (hidden + FLM_PANEL - 1) / FLM_PANEL;
    int p0 = g / tb * per, np = imin(per, panels - p0);
    int r0 = p0 * FLM_PANEL, nr = imin(np * FLM_PANEL, hidden - r0);
    int t0 = g % tb * token_block(int8), nt = imin(token_block(int8), T - t0);
    for (int j = 0; j < 2; j++)
        matmul_panels(jobs[j].out + (size_t)t0 * hidden, hidden, in, t0, jobs[j].w, jobs[j].bias, nt, dim, hidden,
                      p0, np);
    for (int t = t0; t < t0 + nt; t++)
        act_mul_of(c)(s->hb + (size_t)t * hidden + r0, s->hb2 + (size_t)t * hidden + r0, nr);
}

/* hb = act(xb @ w_gate^T) * (xb @ w_up^T), hidden wide, group of rows by
 * group of rows, so the gate and up values are combined while still in cache. */
static void gate_up(const FlmConfig *c, FlmState *s, int T, const FlmMatrix *w_gate, const FlmMatrix *w_up,
                    const float *b_gate, const float *b_up, int hidden) {
    const int dim = c->dim;
    MatJob jobs[2] = {{s->hb, w_gate, b_gate, hidden, hidden}, {s->hb2, w_up, b_up, hidden, hidden}};
    const int int8 = all_int8(jobs, 2, c->float_acts), per = item_panels(T), tb = token_blocks(T, int8);
    const int panels = (hidden + FLM_PANEL - 1) / FLM_PANEL, groups = (panels + per - 1) / per;
    const MatInput in = matmul_input(s, s->xb, T, dim, jobs, 2, c->float_acts);
    if (decoding(T)) {
#pragma omp for schedule(guided)
        for (int g = 0; g < groups * tb; g++) gate_up_item(c, s, &in, jobs, g, T, int8);
    } else {
#pragma omp for schedule(dynamic, chunk_of(groups * tb))
        for (int g = 0; g < groups * tb; g++) gate_up_item(c, s, &in, jobs, g, T, int8);
    }
}

/* Row `token` of an embedding table of plain rows of width dim. */
static void table_row(float *out, const FlmMatrix *table, int token, int dim) {
    const int type = table->type;
    if (type == FLM_BF16) {
        const uint16_t *row = (const uint16_t *)table->data + (size_t)token * dim;
        for (int i = 0; i < dim; i++) out[i] = flm_bf16_to_f32(row[i]);
    } else if (type == FLM_F32) {
        memcpy(out, (const float *)table->data + (size_t)token * dim, sizeof(float) * dim);
    } else {
        const FlmQuantType *q = flm_quant_type(type);
        const size_t row_bytes = (size_t)dim / q->ggml_block * q->ggml_bytes;
        flm_quant_dequant_row(out, (const char *)table->data + (size_t)token * row_bytes, dim, type);
    }
}

static void embed_row(float *out, const FlmWeights *w, int token, int dim) {
    if (!w->embed)  /* tied: the rows live in the packed LM head */
        flm_packed_row(out, w->lm_head->data, token, dim, w->lm_head->type);
    else
        table_row(out, w->embed, token, dim);
}

/* Store n values into the KV cache at element i (stride elements apart),
 * rounded to its type (not q8_0). */
static void kv_store(const FlmConfig *c, void *cache, size_t i, size_t stride, const float *x, int n) {
    for (int d = 0; d < n; d++, i += stride) {
        if (c->kv_type == FLM_F32) ((float *)cache)[i] = x[d];
        else if (c->kv_type == FLM_BF16) ((uint16_t *)cache)[i] = flm_f32_to_bf16(x[d]);
        else ((uint16_t *)cache)[i] = flm_f32_to_f16(x[d]);
    }
}

/* n values (a multiple of 32) as q8_0: the int8 stride apart from q, each
 * 32's scale stride apart from scales. The int8 are x over the scale as
 * stored (f16), so that scale * int8 is the value the cache stands for. A
 * group with a value that is not finite gets a NaN scale: it must not
 * vanish into int8. */
static void kv_store_q8(int8_t *q, uint16_t *scales, size_t stride, const float *x, int n) {
    for (int g = 0; g < n; g += 32) {
        float amax = 0.0f;
        int finite = 1;
        for (int d = g; d < g + 32; d++) {
            amax = fmaxf(amax, fabsf(x[d]));
            finite &= isfinite(x[d]);
        }
        const uint16_t h = finite ? flm_f32_to_f16(amax / 127.0f) : 0x7E00;
        const float scale = flm_f16_to_f32(h), inv = finite && scale > 0.0f ? 1.0f / scale : 0.0f;
        scales[(size_t)g / 32 * stride] = h;
        for (int d = g; d < g + 32; d++) {
            const float r = finite ? nearbyintf(x[d] * inv) : 0.0f;
            q[d * stride] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
        }
    }
}

/* A q8_0 cache stores each head's key and value times an orthonormal
 * Walsh-Hadamard matrix: rotated, a head's few large channels spread over
 * all of its values, so that no group's scale is set by one outlier and
 * the int8 steps of the others stay fine.
 * Scores are unchanged, the queries being rotated alike (H is orthogonal),
 * and a head's output is rotated back (H is symmetric: its own inverse).
 * Keys rotate in runs of the largest power of two dividing head_dim,
 * values in runs of at most 64. */
static int key_rotation(int hd) { return hd & -hd; }
static int value_rotation(int hd) { return imin(hd & -hd, 64); }

/* x (n values) times the orthonormal Walsh-Hadamard matrix of size m, a
 * power of two dividing n, in each run of m values. */
static void hadamard(float *x, int n, int m) {
    const float norm = 1.0f / sqrtf((float)m);
    for (float *y = x; y < x + n; y += m) {
        for (int h = 1; h < m; h *= 2)
            for (int i = 0; i < m; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
        for (int i = 0; i < m; i++) y[i] *= norm;
    }
}

/* Key and value of slot (of head kh's slots) into layer cache kv. */
static void kv_store_token(const FlmConfig *c, const FlmKV *kv, size_t slot, const float *k, const float *v) {
    const int hd = kv->head_dim;
    if (c->kv_type != FLM_Q8_0) {
        kv_store(c, kv->keys, (slot / 16 * hd) * 16 + slot % 16, 16, k, hd);
        kv_store(c, kv->values, slot * hd, 1, v, hd);
        return;
    }
    int8_t *block = kv_elem(c, kv->keys, slot / 16 * 16 * hd), *row = kv_elem(c, kv->values, slot * hd);
    kv_store_q8(block + slot % 16, (uint16_t *)(block + 16 * hd) + slot % 16, 16, k, hd);
    kv_store_q8(row, (uint16_t *)(row + hd), 1, v, hd);
}

/* ----------------------------------------------------------- mixers */

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* A head of values that are its keys as projected (Gemma 4's k_eq_v): the
 * key rows come permuted for RoPE (2i and 2i+1 holding HF's i and
 * i + rope_dim/2), the values are wanted in HF's order. */
static void values_of_keys(float *v, const float *k, int hd, int rope_dim) {
    const int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        v[i] = k[2 * i];
        v[i + half] = k[2 * i + 1];
    }
    memcpy(v + rope_dim, k + rope_dim, sizeof(float) * (hd - rope_dim));
}

/* ----------------------------------------------------------- attention
 *
 * A query at position p attends to the keys first_key(p) .. p, cut at
 * fixed positions into blocks of KEY_BLOCK keys. Each block gives the
 * query a partial result: the largest of its scaled scores m, the sum s of
 * exp(score - m), and the values summed with those weights; the partials
 * are folded into one in block order (an online softmax), and the output
 * is its weighted sum over its s. Each step depends on the query's position
 * alone, so however the work is scheduled (threads, a prompt cut into
 * passes, other sequences in the pass, queries computed together) every
 * output has the same bits. Work items share what they read among several
 * queries: the query heads of one KV head, and consecutive positions. Two
 * schedules:
 *  - tiles: an item is a run of positions of one sequence and (some of)
 *    the query heads of one KV head, at most TILE_QUERIES queries, that
 *    walks its key blocks in order (a prompt, whose many queries share
 *    each key: no row of scores longer than a block is ever held);
 *  - split: an item is one key block of one KV head for all the queries of
 *    a short pass of one sequence (decoding, a speculative draft), whose
 *    partials are kept, then folded in block order, so that a long
 *    context's keys and values stream on every thread.
 */

static int first_key(int pos, int window) { return window > 0 ? imax(0, pos - window + 1) : 0; }
static int first_block(int pos, int window) { return first_key(pos, window) / KEY_BLOCK; }
static int last_block(int pos) { return pos / KEY_BLOCK; }

/* The partial results of nq queries of KV head kvh over key block b:
 * query i (q[i], at position pos[i], reading some key of the block) gets
 * at out[i * (hd + 2)] its hd weighted sums, its largest scaled score and
 * its sum of exponentials. The scores of the keys from the first 16-key
 * boundary at or before any query's first key to the last any reads are
 * computed for all the queries at once (those outside a query's range
 * are left unused); each value then goes into the sums of the queries
 * that read it, in order of position: those before the range all queries
 * share one query at a time, the shared range for all at once, then the
 * rest. */
static void block_partial(const FlmConfig *c, const FlmKV *kv, int kvh, int window, int b, const float *const *q,
                          const int *pos, int nq, float *att, float *out) {
    const int hd = kv->head_dim, ld = hd + 2;
    int lo[TILE_QUERIES], hi[TILE_QUERIES], from = INT_MAX, to = 0, shared_lo = 0, shared_hi = INT_MAX;
    for (int i = 0; i < nq; i++) {
        lo[i] = imax(first_key(pos[i], window), b * KEY_BLOCK);
        hi[i] = imin(pos[i] + 1, (b + 1) * KEY_BLOCK);
        from = imin(from, lo[i]);
        to = imax(to, hi[i]);
        shared_lo = imax(shared_lo, lo[i]);
        shared_hi = imin(shared_hi, hi[i]);
    }
    /* The block's positions are consecutive slots, a ring's too (its slots
     * are a whole number of blocks). */
    const int base = from / 16 * 16;
    const size_t first_slot = (size_t)kvh * kv->cap + (size_t)(base % kv->cap);
    void *keys = kv_elem(c, kv->keys, first_slot * hd), *values = kv_elem(c, kv->values, first_slot * hd);
    flm_kernels->key_scores(att, KEY_BLOCK, q, nq, keys, to - base, hd, c->kv_type);
    for (int i = 0; i < nq; i++) {
        float *a = att + (size_t)i * KEY_BLOCK + (lo[i] - base), *o = out + (size_t)i * ld;
        const int n = hi[i] - lo[i];
        float m;
        if (c->attn_softcap > 0.0f) {   /* the scaled scores soft-capped, as Gemma 2 does */
            flm_kernels->scale(a, n, c->attn_scale);
            m = flm_kernels->softcap_max(a, n, c->attn_softcap);
        } else {
            m = flm_kernels->scale_max(a, n, c->attn_scale);
        }
        o[hd] = m;
        o[hd + 1] = flm_kernels->exp_sum(a, n, m);
        memset(o, 0, sizeof(float) * hd);
    }
#define WSUM(i0, count, j0, n) \
    flm_kernels->weighted_sum(out + (size_t)(i0) * ld, ld, att + (size_t)(i0) * KEY_BLOCK + ((j0) - base), KEY_BLOCK, \
                              count, kv_elem(c, values, (size_t)((j0) - base) * hd), n, hd, hd, c->kv_type)
    if (shared_lo >= shared_hi) {
        for (int i = 0; i < nq; i++) WSUM(i, 1, lo[i], hi[i] - lo[i]);
        return;
    }
    for (int i = 0; i < nq; i++)
        if (lo[i] < shared_lo) WSUM(i, 1, lo[i], shared_lo - lo[i]);
    WSUM(0, nq, shared_lo, shared_hi - shared_lo);
    for (int i = 0; i < nq; i++)
        if (hi[i] > shared_hi) WSUM(i, 1, shared_hi, hi[i] - shared_hi);
#undef WSUM
}

/* run (hd sums, max, sum of exponentials) takes in the next block's partial. */
static void fold(float *run, const float *part, int hd) {
    const float m = fmaxf(run[hd], part[hd]), a = expf(run[hd] - m), b = expf(part[hd] - m);
    for (int d = 0; d < hd; d++) run[d] = run[d] * a + part[d] * b;
    run[hd] = m;
    run[hd + 1] = run[hd + 1] * a + part[hd + 1] * b;
}

/* A query's output from its folded partials, times sigmoid(gate) where the
 * layer gates its attention. */
static void finish(const FlmConfig *c, float *out, const float *run, int hd, const float *gate) {
    const float inv = 1.0f / run[hd + 1];
    for (int d = 0; d < hd; d++) out[d] = run[d] * inv;
    if (c->kv_type == FLM_Q8_0) hadamard(out, hd, value_rotation(hd));   /* the values were stored rotated */
    if (gate)
        for (int d = 0; d < hd; d++) out[d] *= sigmoid(gate[d]);
}

/* One layer's attention over the rows of a pass, as the work items see it. */
typedef struct {
    const FlmConfig *c;
    const FlmLayer *L;
    FlmState *s;
    const FlmSeq *seqs;
    int n_seqs, hd, qd, group, window, heads_per_item, rows_per_tile, blocks;
    const int32_t *items;   /* (n_seqs + 1) each sequence's first work item */
    const int32_t *split;   /* (n_seqs) each sequence's first row of partials, or -1: tiles */
    const int32_t *row0;    /* (n_seqs) each sequence's first row of the pass */
} Attn;

/* The rows r0 .. r1-1 of sequence k that read key block b: those from the
 * block's first position on, up to the last whose window reaches it. */
static void rows_reading(const Attn *a, int k, int b, int *r0, int *r1) {
    const int p0 = a->seqs[k].pos;
    while (*r0 < *r1 && p0 + *r0 < b * KEY_BLOCK) (*r0)++;
    while (*r1 > *r0 && first_block(p0 + *r1 - 1, a->window) > b) (*r1)--;
}

/* The queries of rows r0 .. r1-1 of sequence k and query heads g0 ..
 * g0+gn-1 of KV head kvh's group, row by row. */
static int gather(const Attn *a, int k, int kvh, int g0, int gn, int r0, int r1, const float **q, int *pos) {
    int n = 0;
    for (int r = r0; r < r1; r++)
        for (int g = g0; g < g0 + gn; g++, n++) {
            q[n] = a->s->q + (size_t)(a->row0[k] + r) * a->qd + (size_t)(kvh * a->group + g) * a->hd;
            pos[n] = a->seqs[k].pos + r;
        }
    return n;
}

static float *thread_att(const Attn *a) { return a->s->att + (size_t)thread_num() * att_floats(a->c); }

static float *out_row(const Attn *a, int t, int h) { return a->s->xb + (size_t)t * a->qd + (size_t)h * a->hd; }
static const float *gate_row(const Attn *a, int t, int h) {
    return a->L->w_attn_gate ? a->s->gate + (size_t)t * a->qd + (size_t)h * a->hd : NULL;
}

/* A tile: rows r0 .. r1-1 of sequence k, query heads g0 .. g0+gn-1 of KV
 * head kvh's group, block after block. */
static void attend_tile(const Attn *a, int k, int kvh, int g0, int gn, int r0, int r1) {
    const FlmKV *kv = &a->seqs[k].state->kv[a->L->kv_layer];
    const int hd = a->hd, ld = hd + 2, p0 = a->seqs[k].pos;
    float *att = thread_att(a), *run = att + (size_t)TILE_QUERIES * KEY_BLOCK, *part = run + (size_t)TILE_QUERIES * ld;
    const float *q[TILE_QUERIES];
    int pos[TILE_QUERIES];
    const int nq = gather(a, k, kvh, g0, gn, r0, r1, q, pos);
    for (int b = first_block(p0 + r0, a->window); b <= last_block(p0 + r1 - 1); b++) {
        int ra = r0, rb = r1;
        rows_reading(a, k, b, &ra, &rb);
        const int i0 = (ra - r0) * gn, n = (rb - ra) * gn;
        block_partial(a->c, kv, kvh, a->window, b, q + i0, pos + i0, n, att, part + (size_t)i0 * ld);
        for (int i = i0; i < i0 + n; i++) {
            if (b == first_block(pos[i], a->window))
                memcpy(run + (size_t)i * ld, part + (size_t)i * ld, sizeof(float) * ld);
            else
                fold(run + (size_t)i * ld, part + (size_t)i * ld, hd);
        }
    }
    for (int i = 0; i < nq; i++) {
        const int t = a->row0[k] + r0 + i / gn, h = kvh * a->group + g0 + i % gn;
        finish(a->c, out_row(a, t, h), run + (size_t)i * ld, hd, gate_row(a, t, h));
    }
}

/* Where the partial of block b of the query of row r of a split sequence
 * (its rows of partials from split) and head h is kept. */
static float *partial_at(const Attn *a, int split, int r, int h, int b) {
    return a->s->part + (((size_t)(split + r) * a->c->n_heads + h) * a->blocks + b) * (a->hd + 2);
}

/* Key block b of KV head kvh for every query of sequence k that reads it. */
static void attend_split(const Attn *a, int k, int kvh, int b) {
    const FlmKV *kv = &a->seqs[k].state->kv[a->L->kv_layer];
    const int ld = a->hd + 2;
    float *att = thread_att(a), *part = att + (size_t)TILE_QUERIES * KEY_BLOCK;
    const float *q[TILE_QUERIES];
    int pos[TILE_QUERIES], ra = 0, rb = a->seqs[k].n;
    rows_reading(a, k, b, &ra, &rb);
    /* Rows at a time, as many as TILE_QUERIES queries take (at least one
     * row: a group wider than that goes in parts). */
    const int per = imax(1, TILE_QUERIES / a->group), gn = imin(a->group, TILE_QUERIES);
    for (int r = ra; r < rb; r += per)
        for (int g = 0; g < a->group; g += gn) {
            const int rows = imin(per, rb - r), heads = imin(gn, a->group - g);
            const int n = gather(a, k, kvh, g, heads, r, r + rows, q, pos);
            block_partial(a->c, kv, kvh, a->window, b, q, pos, n, att, part);
            for (int i = 0; i < n; i++)
                memcpy(partial_at(a, a->split[k], r + i / heads, kvh * a->group + g + i % heads, b),
                       part + (size_t)i * ld, sizeof(float) * ld);
        }
}

/* Work items of sequence k, given its schedule. */
static int seq_items(const Attn *a, int k, int split) {
    const FlmSeq *q = &a->seqs[k];
    const int nkv = a->L->n_kv_heads;
    if (split) return nkv * (last_block(q->pos + q->n - 1) - first_block(q->pos, a->window) + 1);
    const int head_parts = (a->group + a->heads_per_item - 1) / a->heads_per_item;
    return nkv * head_parts * ((q->n + a->rows_per_tile - 1) / a->rows_per_tile);
}

/* Work item g, of sequence k, whose first item is `first`. */
static void attend_item(const Attn *a, int k, int g) {
    const FlmSeq *q = &a->seqs[k];
    const int local = g - a->items[k];
    if (a->split[k] >= 0) {
        const int fb = first_block(q->pos, a->window), nb = last_block(q->pos + q->n - 1) - fb + 1;
        attend_split(a, k, local / nb, fb + local % nb);
        return;
    }
    const int tiles = (q->n + a->rows_per_tile - 1) / a->rows_per_tile;
    const int head_parts = (a->group + a->heads_per_item - 1) / a->heads_per_item;
    const int kvh = local / (head_parts * tiles), part = local / tiles % head_parts, tile = local % tiles;
    const int g0 = part * a->heads_per_item, r0 = tile * a->rows_per_tile;
    attend_tile(a, k, kvh, g0, imin(a->heads_per_item, a->group - g0), r0, imin(q->n, r0 + a->rows_per_tile));
}

/* The schedule of one layer's attention: which sequences split their
 * blocks (short passes over more than one block, while the partials fit),
 * the tiles' rows (fewer where there would be too few items for the
 * threads: the results are the same), and each sequence's first item.
 * Called by one thread. */
static void plan_attention(Attn *a, int32_t *items, int32_t *split, int threads) {
    int used = 0;
    for (int k = 0; k < a->n_seqs; k++) {
        const FlmSeq *q = &a->seqs[k];
        const int blocks = last_block(q->pos + q->n - 1) - first_block(q->pos, a->window) + 1;
        split[k] = -1;
        if (q->n <= SPLIT_ROWS && blocks > 1 && used + q->n <= split_rows(a->s->max_batch)) {
            split[k] = used;
            used += q->n;
        }
    }
    for (a->rows_per_tile = imax(1, TILE_QUERIES / a->heads_per_item);; a->rows_per_tile = (a->rows_per_tile + 1) / 2) {
        items[0] = 0;
        for (int k = 0; k < a->n_seqs; k++) items[k + 1] = items[k] + seq_items(a, k, split[k] >= 0);
        if (a->rows_per_tile == 1 || items[a->n_seqs] >= 4 * threads) break;
    }
}

/* Softmax attention over the KV cache, with optional q/k norms (per head, or
 * over the whole projection), the layer's RoPE (none in a NoPE layer), value
 * norms and an output gate (Qwen3.5), in the layer's own sizes. A layer that
 * shares an earlier layer's cache projects queries only. Reads xb, leaves
 * the layer's output in xb2. */
static void attention(const FlmConfig *c, const FlmLayer *L, FlmState *s,
                      const FlmSeq *seqs, int n_seqs, int l, int T) {
    const int dim = c->dim, hd = L->head_dim, nh = c->n_heads, nkv = L->n_kv_heads;
    const int qd = nh * hd, kvd = nkv * hd, group = nh / nkv, half = L->rope_dim / 2;
    const int own_kv = L->kv_layer == l, heads = nh + (own_kv ? nkv : 0);

    MatJob jobs[4];
    int njobs = 0;
    jobs[njobs++] = (MatJob){s->q, L->wq, L->bq, qd, qd};
    if (own_kv) jobs[njobs++] = (MatJob){s->k, L->wk, L->bk, kvd, kvd};
    if (own_kv && L->wv) jobs[njobs++] = (MatJob){s->v, L->wv, L->bv, kvd, kvd};
    if (L->w_attn_gate) jobs[njobs++] = (MatJob){s->gate, L->w_attn_gate, NULL, qd, qd};
    matmul_multi(s, s->xb, T, dim, jobs, njobs, c->float_acts);
    mark(s, FLM_PHASE_QKV);

    /* q/k norms over the whole projection (OLMo 2), before the heads part. */
    const int head_norms = L->q_norm && !c->qk_norm_whole;
    if (L->q_norm && c->qk_norm_whole) {
#pragma omp for schedule(static)
        for (int i = 0; i < (own_kv ? 2 : 1) * T; i++) {
            if (i < T) rmsnorm(s->q + (size_t)i * qd, s->q + (size_t)i * qd, L->q_norm, qd, c->norm_eps);
            else rmsnorm(s->k + (size_t)(i - T) * kvd, s->k + (size_t)(i - T) * kvd, L->k_norm, kvd, c->norm_eps);
        }
    }

    /* Per-head norm and RoPE; keys and values go into the cache, position p
     * at slot p % cap. */
#pragma omp for schedule(static)
    for (int i = 0; i < T * heads; i++) {
        int t = i / heads, h = i % heads, p = s->row_pos[t];
        const int long_rope = seqs[s->row_seq[t]].state->rope_long;
        const float *cos_table = long_rope ? L->rope_cos_long : L->rope_cos;
        const float *sin_table = long_rope ? L->rope_sin_long : L->rope_sin;
        const float *cr = cos_table ? cos_table + (size_t)p * half : NULL;
        const float *sr = sin_table ? sin_table + (size_t)p * half : NULL;
        if (h < nh) {
            float *qh = s->q + (size_t)t * qd + h * hd;
            if (head_norms) rmsnorm(qh, qh, L->q_norm, hd, c->norm_eps);
            if (cr) rope(qh, cr, sr, L->rope_dim);
            if (L->q_pos_scale) {
                const float f = L->q_pos_scale[p];
                for (int j = 0; j < hd; j++) qh[j] *= f;
            }
            if (c->kv_type == FLM_Q8_0) hadamard(qh, hd, key_rotation(hd));
        } else {
            int kh = h - nh;
            float *kh_src = s->k + (size_t)t * kvd + kh * hd, *vh = s->v + (size_t)t * kvd + kh * hd;
            if (!L->wv) values_of_keys(vh, kh_src, hd, L->rope_dim);
            if (L->v_norm) rmsnorm(vh, vh, L->v_norm, hd, c->norm_eps);
            if (head_norms) rmsnorm(kh_src, kh_src, L->k_norm, hd, c->norm_eps);
            if (cr) rope(kh_src, cr, sr, L->rope_dim);
            if (c->kv_type == FLM_Q8_0) {
                hadamard(kh_src, hd, key_rotation(hd));
                hadamard(vh, hd, value_rotation(hd));
            }
            const FlmKV *kv = &seqs[s->row_seq[t]].state->kv[l];
            const size_t slot = (size_t)kh * kv->cap + (size_t)(p % kv->cap);
            kv_store_token(c, kv, slot, kh_src, vh);
        }
    }

    Attn a = {c, L, s, seqs, n_seqs, hd, qd, group, L->window, imin(group, TILE_QUERIES), 1, key_blocks(c),
              s->plan, s->plan + (s->max_batch + 1), s->plan + 2 * (s->max_batch + 1)};
    int32_t *items = s->plan, *split = s->plan + (s->max_batch + 1);
#pragma omp single
    {
        plan_attention(&a, items, split, num_threads());
        split[s->max_batch] = a.rows_per_tile;   /* past the last sequence's entry */
    }
    a.rows_per_tile = split[s->max_batch];
#pragma omp for schedule(static, 1)
    for (int g = 0; g < items[n_seqs]; g++) {
        int lo = 0, hi = n_seqs - 1;   /* the sequence whose items hold g */
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (items[mid] <= g) lo = mid;
            else hi = mid - 1;
        }
        attend_item(&a, lo, g);
    }
    /* The split sequences' partials, folded in block order. */
#pragma omp for schedule(static)
    for (int i = 0; i < T * nh; i++) {
        const int t = i / nh, h = i % nh, k = s->row_seq[t];
        if (split[k] < 0) continue;
        const int p = s->row_pos[t], r = t - a.row0[k];
        float *run = partial_at(&a, split[k], r, h, first_block(p, a.window));
        for (int b = first_block(p, a.window) + 1; b <= last_block(p); b++)
            fold(run, partial_at(&a, split[k], r, h, b), hd);
        finish(c, out_row(&a, t, h), run, hd, gate_row(&a, t, h));
    }
    mark(s, FLM_PHASE_ATTENTION);
    matmul(c, s, s->xb2, s->xb, L->wo, L->bo, T, qd, dim);
    mark(s, FLM_PHASE_OUT_PROJ);
}

static float l2_scale(const float *x, int n) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss + 1e-6f);
}

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* Gated DeltaNet: causal depthwise conv + SiLU over the q/k/v projections,
 * then per value head the delta rule on a (dk, dv) state,
 *   S = exp(g) S;  S += k (x) beta (v - S^T k);  o = S^T q,
 * and a gated RMSNorm. The recurrence runs token by token, so a prompt in
 * one call and the same tokens one at a time give identical results.
 * Rows of s->lin are [q | k | v | b | a], conv_dim + 2*Hv floats. */
static int lin_row(const FlmConfig *c) { return conv_dim(c) + 2 * c->lin_v_heads; }
/* A sequence's conv windows (K-1, conv_dim) and delta-rule states (Hv, dk, dv)
 * of layer l, in a buffer laid out as lin_state. */
static float *conv_state(const FlmConfig *c, float *lin_state, int l) { return lin_state + l * lin_state_floats(c); }
static float *delta_state(const FlmConfig *c, float *lin_state, int l) {
    return conv_state(c, lin_state, l) + (size_t)conv_dim(c) * imax(c->conv_kernel - 1, 0);
}

/* The recurrence of key head kh over rows t0 .. t0+n-1 of lin (after the
 * conv): l2-normalise q and k (q also takes the 1/sqrt(dk) scale), then
 * the delta rule of each value head that reads this key head, its output
 * at out + t*vd + h*dv; with gate, the gated RMSNorm too, silu(z) * (w *
 * norm(o)) left in z's place. */
static void recurrence(const FlmConfig *c, const FlmLayer *L, float *S0, float *lin, int t0, int n, int kh,
                       float *out, float *gate) {
    const int hk = c->lin_k_heads, hv = c->lin_v_heads, dk = c->lin_k_dim, dv = c->lin_v_dim;
    const int kd = lin_key_dim(c), vd = lin_value_dim(c), cd = conv_dim(c), ld = lin_row(c), group = hv / hk;
    /* This key head's first value head, and the stride to its next. */
    const int h0 = c->lin_v_tiled ? kh : kh * group, step = c->lin_v_tiled ? hk : 1;
    for (int t = t0; t < t0 + n; t++) {
        float *row = lin + (size_t)t * ld, *q = row + kh * dk, *k = row + kd + kh * dk;
        const float qs = l2_scale(q, dk), ks = l2_scale(k, dk), scale = 1.0f / sqrtf((float)dk);
        for (int d = 0; d < dk; d++) q[d] = (q[d] * qs) * scale;
        for (int d = 0; d < dk; d++) k[d] *= ks;
        for (int h = h0; h < h0 + group * step; h += step) {
            const float *v = row + 2 * kd + h * dv;
            float beta = sigmoid(row[cd + h]);
            float decay = expf(L->lin_A[h] * softplus(row[cd + hv + h] + L->dt_bias[h]));
            float *o = out + (size_t)t * vd + h * dv;
            flm_kernels->delta_rule(S0 + (size_t)h * dk * dv, q, k, v, beta, decay, dk, dv, o);
            if (gate) {
                float *z = gate + (size_t)t * vd + h * dv;
                rmsnorm(o, o, L->lin_norm, dv, c->norm_eps);
                flm_kernels->silu_mul(z, o, dv);
            }
        }
    }
}

/* Whether this pass keeps what flm_state_rollback needs of seq (the caller
 * asked for it, and the pass fits the buffers). */
static int keeps(const FlmSeq *seq) {
    const FlmState *st = seq->state;
    return st->keep && st->lin_saved && st->lin_keep && seq->n <= st->keep_rows;
}

/* Reads xb, leaves the layer's output in xb2. */
static void linear_attention(const FlmConfig *c, const FlmLayer *L, FlmState *s, const FlmSeq *seqs,
                             int n_seqs, int l, int T, int any_keeps) {
    const int dim = c->dim, hk = c->lin_k_heads, hv = c->lin_v_heads;
    const int dk = c->lin_k_dim, dv = c->lin_v_dim, K = c->conv_kernel;
    const int vd = lin_value_dim(c), cd = conv_dim(c);
    const int ld = lin_row(c);
    /* Sequence k's conv windows and delta-rule states in layer l; a
     * sequence at position 0 starts them afresh, in the loops that use them
     * (no pass of its own: one barrier less). A sequence that keeps for a
     * rollback saves them there too, as they were before this pass. */
#define CONV_STATE(k) conv_state(c, seqs[k].state->lin_state, l)
#define DELTA_STATE(k) delta_state(c, seqs[k].state->lin_state, l)
    MatJob jobs[4] = {{s->lin, L->w_qkv, NULL, cd, ld}, {s->gate, L->w_z, NULL, vd, vd},
                      {s->lin + cd, L->w_b, NULL, hv, ld}, {s->lin + cd + hv, L->w_a, NULL, hv, ld}};
    matmul_multi(s, s->xb, T, dim, jobs, 4, c->float_acts);
    mark(s, FLM_PHASE_QKV);

    if (any_keeps) {   /* the rows of the sequences that keep, before the conv changes them */
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const FlmSeq *q = &seqs[s->row_seq[t]];
            if (keeps(q))
                memcpy(q->state->lin_keep + ((size_t)l * q->state->keep_rows + s->row_pos[t] - q->pos) * ld,
                       s->lin + (size_t)t * ld, sizeof(float) * ld);
        }
    }

    /* Conv over the window of the last K-1 inputs (K-1 rows of cd), 16
     * channels per item, each sequence's rows (consecutive) in order. */
#pragma omp for schedule(static)
    for (int ch = 0; ch < cd; ch += 16) {
        const int n = imin(16, cd - ch);
        for (int k = 0, t0 = 0; k < n_seqs; t0 += seqs[k++].n) {
            for (int j = 0; j < K - 1 && seqs[k].pos == 0; j++)
                memset(CONV_STATE(k) + (size_t)j * cd + ch, 0, sizeof(float) * n);
            if (keeps(&seqs[k]))
                for (int j = 0; j < K - 1; j++)
                    memcpy(conv_state(c, seqs[k].state->lin_saved, l) + (size_t)j * cd + ch,
                           CONV_STATE(k) + (size_t)j * cd + ch, sizeof(float) * n);
            flm_kernels->conv_silu(s->lin + (size_t)t0 * ld + ch, ld, seqs[k].n, CONV_STATE(k) + ch, cd,
                                   L->conv_w + (size_t)ch * K, K, n);
        }
    }

    /* Per sequence and key head, token by token. */
    const int group = hv / hk;
#pragma omp for schedule(static)
    for (int i = 0; i < n_seqs * hk; i++) {
        const int k = i / hk, kh = i % hk;
        float *S0 = DELTA_STATE(k);
        const int h0 = c->lin_v_tiled ? kh : kh * group, step = c->lin_v_tiled ? hk : 1;
        for (int j = 0; j < group; j++) {
            const size_t at = (size_t)(h0 + j * step) * dk * dv;
            if (seqs[k].pos == 0) memset(S0 + at, 0, sizeof(float) * dk * dv);
            if (keeps(&seqs[k]))
                memcpy(delta_state(c, seqs[k].state->lin_saved, l) + at, S0 + at, sizeof(float) * dk * dv);
        }
        int t0 = 0;
        for (int j = 0; j < k; j++) t0 += seqs[j].n;
        recurrence(c, L, S0, s->lin, t0, seqs[k].n, kh, s->xb, s->gate);
    }
#undef CONV_STATE
#undef DELTA_STATE
    mark(s, FLM_PHASE_RECURRENCE);
    matmul(c, s, s->xb2, s->gate, L->w_out, NULL, T, vd, dim);
    mark(s, FLM_PHASE_OUT_PROJ);
}

int flm_state_rollback(const FlmConfig *c, const FlmWeights *w, FlmState *s, FlmState *work, int n,
                       int n_threads) {
    if (s->kept < 0 || n < 0 || n > s->kept || n > work->max_batch) return -1;
    if (n == s->kept) return 0;
    kernels_ensure();
    if (n_threads < 1) n_threads = 1;
    if (n_threads > work->max_threads) n_threads = work->max_threads;
    const int ld = lin_row(c), cd = conv_dim(c), K = c->conv_kernel, hk = c->lin_k_heads;
    for (int l = 0; l < c->n_layers; l++) {
        const FlmLayer *L = &w->layers[l];
        if (L->kind != FLM_LINEAR_ATTENTION) continue;
        float *conv = conv_state(c, s->lin_state, l), *S = delta_state(c, s->lin_state, l);
        memcpy(conv, conv_state(c, s->lin_saved, l), sizeof(float) * lin_state_floats(c));
        if (n == 0) continue;
        memcpy(work->lin, s->lin_keep + (size_t)l * s->keep_rows * ld, sizeof(float) * n * ld);
#pragma omp parallel num_threads(n_threads)
        {
#pragma omp for schedule(static)
            for (int ch = 0; ch < cd; ch += 16)
                flm_kernels->conv_silu(work->lin + ch, ld, n, conv + ch, cd, L->conv_w + (size_t)ch * K, K,
                                       imin(16, cd - ch));
#pragma omp for schedule(static)
            for (int kh = 0; kh < hk; kh++)
                recurrence(c, L, S, work->lin, 0, n, kh, work->xb, NULL);
        }
    }
    s->kept = n;
    return 0;
}

/* ---------------------------------------------------- mixture of experts
 *
 * Each token's router logits (fp32) go through a softmax, and the top
 * n_experts_used probabilities choose its experts (ties as torch.topk
 * breaks them: see topk.h), their weights divided by their sum with
 * norm_topk_prob. The tokens of a pass are then grouped by expert (in
 * token order within one), so each chosen expert's matrices are read once
 * per pass: one
 * product per expert over all its tokens, the work items split over
 * experts, panels and token blocks alike. Each token's output is the sum
 * of its experts' outputs times their weights in rank order (highest
 * weight first), then the shared expert's times its sigmoid gate: the
 * same bits whatever the threads, the split of a prompt or the batch. */

size_t flm_expert_bytes(int N, int K, int type) { return (flm_packed_bytes(N, K, type) + 63) / 64 * 64; }

static FlmMatrix expert_matrix(const FlmMatrix *m, int e, int N, int K) {
    FlmMatrix out = {(const char *)m->data + (size_t)e * flm_expert_bytes(N, K, m->type), m->type};
    return out;
}

/* One token's router logits p (overwritten by its probabilities) -> its
 * chosen experts and their weights, by rank. */
static void route(const FlmConfig *c, float *p, int32_t *chosen, float *weight) {
    const int E = c->n_experts, k = c->n_experts_used;
    float max = p[0], sum = 0.0f;
    for (int e = 1; e < E; e++) max = p[e] > max ? p[e] : max;
    for (int e = 0; e < E; e++) {
        p[e] = expf(p[e] - max);
        sum += p[e];
    }
    FlmRanked q[E];
    for (int e = 0; e < E; e++) {
        p[e] /= sum;
        q[e].v = p[e];
        q[e].i = e;
    }
    flm_top_k(q, E, k);
    float total = 0.0f;
    for (int r = 0; r < k; r++) {
        chosen[r] = q[r].i;
        weight[r] = q[r].v;
        total += q[r].v;
    }
    if (c->norm_topk_prob)
        for (int r = 0; r < k; r++) weight[r] /= total;
}

/* Work items of one expert's product with an (N, .) matrix over its n rows. */
static int expert_items(int n, int N, int int8) {
    if (n == 0) return 0;
    const int per = item_panels(n), panels = (N + FLM_PANEL - 1) / FLM_PANEL;
    return (panels + per - 1) / per * token_blocks(n, int8);
}

/* The expert whose items hold item g (starts ascending, E + 1 of them). */
static int expert_of_item(const int32_t *starts, int E, int g) {
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= g) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Work item g of the experts' products with (N, .) matrices: expert e,
 * nt of its rows from row (of the expert buffers), panels p0 .. p0+np-1. */
typedef struct { int e, row, nt, p0, np; } ExpertItem;

static ExpertItem expert_item(const FlmState *s, const int32_t *starts, int E, int g, int N, int int8) {
    ExpertItem it;
    it.e = expert_of_item(starts, E, g);
    const int local = g - starts[it.e], n = s->expert_row[it.e + 1] - s->expert_row[it.e];
    const int per = item_panels(n), tb = token_blocks(n, int8), panels = (N + FLM_PANEL - 1) / FLM_PANEL;
    it.p0 = local / tb * per;
    it.np = imin(per, panels - it.p0);
    const int t0 = local % tb * token_block(int8);
    it.nt = imin(token_block(int8), n - t0);
    it.row = s->expert_row[it.e] + t0;
    return it;
}

static void moe_ffn(const FlmConfig *c, const FlmLayer *L, FlmState *s, int T) {
    const int dim = c->dim, E = c->n_experts, k = c->n_experts_used, ed = c->expert_dim;
    const int R = T * k;
    int32_t *up_items = s->item_start, *down_items = s->item_start + E + 1;
    const int up_int8 = takes_int8(L->w_exp_gate, c->float_acts) && takes_int8(L->w_exp_up, c->float_acts);
    const int down_int8 = takes_int8(L->w_exp_down, c->float_acts);
    if (L->w_shexp_gate) {
        gate_up(c, s, T, L->w_shexp_gate, L->w_shexp_up, NULL, NULL, c->shared_dim);
        mark(s, FLM_PHASE_MLP_UP);
        matmul(c, s, s->xb2, s->hb, L->w_shexp_down, NULL, T, c->shared_dim, dim);
        mark(s, FLM_PHASE_MLP_DOWN);
    }
    matmul(c, s, s->router, s->xb, L->w_router, NULL, T, dim, E);
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++)
        route(c, s->router + (size_t)t * E, s->chosen + (size_t)t * k, s->chosen_w + (size_t)t * k);
#pragma omp single
    {
        int32_t *next = s->expert_row;   /* each expert's next free row, then its first */
        memset(next, 0, sizeof(int32_t) * (E + 1));
        for (int i = 0; i < R; i++) next[s->chosen[i] + 1]++;
        for (int e = 0; e < E; e++) next[e + 1] += next[e];
        for (int i = 0; i < R; i++) s->slot_row[i] = next[s->chosen[i]]++;
        for (int e = E; e > 0; e--) next[e] = next[e - 1];
        next[0] = 0;
        up_items[0] = down_items[0] = 0;
        for (int e = 0; e < E; e++) {
            const int n = s->expert_row[e + 1] - s->expert_row[e];
            up_items[e + 1] = up_items[e] + expert_items(n, ed, up_int8);
            down_items[e + 1] = down_items[e] + expert_items(n, dim, down_int8);
        }
    }
#pragma omp for schedule(static)
    for (int i = 0; i < R; i++)
        memcpy(s->moe_x + (size_t)s->slot_row[i] * dim, s->xb + (size_t)(i / k) * dim, sizeof(float) * dim);
    mark(s, FLM_PHASE_ROUTER);

    /* Gate and up, combined while in cache, expert by expert. */
    MatJob ups[2] = {{s->moe_h, L->w_exp_gate, NULL, ed, ed}, {s->moe_h2, L->w_exp_up, NULL, ed, ed}};
    const MatInput in = matmul_input(s, s->moe_x, R, dim, ups, 2, c->float_acts);
    void (*act_mul)(float *, const float *, int) = act_mul_of(c);
#pragma omp for schedule(dynamic, chunk_of(up_items[E]))
    for (int g = 0; g < up_items[E]; g++) {
        const ExpertItem it = expert_item(s, up_items, E, g, ed, up_int8);
        const FlmMatrix wg = expert_matrix(L->w_exp_gate, it.e, ed, dim);
        const FlmMatrix wu = expert_matrix(L->w_exp_up, it.e, ed, dim);
        matmul_panels(s->moe_h + (size_t)it.row * ed, ed, &in, it.row, &wg, NULL, it.nt, dim, ed, it.p0, it.np);
        matmul_panels(s->moe_h2 + (size_t)it.row * ed, ed, &in, it.row, &wu, NULL, it.nt, dim, ed, it.p0, it.np);
        const int r0 = it.p0 * FLM_PANEL, nr = imin(it.np * FLM_PANEL, ed - r0);
        for (int t = it.row; t < it.row + it.nt; t++)
            act_mul(s->moe_h + (size_t)t * ed + r0, s->moe_h2 + (size_t)t * ed + r0, nr);
    }
    mark(s, FLM_PHASE_MLP_UP);

    /* Down, into moe_x (its inputs are spent). */
    MatJob down = {s->moe_x, L->w_exp_down, NULL, dim, dim};
    const MatInput hin = matmul_input(s, s->moe_h, R, ed, &down, 1, c->float_acts);
#pragma omp for schedule(dynamic, chunk_of(down_items[E]))
    for (int g = 0; g < down_items[E]; g++) {
        const ExpertItem it = expert_item(s, down_items, E, g, dim, down_int8);
        const FlmMatrix wd = expert_matrix(L->w_exp_down, it.e, dim, ed);
        matmul_panels(s->moe_x + (size_t)it.row * dim, dim, &hin, it.row, &wd, NULL, it.nt, ed, dim, it.p0, it.np);
    }
    mark(s, FLM_PHASE_MLP_DOWN);

#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        float *out = s->xb2 + (size_t)t * dim;
        float shared = 0.0f;
        if (L->w_shexp_gate) {
            float g = 0.0f;
            const float *x = s->xb + (size_t)t * dim;
            for (int i = 0; i < dim; i++) g += x[i] * L->shexp_gate[i];
            shared = sigmoid(g);
        }
        for (int i = 0; i < dim; i++) {
            float acc = 0.0f;
            for (int r = 0; r < k; r++)
                acc += s->chosen_w[(size_t)t * k + r] * s->moe_x[(size_t)s->slot_row[(size_t)t * k + r] * dim + i];
            out[i] = L->w_shexp_gate ? acc + shared * out[i] : acc;
        }
    }
    mark(s, FLM_PHASE_ROUTER);
}

/* ---------------------------------------------------------------- forward */

/* out = RMSNorm(x) with weight, or a copy of x where the layer has no such norm. */
static void norm_or_copy(float *out, const float *x, const float *weight, int n, float eps) {
    if (weight) rmsnorm(out, x, weight, n, eps);
    else memcpy(out, x, sizeof(float) * n);
}

/* x += o (normed first where the layer norms its sublayers' outputs), scaled
 * by the residual multiplier. o is overwritten. */
static void add_residual(const FlmConfig *c, float *x, float *o, const float *post_norm) {
    if (post_norm) rmsnorm(o, o, post_norm, c->dim, c->norm_eps);
    for (int i = 0; i < c->dim; i++) x[i] += o[i] * c->residual_scale;
}

/* Part of row `token` of an embedding table of plain rows of width n:
 * count values from start (a quantized table's blocks that hold them are
 * dequantized one at a time). */
static void table_part(float *out, const FlmMatrix *table, int token, int n, int start, int count) {
    const int type = table->type;
    if (type == FLM_BF16 || type == FLM_F32 || type == FLM_F16) {
        const size_t at = (size_t)token * n + start;
        for (int i = 0; i < count; i++)
            out[i] = type == FLM_F32 ? ((const float *)table->data)[at + i]
                   : type == FLM_BF16 ? flm_bf16_to_f32(((const uint16_t *)table->data)[at + i])
                   : flm_f16_to_f32(((const uint16_t *)table->data)[at + i]);
    } else {
        const FlmQuantType *q = flm_quant_type(type);
        const int bs = q->ggml_block;
        const char *row = (const char *)table->data + (size_t)token * (n / bs) * q->ggml_bytes;
        float block[256];   /* the largest GGML block */
        for (int b = start / bs; b * bs < start + count; b++) {
            flm_quant_dequant_row(block, row + (size_t)b * q->ggml_bytes, bs, type);
            const int lo = imax(start, b * bs), hi = imin(start + count, (b + 1) * bs);
            memcpy(out + lo - start, block + lo - b * bs, sizeof(float) * (hi - lo));
        }
    }
}

/* Every row's per-layer inputs (FlmWeights.embed_per_layer) into s->ple,
 * from the scaled embeddings in s->x. */
static void per_layer_inputs(const FlmConfig *c, const FlmWeights *w, FlmState *s, const FlmSeq *seqs, int T) {
    const int P = c->per_layer_dim, n = (int)ple_floats(c);
    matmul(c, s, s->ple, s->x, w->per_layer_proj, NULL, T, c->dim, n);
    const float proj_scale = 1.0f / sqrtf((float)c->dim), embed_scale = sqrtf((float)P);
    const float mix = 1.0f / sqrtf(2.0f);
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const FlmSeq *q = &seqs[s->row_seq[t]];
        const int token = q->tokens[s->row_pos[t] - q->pos];
        float *own = s->hb + (size_t)t * hidden_buf(c);
        for (int l = 0; l < c->n_layers; l++) {
            float *slice = s->ple + (size_t)t * n + (size_t)l * P;
            for (int i = 0; i < P; i++) slice[i] *= proj_scale;
            rmsnorm(slice, slice, w->per_layer_norm, P, c->norm_eps);
            table_part(own, w->embed_per_layer, token, n, l * P, P);
            for (int i = 0; i < P; i++) slice[i] = (slice[i] + own[i] * embed_scale) * mix;
        }
    }
}

/* The layer's output multiplied by its scalar, and copied to the trace. */
static void finish_row(const FlmConfig *c, const FlmLayer *L, FlmState *s, int l, int t) {
    float *x = s->x + (size_t)t * c->dim;
    if (L->layer_scalar)
        for (int i = 0; i < c->dim; i++) x[i] *= L->layer_scalar[0];
    if (s->trace)
        memcpy(s->trace + ((size_t)l * s->trace_tokens + s->trace_offset + t) * c->dim, x, sizeof(float) * c->dim);
}

/* Gemma 4's per-layer input of layer l: x += norm(act(x @ w_ple_gate^T) *
 * ple_l) @ w_ple_proj^T), then the layer's end. */
static void per_layer_input(const FlmConfig *c, const FlmLayer *L, FlmState *s, int l, int T) {
    const int P = c->per_layer_dim, dim = c->dim;
    const size_t n = ple_floats(c);
    void (*act_mul)(float *, const float *, int) =
        c->activation == FLM_GELU_TANH ? flm_kernels->gelu_tanh_mul : flm_kernels->silu_mul;
    matmul(c, s, s->hb, s->x, L->w_ple_gate, NULL, T, dim, P);
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) act_mul(s->hb + (size_t)t * P, s->ple + (size_t)t * n + (size_t)l * P, P);
    matmul(c, s, s->xb2, s->hb, L->w_ple_proj, NULL, T, P, dim);
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        add_residual(c, s->x + (size_t)t * dim, s->xb2 + (size_t)t * dim, L->ple_norm);
        finish_row(c, L, s, l, t);
    }
}

/* The row of the work buffers of the r-th token whose logits a pass
 * gives: sequence after sequence, the last n_logits tokens of each. */
static int logit_row(const FlmSeq *seqs, int n_seqs, int r) {
    for (int k = 0, t0 = 0; k < n_seqs; t0 += seqs[k++].n) {
        if (r < seqs[k].n_logits) return t0 + seqs[k].n - seqs[k].n_logits + r;
        r -= seqs[k].n_logits;
    }
    return -1;
}

/* One pass over the weights for the tokens of n_seqs sequences, row after
 * row in s's work buffers. logits (when not NULL) gets the logits of the
 * last n_logits tokens of every sequence, in order. */
static void forward_rows(const FlmConfig *c, const FlmWeights *w, FlmState *s, const FlmSeq *seqs,
                         int n_seqs, float *logits, int n_threads) {
    const int dim = c->dim;
    int T = 0, rows = 0, any_keeps = 0, any_hidden = 0;
    for (int k = 0; k < n_seqs; k++) {
        s->plan[2 * (s->max_batch + 1) + k] = T;   /* the sequence's first row, for attention */
        for (int i = 0; i < seqs[k].n; i++, T++) {
            s->row_seq[T] = k;
            s->row_pos[T] = seqs[k].pos + i;
        }
        rows += seqs[k].n_logits;
        seqs[k].state->kept = keeps(&seqs[k]) ? seqs[k].n : -1;
        any_keeps |= keeps(&seqs[k]);
        any_hidden |= seqs[k].state->hidden != NULL;
    }

    if (s->profile) s->profile_mark = wall_time();
#pragma omp parallel num_threads(n_threads)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const FlmSeq *q = &seqs[s->row_seq[t]];
            float *x = s->x + (size_t)t * dim;
            embed_row(x, w, q->tokens[s->row_pos[t] - q->pos], dim);
            if (c->embed_scale != 1.0f)
                for (int i = 0; i < dim; i++) x[i] *= c->embed_scale;
            if (c->nextn) {
                float *joined = s->xb + (size_t)t * 2 * dim;
                rmsnorm(joined, x, w->enorm, dim, c->norm_eps);
                rmsnorm(joined + dim, q->state->nextn_h + (size_t)(s->row_pos[t] - q->pos) * dim, w->hnorm, dim,
                        c->norm_eps);
            }
        }
        if (c->nextn) matmul(c, s, s->x, s->xb, w->eh_proj, NULL, T, 2 * dim, dim);
        if (c->per_layer_dim) per_layer_inputs(c, w, s, seqs, T);

        for (int l = 0; l < c->n_layers; l++) {
            const FlmLayer *L = &w->layers[l];

#pragma omp for schedule(static)
            for (int t = 0; t < T; t++)
                norm_or_copy(s->xb + (size_t)t * dim, s->x + (size_t)t * dim, L->attn_norm, dim, c->norm_eps);
            mark(s, FLM_PHASE_NORMS);

            if (L->kind == FLM_LINEAR_ATTENTION)
                linear_attention(c, L, s, seqs, n_seqs, l, T, any_keeps);
            else
                attention(c, L, s, seqs, n_seqs, l, T);

#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *x = s->x + (size_t)t * dim;
                add_residual(c, x, s->xb2 + (size_t)t * dim, L->post_attn_norm);
                norm_or_copy(s->xb + (size_t)t * dim, x, L->ffn_norm, dim, c->norm_eps);
            }
            mark(s, FLM_PHASE_NORMS);

            if (L->w_router) {
                moe_ffn(c, L, s, T);
            } else {
                gate_up(c, s, T, L->w_gate, L->w_up, L->b_gate, L->b_up, L->hidden_dim);
                mark(s, FLM_PHASE_MLP_UP);
                matmul(c, s, s->xb2, s->hb, L->w_down, L->b_down, T, L->hidden_dim, dim);
                mark(s, FLM_PHASE_MLP_DOWN);
            }
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                add_residual(c, s->x + (size_t)t * dim, s->xb2 + (size_t)t * dim, L->post_ffn_norm);
                if (!c->per_layer_dim) finish_row(c, L, s, l, t);
            }
            if (c->per_layer_dim) per_layer_input(c, L, s, l, T);
            mark(s, FLM_PHASE_NORMS);
        }

        /* The final-normed hidden states of the sequences that want them. */
        if (any_hidden) {
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                const FlmSeq *q = &seqs[s->row_seq[t]];
                if (q->state->hidden)
                    rmsnorm(q->state->hidden + (size_t)(s->row_pos[t] - q->pos) * dim, s->x + (size_t)t * dim,
                            w->norm, dim, c->norm_eps);
            }
        }

        /* Only the tokens whose logits are wanted go through the LM head
         * (row r of xb for the r-th). */
        if (logits && rows) {
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) {
                const int t = logit_row(seqs, n_seqs, r);
                rmsnorm(s->xb + (size_t)r * dim, s->x + (size_t)t * dim, w->norm, dim, c->norm_eps);
            }
            mark(s, FLM_PHASE_NORMS);
            matmul(c, s, logits, s->xb, w->lm_head, NULL, rows, dim, c->vocab_size);
            if (c->logits_div != 1.0f) {
#pragma omp for schedule(static)
                for (int r = 0; r < rows; r++)
                    for (int i = 0; i < c->vocab_size; i++) logits[(size_t)r * c->vocab_size + i] /= c->logits_div;
            }
            if (c->logit_softcap > 0.0f) {
                /* Elementwise, in fixed chunks: the same bits however many threads. */
                const size_t total = (size_t)rows * c->vocab_size, chunk = 4096;
#pragma omp for schedule(static)
                for (size_t i = 0; i < total; i += chunk)
                    flm_kernels->softcap_max(logits + i, (int)(total - i < chunk ? total - i : chunk), c->logit_softcap);
            }
            mark(s, FLM_PHASE_LM_HEAD);
        }
    }
}

void flm_forward(const FlmConfig *c, const FlmWeights *w, FlmState *s,
                 const int32_t *tokens, int n, int pos,
                 float *logits, int all_logits, int n_threads) {
    kernels_ensure();
    if (n_threads < 1) n_threads = 1;
    if (n_threads > s->max_threads) n_threads = s->max_threads;
    float *hidden = s->hidden;
    const float *nextn_h = s->nextn_h;
    /* A pass holds at most max_batch tokens, and where a cache is a ring,
     * at most max_pass (its window before the first must survive the last). */
    const int most = flm_state_rewind_room(c, s) >= 0 && c->max_pass > 0 ? imin(s->max_batch, c->max_pass)
                                                                          : s->max_batch;
    for (int done = 0; done < n;) {
        FlmSeq seq = {s, tokens + done, imin(most, n - done), pos + done, 0};
        seq.n_logits = !logits ? 0 : all_logits ? seq.n : done + seq.n == n;
        s->trace_offset = done;
        if (hidden) s->hidden = hidden + (size_t)done * c->dim;   /* this chunk's rows */
        if (nextn_h) s->nextn_h = nextn_h + (size_t)done * c->dim;
        forward_rows(c, w, s, &seq, 1, logits ? logits + (all_logits ? (size_t)done * c->vocab_size : 0) : NULL,
                     n_threads);
        done += seq.n;
    }
    s->hidden = hidden;
    s->nextn_h = nextn_h;
}

void flm_forward_batch(const FlmConfig *c, const FlmWeights *w, FlmState *work, const FlmSeq *seqs,
                       int n_seqs, float *logits, int n_threads) {
    kernels_ensure();
    if (n_threads < 1) n_threads = 1;
    if (n_threads > work->max_threads) n_threads = work->max_threads;
    float *trace = work->trace;
    work->trace = NULL;  /* a trace follows one sequence: flm_forward's */
    forward_rows(c, w, work, seqs, n_seqs, logits, n_threads);
    work->trace = trace;
}

const char *flm_simd_path(void) {
    kernels_ensure();
    return flm_kernels->name;
}

int flm_set_simd_path(const char *name) {
    kernels_ensure();
    return flm_kernels_select(name);
}

const char *flm_int8_name(void) {
    kernels_ensure();
    return flm_kernels->int8_name;
}

/* The portable path's kernels leave prefetching to the hardware, on x86 too. */
static int path_prefetches(void) { return strcmp(flm_kernels->name, flm_kernels_generic.name) != 0; }

int flm_set_stream_prefetch(int bytes, int level) {
    kernels_ensure();
    return path_prefetches() ? flm_arch_set_stream_prefetch(bytes, level) : -1;
}

int flm_stream_prefetch(int *bytes, int *level) {
    kernels_ensure();
    return path_prefetches() ? flm_arch_stream_prefetch(bytes, level) : -1;
}
