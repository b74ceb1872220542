# Declarations of the C run loop (csrc/fastllm.h).
from libc.stdint cimport int32_t

cdef extern from "fastllm.h" nogil:
    enum:
        FLM_F32
        FLM_BF16
        FLM_F16
        FLM_Q8_0
        FLM_Q4_0
        FLM_Q4_1
        FLM_Q5_0
        FLM_Q5_1
        FLM_Q4_K
        FLM_Q5_K
        FLM_Q6_K
        FLM_TYPES
    enum:
        FLM_ATTENTION
        FLM_LINEAR_ATTENTION
    enum:
        FLM_KEY_BLOCK
    enum:
        FLM_SILU
        FLM_GELU_TANH

    ctypedef struct FlmConfig:
        int dim
        int hidden_dim
        int n_layers
        int n_heads
        int n_kv_heads
        int head_dim
        int vocab_size
        int seq_len
        int rope_dim
        int float_acts
        int kv_type
        int max_pass
        float norm_eps
        float attn_scale
        int lin_k_heads
        int lin_v_heads
        int lin_k_dim
        int lin_v_dim
        int conv_kernel
        int lin_v_tiled
        float embed_scale
        float residual_scale
        float logits_div
        int qk_norm_whole
        int activation
        float attn_softcap
        float logit_softcap
        int n_experts
        int n_experts_used
        int expert_dim
        int shared_dim
        int norm_topk_prob
        int per_layer_dim
        int nextn

    ctypedef struct FlmMatrix:
        const void *data
        int type

    # The pointer fields follow kind, the sizes, window, the RoPE tables and v_norm in the order of
    # fastllm.spec.schema.LAYER; _core sets them by index from wq on.
    ctypedef struct FlmLayer:
        int kind
        int head_dim
        int n_kv_heads
        int rope_dim
        int hidden_dim
        int kv_layer
        int window
        const float *rope_cos
        const float *rope_sin
        const float *rope_cos_long
        const float *rope_sin_long
        const float *q_pos_scale
        const float *v_norm
        const void *wq

    ctypedef struct FlmWeights:
        const FlmMatrix *embed
        const FlmLayer *layers
        const float *norm
        const FlmMatrix *lm_head
        const FlmMatrix *embed_per_layer
        const FlmMatrix *per_layer_proj
        const float *per_layer_norm
        const FlmMatrix *eh_proj
        const float *enorm
        const float *hnorm

    ctypedef struct FlmState:
        int max_batch
        float *trace
        int trace_tokens
        int trace_offset
        int rope_long
        float *lin_state
        float *hidden
        const float *nextn_h
        float *lin_saved
        float *lin_keep
        int keep_rows
        int keep
        int kept

    ctypedef struct FlmSeq:
        FlmState *state
        const int32_t *tokens
        int n
        int pos
        int n_logits

    size_t flm_packed_bytes(int N, int K, int wtype)
    size_t flm_expert_bytes(int N, int K, int wtype)
    void flm_pack(void *dst, const void *src, int N, int K, int wtype, int n_threads)
    size_t flm_state_work_floats(const FlmConfig *c, int max_batch, int max_threads)
    size_t flm_state_cache_floats(const FlmConfig *c, const FlmLayer *layers)
    size_t flm_state_saved_floats(const FlmConfig *c)
    size_t flm_state_keep_floats(const FlmConfig *c, int keep_rows)
    int flm_state_rollback(const FlmConfig *c, const FlmWeights *w, FlmState *s, FlmState *work, int n,
                           int n_threads)
    void flm_state_init(FlmState *s, const FlmConfig *c, const FlmLayer *layers, int max_batch,
                        int max_threads, float *work, float *cache)
    size_t flm_state_kv_bytes(const FlmConfig *c, const FlmState *s, int n)
    int flm_state_rewind_room(const FlmConfig *c, const FlmState *s)
    size_t flm_state_window_floats(const FlmConfig *c, const FlmState *s)
    void flm_state_window(const FlmConfig *c, FlmState *s, int pos, float *buf, int save)
    size_t flm_state_prefix_bytes(const FlmConfig *c, const FlmState *s, int n)
    void flm_state_prefix(const FlmConfig *c, FlmState *s, int n, void *buf, int save)
    int flm_state_tail(const FlmConfig *c, const FlmState *s, int n, size_t *ranges, int max)
    void flm_forward(const FlmConfig *c, const FlmWeights *w, FlmState *s,
                     const int32_t *tokens, int n, int pos,
                     float *logits, int all_logits, int n_threads)
    void flm_state_copy(const FlmConfig *c, FlmState *dst, const FlmState *src, int n, int whole)
    void flm_forward_batch(const FlmConfig *c, const FlmWeights *w, FlmState *work,
                           const FlmSeq *seqs, int n_seqs, float *logits, int n_threads)
    const char *flm_simd_path()
    const char *flm_int8_name()
    int flm_set_simd_path(const char *name)
    int flm_set_stream_prefetch(int bytes, int level)
    int flm_stream_prefetch(int *bytes, int *level)


cdef extern from "quant.h" nogil:
    ctypedef struct FlmQuantType:
        const char *name
        int sb
        int header
        int data
        int bits
        int offset
        int ggml_block
        int ggml_bytes
    const FlmQuantType *flm_quant_type(int type)
    int flm_is_quantized(int type)
    int flm_finite(const void *data, size_t n, int type, int n_threads)
    void flm_quant_dequant_row(float *out, const void *row, int K, int type)

cdef extern from "gemm.h" nogil:
    enum:
        FLM_PANEL
        FLM_PACK_LAYOUT
    void flm_packed_row(float *out, const void *wp, int r, int K, int wtype)

cdef extern from "checksum.h" nogil:
    unsigned long long flm_checksum(const void *data, size_t n, int n_threads)
