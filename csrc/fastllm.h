/* fastllm: the run loop of a Llama-style decoder in plain C.
 *
 * The core knows nothing of files, Python or JSON. The caller fills a
 * FlmConfig, points FlmWeights at weight buffers it owns, hands over one block
 * of memory for the run state, and calls flm_forward. Every buffer is
 * allocated and every input validated by the caller before C is called.
 *
 * Weight matrices are HF's (out_features, in_features) matrices, each in
 * its own storage type (FlmMatrix): fp32, bf16, f16 or one of GGML's
 * quantized block formats, packed by flm_pack into panels (gemm.h,
 * quant.h). Q and K
 * rows are expected permuted so that RoPE rotates adjacent pairs (2i, 2i+1)
 * of each head.
 */
#ifndef FASTLLM_H
#define FASTLLM_H

#include <stddef.h>
#include <stdint.h>

#include "gemm.h"   /* flm_pack */
#include "types.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { FLM_ATTENTION = 0, FLM_LINEAR_ATTENTION = 1 };
/* Keys per block of attention's online softmax (fastllm.c), fixed so that
 * a query's result does not depend on how its work is scheduled; a
 * sliding-window layer's ring holds a whole number of them. */
enum { FLM_KEY_BLOCK = 256 };
/* The MLP's gate activation: act(x @ w_gate^T) * (x @ w_up^T). */
enum { FLM_SILU = 0, FLM_GELU_TANH = 1 };

typedef struct {
    int dim;          /* hidden_size */
    int hidden_dim;   /* intermediate_size of the SwiGLU MLP */
    int n_layers;
    int n_heads;      /* query heads */
    int n_kv_heads;   /* key/value heads; n_heads % n_kv_heads == 0 (GQA) */
    int head_dim;
    int vocab_size;
    int seq_len;      /* KV cache length (n_ctx): positions 0 .. seq_len-1 */
    int rope_dim;     /* rotated dims per head, even, <= head_dim */
    int float_acts;   /* quantized weights multiply the fp32 activations (with the exact
                         dequantized weights) instead of int8 blocks of them */
    int kv_type;      /* FLM_F32, FLM_BF16 or FLM_F16: storage of the KV cache (keys and
                         values are rounded to it, nearest-even, when written) */
    int max_pass;     /* most tokens of one sequence in one pass (all its keys are written
                         before any query reads): a sliding-window layer's cache holds its
                         window - 1 + max_pass positions, in whole key blocks, as a ring,
                         where that is less than seq_len; 0: every layer holds seq_len */
    float norm_eps;   /* RMSNorm epsilon */
    float attn_scale; /* softmax scale, usually 1/sqrt(head_dim) */
    /* Gated DeltaNet (linear attention) layers, as in Qwen3.5; all 0 when
     * the model has none. Value head h reads key head h / (lin_v_heads / lin_k_heads)
     * (HF's order: heads grouped by key head), or with lin_v_tiled key head
     * h % lin_k_heads (llama.cpp's: the first head of every group, then the second ...). */
    int lin_k_heads, lin_v_heads;  /* Hk, Hv */
    int lin_k_dim, lin_v_dim;      /* dk, dv */
    int conv_kernel;               /* K of the causal depthwise conv */
    int lin_v_tiled;               /* the value heads of every linear layer's tensors are tiled */
    /* Switches of the layer (Granite's multipliers, OLMo 2's q/k norms);
     * 1, 1, 1 and 0 where a model has none. */
    float embed_scale;    /* the embeddings are multiplied by it */
    float residual_scale; /* each sublayer's output is, before the residual add */
    float logits_div;     /* the logits are divided by it */
    int qk_norm_whole;    /* q_norm and k_norm span the whole q and k projections, not one head */
    /* Gemma's switches; 0 where a model has none. */
    int activation;       /* FLM_SILU or FLM_GELU_TANH (GeLU's tanh approximation) */
    float attn_softcap;   /* > 0: attention scores (scaled) become cap * tanh(score / cap) */
    float logit_softcap;  /* > 0: the logits likewise */
    /* Mixture of experts; all 0 where a model has none. A layer with a
     * router (FlmLayer.w_router) replaces its MLP by n_experts SwiGLU
     * experts of expert_dim, n_experts_used of them per token, and a shared
     * expert of shared_dim where it has one. */
    int n_experts, n_experts_used, expert_dim, shared_dim;
    int norm_topk_prob;   /* the chosen experts' weights are divided by their sum */
    /* Gemma 4's per-layer inputs: each layer l adds to its output a gated
     * projection of a per_layer_dim slice of its own (FlmWeights.embed_per_layer
     * and per_layer_proj); 0 where a model has none. */
    int per_layer_dim;
    /* A multi-token-prediction block (Qwen3.5's MTP, DeepSeek's NextN): each
     * token's embedding, RMS-normed by enorm, is joined by the hidden state
     * it follows (FlmState.nextn_h, RMS-normed by hnorm) and projected back
     * to dim by eh_proj before the layers; 0 where a model is not one. */
    int nextn;
} FlmConfig;

