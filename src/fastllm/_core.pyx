# cython: language_level=3
"""The boundary between Python and the C run loop.

Engine keeps every weight array and the run-state buffers alive for as long
as the C side may read them, checks what C cannot check (dtypes, contiguity,
shapes, token ids, positions), and releases the GIL while C computes.
"""
from libc.stdlib cimport calloc, free
from libc.stdint cimport int32_t

import os

import numpy as np
cimport numpy as cnp

cnp.import_array()

from fastllm.cfastllm cimport *


# Per-layer tensors: name -> (is a weight matrix in wtype, shape from the config).
# Matrices come in the weight dtype, everything else in float32.
def _layer_shapes(c):
    qd, kvd = c["n_heads"] * c["head_dim"], c["n_kv_heads"] * c["head_dim"]
    kd = c.get("lin_k_heads", 0) * c.get("lin_k_dim", 0)
    vd = c.get("lin_v_heads", 0) * c.get("lin_v_dim", 0)
    hv, dim, hid = c.get("lin_v_heads", 0), c["dim"], c["hidden_dim"]
    return {
        "attn_norm": (False, (dim,)), "ffn_norm": (False, (dim,)),
        "w_gate": (True, (hid, dim)), "w_up": (True, (hid, dim)), "w_down": (True, (dim, hid)),
        "b_gate": (False, (hid,)), "b_up": (False, (hid,)), "b_down": (False, (dim,)),
        "wq": (True, (qd, dim)), "wk": (True, (kvd, dim)), "wv": (True, (kvd, dim)),
        "wo": (True, (dim, qd)), "bq": (False, (qd,)), "bk": (False, (kvd,)),
        "bv": (False, (kvd,)), "bo": (False, (dim,)),
        "q_norm": (False, (c["head_dim"],)), "k_norm": (False, (c["head_dim"],)),
        "w_attn_gate": (True, (qd, dim)),
        "w_qkv": (True, (2 * kd + vd, dim)), "w_z": (True, (vd, dim)), "w_b": (True, (hv, dim)),
        "w_a": (True, (hv, dim)), "conv_w": (False, (2 * kd + vd, c.get("conv_kernel", 0))),
        "lin_A": (False, (hv,)), "dt_bias": (False, (hv,)), "lin_norm": (False, (c.get("lin_v_dim", 0),)),
        "w_out": (True, (dim, vd)),
    }

_REQUIRED = {
    "attention": ("attn_norm", "ffn_norm", "w_gate", "w_up", "w_down", "wq", "wk", "wv", "wo"),
    "linear_attention": ("attn_norm", "ffn_norm", "w_gate", "w_up", "w_down", "w_qkv", "w_z",
                         "w_b", "w_a", "conv_w", "lin_A", "dt_bias", "lin_norm", "w_out"),
}


def _path_from_environment():
    name = os.environ.get("FASTLLM_SIMD")
    if name and flm_set_simd_path(name.encode()) != 0:
        raise ImportError(f"FASTLLM_SIMD={name!r}: no such SIMD path on this CPU "
                          "(generic, avx2, avx512, avx512_bf16, amx_bf16)")


def simd_path():
    """The SIMD path this CPU runs: 'avx512', 'avx2' or 'generic'."""
    return flm_simd_path().decode()


def set_simd_path(str name):
    """Force a SIMD path (for tests and benchmarks)."""
    if flm_set_simd_path(name.encode()) != 0:
        raise ValueError(f"SIMD path {name!r} is not available on this CPU")


def packed_size(int N, int K, wtype):
    """Elements of an (N, K) matrix packed for the run loop."""
    bf16 = np.dtype(wtype) == np.uint16
    return flm_packed_bytes(N, K, FLM_BF16 if bf16 else FLM_F32) // (2 if bf16 else 4)


