# cython: language_level=3
"""The boundary between Python and the C run loop.

Engine keeps every weight array and the run-state buffers alive for as long
as the C side may read them, checks what C cannot check (dtypes, contiguity,
shapes, token ids, positions), and releases the GIL while C computes.
"""
from libc.stdlib cimport calloc, free
from libc.stdint cimport int32_t

import numpy as np
cimport numpy as cnp

cnp.import_array()

from fastllm.cfastllm cimport *


_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
_VECTORS = ("bq", "bk", "bv", "bo", "q_norm", "k_norm", "attn_norm", "ffn_norm",
            "b_gate", "b_up", "b_down")


def simd_path():
    """The SIMD path this CPU runs: 'avx512', 'avx2' or 'generic'."""
    return flm_simd_path().decode()


def set_simd_path(str name):
    """Force a SIMD path (for tests and benchmarks)."""
    if flm_set_simd_path(name.encode()) != 0:
        raise ValueError(f"SIMD path {name!r} is not available on this CPU")


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
    """Weights, config and run state of one model, ready for forward passes."""
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
                 int max_batch=64, int n_threads=1):
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

        keep = []
        qd, kvd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        mshapes = {"wq": (qd, c.dim), "wk": (kvd, c.dim), "wv": (kvd, c.dim), "wo": (c.dim, qd),
                   "w_gate": (c.hidden_dim, c.dim), "w_up": (c.hidden_dim, c.dim),
                   "w_down": (c.dim, c.hidden_dim)}
        vshapes = {"bq": (qd,), "bk": (kvd,), "bv": (kvd,), "bo": (c.dim,),
                   "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
                   "attn_norm": (c.dim,), "ffn_norm": (c.dim,),
                   "b_gate": (c.hidden_dim,), "b_up": (c.hidden_dim,), "b_down": (c.dim,)}
        self.layers = <FlmLayer *>calloc(c.n_layers, sizeof(FlmLayer))
        if self.layers == NULL:
            raise MemoryError()
        cdef FlmLayer *L
        for i, d in enumerate(layers):
            L = &self.layers[i]
            unknown = set(d) - set(_MATRICES) - set(_VECTORS)
            if unknown:
                raise ValueError(f"layer {i}: unknown weights {sorted(unknown)}")
            for name in ("attn_norm", "ffn_norm") + _MATRICES:
                if d.get(name) is None:
                    raise ValueError(f"layer {i}: missing weight {name}")
            L.wq = _ptr(d["wq"], wdtype, mshapes["wq"], f"layer {i} wq")
            L.wk = _ptr(d["wk"], wdtype, mshapes["wk"], f"layer {i} wk")
            L.wv = _ptr(d["wv"], wdtype, mshapes["wv"], f"layer {i} wv")
            L.wo = _ptr(d["wo"], wdtype, mshapes["wo"], f"layer {i} wo")
            L.w_gate = _ptr(d["w_gate"], wdtype, mshapes["w_gate"], f"layer {i} w_gate")
            L.w_up = _ptr(d["w_up"], wdtype, mshapes["w_up"], f"layer {i} w_up")
            L.w_down = _ptr(d["w_down"], wdtype, mshapes["w_down"], f"layer {i} w_down")
            L.attn_norm = <const float *>_ptr(d["attn_norm"], np.float32, vshapes["attn_norm"], f"layer {i} attn_norm")
            L.ffn_norm = <const float *>_ptr(d["ffn_norm"], np.float32, vshapes["ffn_norm"], f"layer {i} ffn_norm")
            L.bq = _opt(d.get("bq"), vshapes["bq"], f"layer {i} bq")
            L.bk = _opt(d.get("bk"), vshapes["bk"], f"layer {i} bk")
            L.bv = _opt(d.get("bv"), vshapes["bv"], f"layer {i} bv")
            L.bo = _opt(d.get("bo"), vshapes["bo"], f"layer {i} bo")
            L.q_norm = _opt(d.get("q_norm"), vshapes["q_norm"], f"layer {i} q_norm")
            L.k_norm = _opt(d.get("k_norm"), vshapes["k_norm"], f"layer {i} k_norm")
            L.b_gate = _opt(d.get("b_gate"), vshapes["b_gate"], f"layer {i} b_gate")
            L.b_up = _opt(d.get("b_up"), vshapes["b_up"], f"layer {i} b_up")
            L.b_down = _opt(d.get("b_down"), vshapes["b_down"], f"layer {i} b_down")
            keep.append(d)
        self.w.layers = self.layers
        self.w.embed = _ptr(embed, wdtype, (c.vocab_size, c.dim), "embedding")
        self.w.lm_head = _ptr(lm_head, wdtype, (c.vocab_size, c.dim), "lm_head")
        self.w.norm = <const float *>_ptr(norm, np.float32, (c.dim,), "final norm")
        self.w.rope_cos = <const float *>_ptr(rope_cos, np.float32, (c.seq_len, c.rope_dim // 2), "rope cos")
        self.w.rope_sin = <const float *>_ptr(rope_sin, np.float32, (c.seq_len, c.rope_dim // 2), "rope sin")
        keep += [embed, norm, lm_head, rope_cos, rope_sin]
        self._keep = keep

        # np.zeros maps fresh zero pages: the KV cache costs memory only as
        # positions are filled.
        self._work = np.zeros(flm_state_work_floats(&self.cfg, max_batch), np.float32)
        self._cache = np.zeros(flm_state_cache_floats(&self.cfg), np.float32)
        flm_state_init(&self.state, &self.cfg, max_batch,
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

    def forward(self, tokens, int pos, bint all_logits=False, bint hidden_states=False):
        """Run tokens at positions pos.. and return float32 logits:
        (vocab,) for the last token, or (n, vocab) with all_logits.
        With hidden_states, also return each layer's output, (n_layers, n, dim)."""
        cdef cnp.ndarray[int32_t, ndim=1, mode="c"] toks = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        cdef int n = toks.shape[0]
        if n == 0:
            raise ValueError("no tokens to run")
        if pos < 0 or pos + n > self.cfg.seq_len:
            raise ValueError(f"positions {pos}..{pos + n - 1} do not fit the context of "
                             f"{self.cfg.seq_len} tokens")
        lo, hi = int(toks.min()), int(toks.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary "
                             f"(0..{self.cfg.vocab_size - 1})")
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
                flm_forward(&self.cfg, &self.w, &self.state, &toks[0], n, pos,
                            &out[0, 0], all_logits, nt)
        finally:
            self.state.trace = NULL
        result = out if all_logits else out[0]
        return (result, trace) if hidden_states else result


cdef const float *_opt(object arr, tuple shape, str what) except? NULL:
    if arr is None:
        return NULL
    return <const float *>_ptr(arr, np.float32, shape, what)