typedef struct {
    int kind;             /* FLM_ATTENTION or FLM_LINEAR_ATTENTION */
    /* This layer's sizes: at most the config's, which size the buffers and
     * the cache (Gemma 4's global layers have wider heads, fewer KV heads
     * and, where they share a cache, a wider MLP). */
    int head_dim, n_kv_heads, rope_dim, hidden_dim;
    int kv_layer;         /* the layer whose keys and values it attends to: its own index, or an
                             earlier layer's (then it has no k/v projections and writes no cache) */
    int window;           /* attention: a query at position p sees the keys at
                             positions > p - window (sliding window), or with
                             0 every position up to p */
    const float *rope_cos;     /* (seq_len, rope_dim/2) this layer's RoPE, */
    const float *rope_sin;     /* or both NULL: q and k are not rotated (NoPE) */
    /* LongRoPE: its tables for a sequence longer than the original context
     * (FlmState.rope_long chooses), or NULL. */
    const float *rope_cos_long, *rope_sin_long;
    /* (seq_len) a factor of the rotated query at each position (Ministral 3's
     * scaling of far positions), or NULL: none. */
    const float *q_pos_scale;
    /* (head_dim) RMSNorm weight of each value head (Gemma 4's, all ones), or NULL */
    const float *v_norm;
    /* attention */
    const FlmMatrix *wq;       /* (n_heads*head_dim, dim)      */
    const FlmMatrix *wk;       /* (n_kv_heads*head_dim, dim)   */
    const FlmMatrix *wv;       /* (n_kv_heads*head_dim, dim), or NULL: the values are the keys
                                  as projected (in HF's order, before their norm and RoPE:
                                  Gemma 4's k_eq_v) */
    const FlmMatrix *wo;       /* (dim, n_heads*head_dim)      */
    const float *bq, *bk, *bv, *bo;   /* biases, or NULL   */
    const float *q_norm, *k_norm;     /* (head_dim) per-head RMSNorm (Qwen3), or with qk_norm_whole
                                         (n_heads*head_dim), (n_kv_heads*head_dim) over all heads; or NULL */
    const FlmMatrix *w_attn_gate;          /* (n_heads*head_dim, dim): output *= sigmoid(x @ w^T), or NULL */
    /* linear attention (Gated DeltaNet); conv_dim = 2*Hk*dk + Hv*dv */
    const FlmMatrix *w_qkv;    /* (conv_dim, dim) */
    const FlmMatrix *w_z;      /* (Hv*dv, dim) gate of the output norm */
    const FlmMatrix *w_b;      /* (Hv, dim) -> beta = sigmoid */
    const FlmMatrix *w_a;      /* (Hv, dim) -> decay */
    const float *conv_w;  /* (conv_dim, conv_kernel) */
    const float *lin_A;   /* (Hv) -exp(A_log) */
    const float *dt_bias; /* (Hv) */
    const float *lin_norm;/* (dv) gated RMSNorm weight */
    const FlmMatrix *w_out;    /* (dim, Hv*dv) */
    /* both */
    const float *attn_norm;           /* (dim) RMSNorm of the mixer's input, or NULL */
    const float *ffn_norm;            /* (dim) RMSNorm of the MLP's input, or NULL */
    const float *post_attn_norm;      /* (dim) RMSNorm of the mixer's output, or NULL */
    const float *post_ffn_norm;       /* (dim) RMSNorm of the MLP's output, or NULL */
    const FlmMatrix *w_gate;   /* (hidden_dim, dim) */
    const FlmMatrix *w_up;     /* (hidden_dim, dim) */
    const FlmMatrix *w_down;   /* (dim, hidden_dim) */
    const float *b_gate, *b_up, *b_down; /* MLP biases, or NULL */
    /* Mixture of experts, in place of w_gate, w_up and w_down (which are
     * then NULL). Each expert matrix is n_experts matrices of the same type,
     * each packed alone, expert e's at data + e * flm_expert_bytes(N, K, type). */
    const FlmMatrix *w_router;      /* (n_experts, dim): router logits */
    const FlmMatrix *w_exp_gate;    /* n_experts x (expert_dim, dim) */
    const FlmMatrix *w_exp_up;      /* n_experts x (expert_dim, dim) */
    const FlmMatrix *w_exp_down;    /* n_experts x (dim, expert_dim) */
    const FlmMatrix *w_shexp_gate;  /* (shared_dim, dim) the shared expert, or NULL */
    const FlmMatrix *w_shexp_up;    /* (shared_dim, dim) */
    const FlmMatrix *w_shexp_down;  /* (dim, shared_dim) */
    const float *shexp_gate;        /* (dim) the shared expert's output *= sigmoid(x . it), or NULL */
    /* Gemma 4: the per-layer input (per_layer_dim) gates act(x @ w_ple_gate^T),
     * projected back by w_ple_proj, normed by ple_norm and added to x. */
    const FlmMatrix *w_ple_gate;      /* (per_layer_dim, dim) */
    const FlmMatrix *w_ple_proj;      /* (dim, per_layer_dim) */
    const float *ple_norm;            /* (dim) */
    const float *layer_scalar;        /* (1) the layer's output is multiplied by it, or NULL */
} FlmLayer;