def check_token_ids(tokens, long long vocab_size):
    """tokens as a contiguous int32 array, once every id is known to lie in
    0..vocab_size-1. Ids are checked as the caller's own integers, before
    anything narrows them to int32 (where 2**32 + 5 would become 5); a list
    is read as Python integers, which numpy would turn into floats past 2**63."""
    ids = tokens if isinstance(tokens, np.ndarray) else np.array(tokens, dtype=object)
    if ids.dtype == object:
        integers = all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids.flat)
    else:
        integers = np.issubdtype(ids.dtype, np.integer)
    if ids.ndim != 1 or ids.size == 0 or not integers:
        raise ValueError("token ids must be a non-empty 1-D sequence of integers")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                         f"(0..{vocab_size - 1})")
    return np.ascontiguousarray(ids, dtype=np.int32)


def pack(matrix, int n_threads=0):
    """Pack an (N, K) float32 matrix, or bf16 bit patterns as uint16, into
    the panel layout the run loop reads: a new 1-D array of the same dtype."""
    cdef cnp.ndarray src = np.ascontiguousarray(matrix)
    if src.ndim != 2 or src.dtype not in (np.float32, np.uint16):
        raise TypeError("pack takes a 2-D float32 or uint16 (bf16) matrix")
    cdef int N = src.shape[0], K = src.shape[1]
    cdef int wtype = FLM_BF16 if src.dtype == np.uint16 else FLM_F32
    cdef cnp.ndarray dst = np.empty(packed_size(N, K, src.dtype), src.dtype)
    cdef int nt = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    cdef void *d = cnp.PyArray_DATA(dst)
    cdef const void *sp = cnp.PyArray_DATA(src)
    with nogil:
        flm_pack(d, sp, N, K, wtype, nt)
    return dst


cdef const void *_packed_ptr(object arr, object dtype, tuple shape, str what) except NULL:
    return _ptr(arr, dtype, (packed_size(shape[0], shape[1], dtype),), what)


cdef const void *_ptr(object arr, object dtype, tuple shape, str what) except NULL:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise TypeError(f"{what}: expected dtype {np.dtype(dtype)}, got {arr.dtype}")
    if arr.shape != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous")
    return cnp.PyArray_DATA(<cnp.ndarray>arr)