typedef struct {
    const FlmMatrix *embed;   /* (vocab_size, dim) plain rows; NULL: rows of lm_head (tied) */
    const FlmLayer *layers;   /* n_layers of them */
    const float *norm;        /* (dim) final RMSNorm */
    const FlmMatrix *lm_head; /* (vocab_size, dim), packed */
    /* Per-layer inputs (per_layer_dim > 0): token t's input to layer l is
     * (norm(x_t @ per_layer_proj^T / sqrt(dim)) + embed_per_layer[t] * sqrt(P))
     * / sqrt(2), slice l of P = per_layer_dim, x_t the scaled embedding. */
    const FlmMatrix *embed_per_layer; /* (vocab_size, n_layers*P) plain rows */
    const FlmMatrix *per_layer_proj;  /* (n_layers*P, dim), packed */
    const float *per_layer_norm;      /* (P) */
    /* nextn: */
    const FlmMatrix *eh_proj;         /* (dim, 2*dim): [enorm(embedding) | hnorm(h)] -> dim */
    const float *enorm, *hnorm;       /* (dim) */
} FlmWeights;

/* The keys and values one layer keeps (a layer that attends to an earlier
 * layer's cache has none of its own: all 0). Position p is at slot p % cap:
 * a sliding-window layer's cache is a ring of cap slots, the others hold
 * every position (cap >= seq_len). */
typedef struct {
    void *keys;       /* (n_kv_heads, cap/16, head_dim, 16): blocks of 16 keys, in kv_type */
    void *values;     /* (n_kv_heads, cap, head_dim), in kv_type */
    int cap;          /* slots: a multiple of 16, and of the key block where it is a ring */
    int window;       /* the layer's window where the cache is a ring, else 0 */
    int head_dim, n_kv_heads;
} FlmKV;

typedef struct {
    int max_batch;    /* tokens processed per pass over the weights */
    int max_threads;  /* most threads a call may use (one score row each) */
    float *x;         /* (max_batch, dim) residual stream */
    float *xb;        /* (max_batch, max(dim, q_dim)) normed input / attention output */
    float *xb2;       /* (max_batch, dim) */
    float *q;         /* (max_batch, n_heads*head_dim) */
    float *k;         /* (max_batch, n_kv_heads*head_dim) */
    float *v;         /* (max_batch, n_kv_heads*head_dim) */
    float *hb;        /* (max_batch, hidden_dim) */
    float *hb2;       /* (max_batch, hidden_dim) */
    float *att;       /* (max_threads, ...) each thread's attention scratch: the scores of a
                         tile of queries over one key block, and their partial results */
    float *part;      /* (split_rows, n_heads, key blocks of seq_len, head_dim + 2) the partial
                         results of each key block of the queries of short passes */
    int32_t *plan;    /* (3, max_batch + 1) how a layer's attention is cut into work items */
    FlmKV *kv;        /* (n_layers) each layer's keys and values, in the cache */
    float *gate;      /* (max_batch, max(q_dim, Hv*dv)) attention gate or z, in hb's memory
                         (the mixer is done with it before the MLP writes hb) */
    float *lin;       /* (max_batch, conv_dim + 2*Hv) projections of a linear layer */
    float *ple;       /* (max_batch, n_layers*per_layer_dim) the per-layer inputs */
    uint16_t *xq;     /* (max_batch, max matmul input, even) matmul input as bf16,
                         where bf16 weights take bf16 activations */
    void *xa;         /* (max_batch, max matmul input / 32) FlmQ8 blocks: the matmul
                         input quantized, where quantized weights take int8 */
    float *wide;      /* (max_threads, 16 * max matmul input) a panel of f16 or
                         quantized weights dequantized, for fp32 activations */
    float *lin_state; /* (n_layers, (K-1)*conv_dim + Hv*dk*dv) conv windows (K-1 rows
                         of conv_dim inputs, oldest first) and recurrent states of
                         the linear layers */
    /* Optional, for oracles: when not NULL, each layer's output (the
     * residual stream) of the n tokens of a flm_forward call is copied to
     * trace[(layer*trace_tokens + i) * dim], i = 0..n-1 (trace_tokens = n). */
    float *trace;
    int trace_tokens;
    /* Nonzero: this sequence's keys and queries are rotated with the
     * layers' long tables (LongRoPE; the caller sets it, and reruns the
     * tokens held when it changes). */
    int rope_long;
    int trace_offset;   /* set by flm_forward: tokens before this chunk */
    /* Set by each pass: for row t of the work buffers, the sequence it
     * belongs to and its position there. */
    int32_t *row_seq;   /* (max_batch) */
    int32_t *row_pos;   /* (max_batch) */
    /* Optional, for benchmarks: when not NULL, the wall-clock seconds of
     * each phase of every pass are added to profile[FLM_PHASE_...]. */
    double *profile;
    double profile_mark;
    /* Mixture of experts: each token's router probabilities, its chosen
     * experts (by rank) and their weights, the rows of the expert buffers
     * they go to, each expert's first row there, and the expert buffers:
     * rows grouped by expert (tokens in order within one), as inputs then
     * outputs (moe_x), and the gate and up values (moe_h, moe_h2). */
    float *router;      /* (max_batch, n_experts) */
    int32_t *chosen;    /* (max_batch, n_experts_used) */
    float *chosen_w;    /* (max_batch, n_experts_used) */
    int32_t *slot_row;  /* (max_batch, n_experts_used) */
    int32_t *expert_row;/* (n_experts + 1) */
    int32_t *item_start;/* (2, n_experts + 1) each expert's first work item in the gate/up and
                           the down products */
    float *moe_x;       /* (max_batch * n_experts_used, dim) */
    float *moe_h;       /* (max_batch * n_experts_used, expert_dim) */
    float *moe_h2;      /* (max_batch * n_experts_used, expert_dim) */
    /* Rollback of the recurrent layers (speculative decoding: a pass runs
     * drafted tokens, and only the first ones are kept). The caller owns
     * both buffers and sets keep before a pass of at most keep_rows tokens
     * of this sequence; that pass then saves the recurrent states it starts
     * from, laid out as lin_state, and its recurrent layers' inputs, so
     * that flm_state_rollback can keep any prefix of its tokens. NULL and 0
     * where unused. */
    /* Optional, per sequence: when not NULL, a pass writes the final-normed
     * hidden state of each of this sequence's tokens (what the LM head
     * multiplies) to hidden[i*dim], i counting its tokens in the pass; and
     * a nextn model reads the hidden state token i follows at nextn_h[i*dim]. */
    float *hidden;
    const float *nextn_h;
    float *lin_saved;   /* (n_layers, (K-1)*conv_dim + Hv*dk*dv) */
    float *lin_keep;    /* (n_layers, keep_rows, conv_dim + 2*Hv) */
    int keep_rows;
    int keep;
    int kept;           /* set by each pass: the tokens it kept for a rollback, or -1 */
} FlmState;