cdef class Engine:
    """Weights, config and run state of one model, ready for forward passes.
    Matrices come packed (see pack); norms, biases and tables as float32."""
    cdef FlmConfig cfg
    cdef FlmWeights w
    cdef FlmLayer *layers
    cdef FlmState state
    cdef object _keep
    cdef cnp.ndarray _work
    cdef cnp.ndarray _cache
    cdef public int n_threads

    def __cinit__(self):
        self.layers = NULL

    def __init__(self, dict config, list layers, embed, norm, lm_head, rope_cos, rope_sin,
                 int max_batch=512, int n_threads=1, int max_threads=0):
        cdef FlmConfig c
        c.dim = config["dim"]
        c.hidden_dim = config["hidden_dim"]
        c.n_layers = config["n_layers"]
        c.n_heads = config["n_heads"]
        c.n_kv_heads = config["n_kv_heads"]
        c.head_dim = config["head_dim"]
        c.vocab_size = config["vocab_size"]
        c.seq_len = config["seq_len"]
        c.rope_dim = config["rope_dim"]
        c.norm_eps = config["norm_eps"]
        c.attn_scale = config["attn_scale"]
        c.lin_k_heads = config.get("lin_k_heads", 0)
        c.lin_v_heads = config.get("lin_v_heads", 0)
        c.lin_k_dim = config.get("lin_k_dim", 0)
        c.lin_v_dim = config.get("lin_v_dim", 0)
        c.conv_kernel = config.get("conv_kernel", 0)
        c.kv_type = {"f32": FLM_F32, "bf16": FLM_BF16, "f16": FLM_F16}[config.get("kv_dtype", "f32")]
        wdtype = np.dtype(config["wtype"])
        if wdtype == np.float32:
            c.wtype = FLM_F32
        elif wdtype == np.uint16:
            c.wtype = FLM_BF16
        else:
            raise TypeError(f"weights must be float32 or bf16 (uint16 bits), not {wdtype}")
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "vocab_size", "seq_len", "rope_dim"):
            if config[name] <= 0:
                raise ValueError(f"config {name} must be positive")
        if c.n_heads % c.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if c.rope_dim % 2 or c.rope_dim > c.head_dim:
            raise ValueError("rope_dim must be even and at most head_dim")
        if len(layers) != c.n_layers:
            raise ValueError(f"expected {c.n_layers} layers, got {len(layers)}")
        if max_batch < 1:
            raise ValueError("max_batch must be positive")
        self.cfg = c

        kinds = {d.get("kind", "attention") for d in layers}
        if "linear_attention" in kinds:
            if min(c.lin_k_heads, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim, c.conv_kernel) <= 0:
                raise ValueError("linear attention layers need lin_k_heads, lin_v_heads, "
                                 "lin_k_dim, lin_v_dim and conv_kernel")
            if c.lin_v_heads % c.lin_k_heads:
                raise ValueError("lin_v_heads must be a multiple of lin_k_heads")
        shapes = _layer_shapes(config)
        keep = []
        self.layers = <FlmLayer *>calloc(c.n_layers, sizeof(FlmLayer))
        if self.layers == NULL:
            raise MemoryError()
        cdef FlmLayer *L
        for i, d in enumerate(layers):
            L = &self.layers[i]
            kind = d.get("kind", "attention")
            if kind not in _REQUIRED:
                raise ValueError(f"layer {i}: unknown kind {kind!r}")
            L.kind = FLM_LINEAR_ATTENTION if kind == "linear_attention" else FLM_ATTENTION
            arrays = {k: v for k, v in d.items() if k != "kind" and v is not None}
            unknown = set(arrays) - set(shapes)
            if unknown:
                raise ValueError(f"layer {i}: unknown weights {sorted(unknown)}")
            missing = [n for n in _REQUIRED[kind] if n not in arrays]
            if missing:
                raise ValueError(f"layer {i}: missing weights {missing}")
            ptrs = {}
            for name, arr in arrays.items():
                is_matrix, shape = shapes[name]
                if is_matrix:
                    ptrs[name] = <size_t>_packed_ptr(arr, wdtype, shape, f"layer {i} {name}")
                else:
                    ptrs[name] = <size_t>_ptr(arr, np.float32, shape, f"layer {i} {name}")
            L.wq = <const void *><size_t>ptrs.get("wq", 0)
            L.wk = <const void *><size_t>ptrs.get("wk", 0)
            L.wv = <const void *><size_t>ptrs.get("wv", 0)
            L.wo = <const void *><size_t>ptrs.get("wo", 0)
            L.bq = <const float *><size_t>ptrs.get("bq", 0)
            L.bk = <const float *><size_t>ptrs.get("bk", 0)
            L.bv = <const float *><size_t>ptrs.get("bv", 0)
            L.bo = <const float *><size_t>ptrs.get("bo", 0)
            L.q_norm = <const float *><size_t>ptrs.get("q_norm", 0)
            L.k_norm = <const float *><size_t>ptrs.get("k_norm", 0)
            L.w_attn_gate = <const void *><size_t>ptrs.get("w_attn_gate", 0)
            L.w_qkv = <const void *><size_t>ptrs.get("w_qkv", 0)
            L.w_z = <const void *><size_t>ptrs.get("w_z", 0)
            L.w_b = <const void *><size_t>ptrs.get("w_b", 0)
            L.w_a = <const void *><size_t>ptrs.get("w_a", 0)
            L.conv_w = <const float *><size_t>ptrs.get("conv_w", 0)
            L.lin_A = <const float *><size_t>ptrs.get("lin_A", 0)
            L.dt_bias = <const float *><size_t>ptrs.get("dt_bias", 0)
            L.lin_norm = <const float *><size_t>ptrs.get("lin_norm", 0)
            L.w_out = <const void *><size_t>ptrs.get("w_out", 0)
            L.attn_norm = <const float *><size_t>ptrs["attn_norm"]
            L.ffn_norm = <const float *><size_t>ptrs["ffn_norm"]
            L.w_gate = <const void *><size_t>ptrs["w_gate"]
            L.w_up = <const void *><size_t>ptrs["w_up"]
            L.w_down = <const void *><size_t>ptrs["w_down"]
            L.b_gate = <const float *><size_t>ptrs.get("b_gate", 0)
            L.b_up = <const float *><size_t>ptrs.get("b_up", 0)
            L.b_down = <const float *><size_t>ptrs.get("b_down", 0)
            keep.append(arrays)
        self.w.layers = self.layers
        # embed None: tied, the rows are read from the packed head.
        self.w.embed = NULL if embed is None else _ptr(embed, wdtype, (c.vocab_size, c.dim), "embedding")
        self.w.lm_head = _packed_ptr(lm_head, wdtype, (c.vocab_size, c.dim), "lm_head")
        self.w.norm = <const float *>_ptr(norm, np.float32, (c.dim,), "final norm")
        self.w.rope_cos = <const float *>_ptr(rope_cos, np.float32, (c.seq_len, c.rope_dim // 2), "rope cos")
        self.w.rope_sin = <const float *>_ptr(rope_sin, np.float32, (c.seq_len, c.rope_dim // 2), "rope sin")
        keep += [embed, norm, lm_head, rope_cos, rope_sin]
        self._keep = keep

        # np.zeros maps fresh zero pages: the KV cache costs memory only as
        # positions are filled.
        # One attention score row per thread that may ever run.
        max_threads = max(max_threads, n_threads, os.cpu_count() or 1)
        self._work = np.zeros(flm_state_work_floats(&self.cfg, max_batch, max_threads), np.float32)
        self._cache = np.zeros(flm_state_cache_floats(&self.cfg), np.float32)
        flm_state_init(&self.state, &self.cfg, max_batch, max_threads,
                       <float *>cnp.PyArray_DATA(self._work), <float *>cnp.PyArray_DATA(self._cache))
        self.n_threads = n_threads

    def __dealloc__(self):
        free(self.layers)

    @property
    def seq_len(self):
        return self.cfg.seq_len

    @property
    def vocab_size(self):
        return self.cfg.vocab_size

    def forward(self, tokens, pos, bint all_logits=False, bint hidden_states=False):
        """Run tokens at positions pos.. and return float32 logits:
        (vocab,) for the last token, or (n, vocab) with all_logits.
        With hidden_states, also return each layer's output, (n_layers, n, dim)."""
        ids = check_token_ids(tokens, self.cfg.vocab_size)
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)):
            raise TypeError(f"pos must be an integer, got {type(pos).__name__}")
        first = int(pos)
        cdef int n = ids.shape[0]
        if first < 0 or first + n > self.cfg.seq_len:
            raise ValueError(f"positions {first}..{first + n - 1} do not fit the context of "
                             f"{self.cfg.seq_len} tokens")
        cdef cnp.ndarray[int32_t, ndim=1, mode="c"] toks = ids
        cdef int start = first
        cdef cnp.ndarray[float, ndim=2, mode="c"] out = np.empty(
            (n if all_logits else 1, self.cfg.vocab_size), np.float32)
        cdef int nt = max(1, self.n_threads)
        cdef cnp.ndarray trace = None
        if hidden_states:
            trace = np.empty((self.cfg.n_layers, n, self.cfg.dim), np.float32)
            self.state.trace = <float *>cnp.PyArray_DATA(trace)
            self.state.trace_tokens = n
        try:
            with nogil:
                flm_forward(&self.cfg, &self.w, &self.state, &toks[0], n, start,
                            &out[0, 0], all_logits, nt)
        finally:
            self.state.trace = NULL
        result = out if all_logits else out[0]
        return (result, trace) if hidden_states else result


_path_from_environment()