/* Phases of a forward pass, as FlmState.profile counts them. */
enum {
    FLM_PHASE_NORMS,       /* embedding, RMSNorms, residual adds */
    FLM_PHASE_QKV,         /* projections into the mixer (q/k/v and gate, or Gated DeltaNet's) */
    FLM_PHASE_ATTENTION,   /* RoPE, KV cache writes, scores, softmax, weighted sums */
    FLM_PHASE_RECURRENCE,  /* Gated DeltaNet's conv and delta rule */
    FLM_PHASE_OUT_PROJ,    /* the mixer's output projection */
    FLM_PHASE_MLP_UP,      /* gate and up projections, SiLU */
    FLM_PHASE_MLP_DOWN,
    FLM_PHASE_LM_HEAD,
    FLM_PHASE_ROUTER,      /* mixture of experts: router, top-k, grouping by expert, weighted sum */
    FLM_PHASES
};

/* Bytes from one expert's matrix (N, K), packed by flm_pack, to the
 * next's: its packed bytes rounded up to whole cache lines. */
size_t flm_expert_bytes(int N, int K, int type);

/* Floats needed by the run state's work buffers (everything but the
 * caches), and by the caches: the recurrent states, and each attention
 * layer's keys and values in its own sizes (FlmKV). */
size_t flm_state_work_floats(const FlmConfig *c, int max_batch, int max_threads);
size_t flm_state_cache_floats(const FlmConfig *c, const FlmLayer *layers);

/* Floats of FlmState.lin_saved, and of lin_keep for keep_rows rows (both 0
 * for a model without recurrent layers: it needs no rollback buffers). */
size_t flm_state_saved_floats(const FlmConfig *c);
size_t flm_state_keep_floats(const FlmConfig *c, int keep_rows);

/* Carve the state out of caller-owned memory: work must hold
 * flm_state_work_floats() floats, cache flm_state_cache_floats() floats
 * (zeroed or not: only positions already written are ever read). */
void flm_state_init(FlmState *s, const FlmConfig *c, const FlmLayer *layers, int max_batch, int max_threads,
                    float *work, float *cache);

/* Bytes of keys and values the first n positions take in s's cache (a
 * ring takes at most its slots). */
size_t flm_state_kv_bytes(const FlmConfig *c, const FlmState *s, int n);

/* How many tokens back from the furthest position it has written a state
 * can always go: the ring caches still hold the window before it (a ring
 * of cap slots and window w: cap - w + 1, at least max_pass); -1 where no
 * layer's cache is a ring. */
int flm_state_rewind_room(const FlmConfig *c, const FlmState *s);

/* The windows the ring caches hold before position pos (the keys and
 * values a query at pos reads from them), to or from buf, which holds
 * flm_state_window_floats() floats: a checkpoint, with which a sequence
 * can go back to pos after its rings have moved on. */
size_t flm_state_window_floats(const FlmConfig *c, const FlmState *s);
void flm_state_window(const FlmConfig *c, FlmState *s, int pos, float *buf, int save);

/* The keys and values of positions 0 .. n-1 in every cache that is not a
 * ring, to or from buf (save: into buf), 16-position blocks one after the
 * other by layer, head, keys then values: with flm_state_window (the
 * rings) and the recurrent states, what a sequence of n tokens holds, in
 * a form a file can keep. flm_state_prefix_bytes is buf's size; n must
 * be at most seq_len. */
size_t flm_state_prefix_bytes(const FlmConfig *c, const FlmState *s, int n);
void flm_state_prefix(const FlmConfig *c, FlmState *s, int n, void *buf, int save);

/* Where in the cache memory given to flm_state_init (byte offsets from its
 * start, and lengths) the positions from n on of every cache that is not
 * a ring lie: one range per layer, head, keys and values, at most max
 * written to ranges[2*i], ranges[2*i+1]. Returns how many there are. Those
 * bytes are written before they are read again, so a caller may give
 * their pages back to the system. */
int flm_state_tail(const FlmConfig *c, const FlmState *s, int n, size_t *ranges, int max);

/* Run n tokens at positions pos .. pos+n-1 (their keys/values are written to
 * the cache; positions < pos must hold earlier tokens). Linear layers carry
 * a state instead of a cache: pos == 0 starts it afresh, and pos > 0 must
 * continue right after the last token run. Writes the logits of
 * the last token to logits[vocab_size], or of every token to
 * logits[n*vocab_size] when all_logits is nonzero, or none with logits NULL
 * (then the LM head is skipped: a pass for FlmState.hidden alone). The caller guarantees
 * 0 <= tokens[i] < vocab_size, n >= 1 and pos + n <= seq_len. The result is
 * the same, bit for bit, for any n_threads and any split of the tokens into
 * calls. n_threads above the state's max_threads is capped. */
void flm_forward(const FlmConfig *c, const FlmWeights *w, FlmState *s,
                 const int32_t *tokens, int n, int pos,
                 float *logits, int all_logits, int n_threads);

/* Make dst hold what src holds for positions 0 .. n-1: their keys and
 * values (of a ring, the slots of the last positions before n), and where
 * n is all src has run, its recurrent states too (a recurrent state holds
 * every token it has seen: it can only be copied whole). Both states have
 * the config c and the same layers. */
void flm_state_copy(const FlmConfig *c, FlmState *dst, const FlmState *src, int n, int whole);

/* One sequence of a batched pass: its own caches (the KV cache, or the
 * recurrent state, of `state`) and n >= 1 tokens at positions pos .. pos+n-1,
 * under the same rules as flm_forward; the logits of its last n_logits
 * tokens (0 .. n) are wanted. */
typedef struct {
    FlmState *state;
    const int32_t *tokens;
    int n, pos;
    int n_logits;
} FlmSeq;

/* Run the tokens of several sequences in one pass over the weights, each
 * attending to its own cache only; logits gets the logits of the last
 * n_logits tokens of each sequence, sequence after sequence (rows of
 * vocab_size). `work` lends its work buffers (it may be one of the
 * sequences' states) and must hold all the tokens together (sum of n <=
 * work->max_batch); no state may appear twice. Every sequence's results
 * are the same, bit for bit, as when it runs alone. */
void flm_forward_batch(const FlmConfig *c, const FlmWeights *w, FlmState *work, const FlmSeq *seqs,
                       int n_seqs, float *logits, int n_threads);

/* Make s's recurrent states what they were after the first n tokens of
 * its last pass, which kept them (FlmState.keep): the saved states, then
 * those n tokens' recurrent steps again from the kept inputs (no matmul),
 * in the work buffers of work (max_batch >= n), bit for bit as a pass of
 * n tokens would have left them. Attention layers need nothing: positions
 * past n are simply written again later. Returns 0, or -1 when the last
 * pass kept nothing or fewer than n tokens. */
int flm_state_rollback(const FlmConfig *c, const FlmWeights *w, FlmState *s, FlmState *work, int n,
                       int n_threads);

/* out (T, N) = x (T, K) @ W^T, W packed by flm_pack, split over threads as
 * the run loop splits its matmuls (for benchmarks of the kernels alone), in
 * the work buffers of a state whose config has max input >= K and whose
 * max_batch >= T. */
void flm_matmul(float *out, const float *x, const FlmMatrix *w, int T, int K, int N, FlmState *s,
                int float_acts, int n_threads);

/* Name of the SIMD path chosen for this CPU ("avx512", "avx2", "generic"). */
const char *flm_simd_path(void);
/* Force a path by name (for tests); returns 0 on success, -1 if unsupported. */
int flm_set_simd_path(const char *name);
/* Name of the int8 kernels that quantized weights run on under that path
 * ("avx512_vnni", "avx2", "generic"): its table's int8_name. */
const char *flm_int8_name(void);
/* How many bytes ahead (a multiple of 64 up to 65536), into which cache
 * level (1 or 2), the kernels ask for the weights they stream; chosen for
 * the CPU at hand, set here for benchmarks (it then holds for every path).
 * Both return -1 where the CPU's kernels do not prefetch (ARM, generic)
 * or (set) the values are out of range; the results are the same bits
 * whatever they are. */
int flm_set_stream_prefetch(int bytes, int level);
int flm_stream_prefetch(int *bytes, int *level);

#ifdef __cplusplus
}
#endif
#endif
