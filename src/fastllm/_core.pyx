# cython: language_level=3
"""The boundary between Python and the C run loop.

Weights holds a model's arrays for as long as C may read them and checks
what C cannot (dtypes, contiguity, shapes, from fastllm.schema); a State is
one sequence's run buffers (KV cache, recurrent state) over shared Weights.
Token ids are checked once, by check_token_ids (fastllm.Session calls it);
State.run checks positions and releases the GIL while C computes.
"""
from libc.stdlib cimport calloc, free
from libc.stdint cimport int32_t

import os

import numpy as np
cimport numpy as cnp

cnp.import_array()

from fastllm cimport cfastllm as flm
from fastllm import schema

# FlmLayer is kind, then one pointer per schema.LAYER tensor, in that order.
cdef flm.FlmLayer _probe
cdef size_t _FIRST = <size_t>(<char *>&_probe.wq - <char *>&_probe)
if (sizeof(flm.FlmLayer) - _FIRST) // sizeof(void *) != len(schema.LAYER):
    raise ImportError("FlmLayer in fastllm.h and fastllm.schema.LAYER list different tensors")
_FIELD_INDEX = {t.field: i for i, t in enumerate(schema.LAYER)}


cdef int _set_field(flm.FlmLayer *L, str name, const void *p) except -1:
    """Fill the FlmLayer field of that name (a schema.LAYER field)."""
    (<const void **>&L.wq)[<int>_FIELD_INDEX[name]] = p
    return 0


def _path_from_environment():
    name = os.environ.get("FASTLLM_SIMD")
    if name and flm.flm_set_simd_path(name.encode()) != 0:
        raise ImportError(f"FASTLLM_SIMD={name!r}: no such SIMD path on this CPU "
                          "(generic, avx2, avx512, avx512_bf16, amx_bf16)")


def simd_path():
    """The SIMD path this CPU runs: 'avx512', 'avx2' or 'generic'."""
    return flm.flm_simd_path().decode()


def set_simd_path(str name):
    """Force a SIMD path (for tests and benchmarks)."""
    if flm.flm_set_simd_path(name.encode()) != 0:
        raise ValueError(f"SIMD path {name!r} is not available on this CPU")


def packed_size(int N, int K, wtype):
    """Elements of an (N, K) matrix packed for the run loop."""
    bf16 = np.dtype(wtype) == np.uint16
    return flm.flm_packed_bytes(N, K, flm.FLM_BF16 if bf16 else flm.FLM_F32) // (2 if bf16 else 4)


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
    cdef int wtype = flm.FLM_BF16 if src.dtype == np.uint16 else flm.FLM_F32
    cdef cnp.ndarray dst = np.empty(packed_size(N, K, src.dtype), src.dtype)
    cdef int nt = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    cdef void *d = cnp.PyArray_DATA(dst)
    cdef const void *sp = cnp.PyArray_DATA(src)
    with nogil:
        flm.flm_pack(d, sp, N, K, wtype, nt)
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


cdef class Weights:
    """A model's weights and config, ready for forward passes, shared by
    every State made from it. config is a ModelConfig (already checked);
    weights the dict of weights.load_weights: matrices packed (see pack) in
    float32 or bf16 bits (uint16, as lm_head), vectors in float32. The
    context holds n_ctx positions."""
    cdef flm.FlmConfig cfg
    cdef flm.FlmWeights w
    cdef flm.FlmLayer *layers
    cdef readonly object config
    cdef object _keep
    cdef int _n_threads

    def __cinit__(self, config, dict weights, int n_ctx, int n_threads=1, str kv_dtype="f32"):
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        wdtype = np.dtype(weights["lm_head"].dtype)
        if wdtype not in (np.float32, np.uint16):
            raise TypeError(f"weights must be float32 or bf16 (uint16 bits), not {wdtype}")
        layers = weights["layers"]
        if len(layers) != config.num_hidden_layers:
            raise ValueError(f"expected {config.num_hidden_layers} layers, got {len(layers)}")
        self.config = config
        self.n_threads = n_threads
        cdef flm.FlmConfig *c = &self.cfg
        c.dim, c.hidden_dim = config.hidden_size, config.intermediate_size
        c.n_layers, c.n_heads = config.num_hidden_layers, config.num_attention_heads
        c.n_kv_heads, c.head_dim = config.num_key_value_heads, config.head_dim
        c.vocab_size, c.seq_len, c.rope_dim = config.vocab_size, n_ctx, config.rope_dim
        c.wtype = flm.FLM_BF16 if wdtype == np.uint16 else flm.FLM_F32
        kv_types = {"f32": flm.FLM_F32, "bf16": flm.FLM_BF16, "f16": flm.FLM_F16}
        if kv_dtype not in kv_types:
            raise ValueError(f"kv_dtype must be one of {tuple(kv_types)}, got {kv_dtype!r}")
        c.kv_type = kv_types[kv_dtype]
        c.norm_eps, c.attn_scale = config.rms_norm_eps, config.head_dim ** -0.5
        c.lin_k_heads, c.lin_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        c.lin_k_dim, c.lin_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        c.conv_kernel = config.linear_conv_kernel_dim

        self.layers = <flm.FlmLayer *>calloc(c.n_layers, sizeof(flm.FlmLayer))
        if self.layers == NULL:
            raise MemoryError()
        for i, d in enumerate(layers):
            kind = d.get("kind", schema.ATTENTION)
            if kind not in (schema.ATTENTION, schema.LINEAR):
                raise ValueError(f"layer {i}: unknown kind {kind!r}")
            self.layers[i].kind = flm.FLM_LINEAR_ATTENTION if kind == schema.LINEAR else flm.FLM_ATTENTION
            expected = {t.field: t for t in schema.layer_tensors(config, kind)}
            missing, unknown = sorted(expected.keys() - d.keys()), sorted(d.keys() - expected.keys() - {"kind"})
            if missing or unknown:
                raise ValueError(f"layer {i}: " + "; ".join(
                    f"{what} weights {names}" for what, names in (("missing", missing), ("unknown", unknown))
                    if names))
            for name, t in expected.items():
                _set_field(&self.layers[i], name, _array_ptr(d[name], t, config, wdtype, f"layer {i} {name}"))
        self.w.layers = self.layers
        # embed None: tied, the rows are read from the packed head.
        embed = weights["embed"]
        self.w.embed = NULL if embed is None else _array_ptr(embed, schema.EMBED, config, wdtype, "embedding")
        self.w.lm_head = _array_ptr(weights["lm_head"], schema.LM_HEAD, config, wdtype, "lm_head")
        self.w.norm = <const float *>_array_ptr(weights["norm"], schema.NORM, config, wdtype, "final norm")
        cos, sin = config.rope_tables(n_ctx)
        self.w.rope_cos = <const float *>_ptr(cos, np.float32, (n_ctx, c.rope_dim // 2), "rope cos")
        self.w.rope_sin = <const float *>_ptr(sin, np.float32, (n_ctx, c.rope_dim // 2), "rope sin")
        # Copies of the containers: the arrays stay alive whatever the caller
        # later does with its dict and lists.
        self._keep = (dict(weights, layers=[dict(d) for d in layers]), cos, sin)

    def __dealloc__(self):
        free(self.layers)

    @property
    def n_threads(self):
        """Threads a forward pass uses (at most a State's max_threads)."""
        return self._n_threads

    @n_threads.setter
    def n_threads(self, int n):
        if n < 1:
            raise ValueError(f"threads must be positive, got {n}")
        self._n_threads = n

    @property
    def seq_len(self):
        return self.cfg.seq_len

    @property
    def kv_dtype(self):
        """Storage of the KV cache: "f32", "bf16" or "f16"."""
        return {flm.FLM_F32: "f32", flm.FLM_BF16: "bf16", flm.FLM_F16: "f16"}[self.cfg.kv_type]

    @property
    def vocab_size(self):
        return self.cfg.vocab_size


cdef const void *_array_ptr(object arr, object t, object config, object wdtype, str what) except NULL:
    """The data of a schema tensor's array, once its dtype and shape are right."""
    shape = t.shape(config)
    if t is schema.EMBED:
        return _ptr(arr, wdtype, shape, what)
    if t.matrix:
        return _packed_ptr(arr, wdtype, shape, what)
    return _ptr(arr, np.float32, shape, what)


cdef class State:
    """The run state of one sequence over shared Weights: work buffers, the
    KV cache and the recurrent state of linear layers. A State serves one
    thread at a time; fastllm.Session keeps track of what it holds."""
    cdef flm.FlmState s
    cdef readonly Weights weights
    cdef cnp.ndarray _work
    cdef cnp.ndarray _cache

    def __cinit__(self, Weights weights, int max_batch=512, int max_threads=0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.weights = weights
        # One attention score row per thread that may ever run. np.zeros maps
        # fresh zero pages: the KV cache costs memory only as it fills.
        max_threads = max(max_threads, weights._n_threads, os.cpu_count() or 1)
        self._work = np.zeros(flm.flm_state_work_floats(&weights.cfg, max_batch, max_threads), np.float32)
        self._cache = np.zeros(flm.flm_state_cache_floats(&weights.cfg), np.float32)
        flm.flm_state_init(&self.s, &weights.cfg, max_batch, max_threads,
                           <float *>cnp.PyArray_DATA(self._work), <float *>cnp.PyArray_DATA(self._cache))

    def copy_from(self, State other, int n, bint whole):
        """Hold what other holds for its first n positions (with whole, its
        recurrent states too: then n must be all it has run)."""
        if other.weights is not self.weights:
            raise ValueError("states of different weights")
        if not 0 <= n <= self.weights.cfg.seq_len:
            raise ValueError(f"cannot copy {n} positions")
        flm.flm_state_copy(&self.weights.cfg, &self.s, &other.s, n, whole)

    def run(self, const int32_t[::1] tokens, int pos, bint all_logits=False, bint hidden_states=False):
        """Run tokens (ids checked by check_token_ids) at positions pos.. and
        return float32 logits: (vocab,) for the last token, or (n, vocab)
        with all_logits. With hidden_states, also each layer's output,
        (n_layers, n, dim). Linear layers start afresh at pos 0 and must
        otherwise continue right after the last token run."""
        cdef Weights w = self.weights
        cdef int n = tokens.shape[0]
        if n < 1 or pos < 0 or pos > w.cfg.seq_len - n:
            raise ValueError(f"positions {pos}..{pos + n - 1} do not fit the context of "
                             f"{w.cfg.seq_len} tokens")
        cdef cnp.ndarray[float, ndim=2, mode="c"] out = np.empty(
            (n if all_logits else 1, w.cfg.vocab_size), np.float32)
        cdef int nt = w._n_threads
        cdef cnp.ndarray trace = None
        if hidden_states:
            trace = np.empty((w.cfg.n_layers, n, w.cfg.dim), np.float32)
            self.s.trace = <float *>cnp.PyArray_DATA(trace)
            self.s.trace_tokens = n
        try:
            with nogil:
                flm.flm_forward(&w.cfg, &w.w, &self.s, &tokens[0], n, pos, &out[0, 0], all_logits, nt)
        finally:
            self.s.trace = NULL
        result = out if all_logits else out[0]
        return (result, trace) if hidden_states else result


def run_batch(list states, list tokens, list positions, State work=None):
    """Run tokens[k] (int32 arrays, ids checked) at positions[k].. of
    states[k], all in one pass over the shared weights, in the work buffers
    of work (default: states[0]); returns the float32 logits of each
    sequence's last token, (len(states), vocab). Each sequence's results are
    exactly those of State.run alone."""
    cdef int n = len(states)
    if n < 1 or len(tokens) != n or len(positions) != n:
        raise ValueError("run_batch takes one token array and one position per state")
    cdef State first = states[0] if work is None else work
    cdef Weights w = first.weights
    if len({id(s) for s in states}) != n:
        raise ValueError("a state appears twice in one batch")
    cdef flm.FlmSeq *seqs = <flm.FlmSeq *>calloc(n, sizeof(flm.FlmSeq))
    if seqs == NULL:
        raise MemoryError()
    cdef State st
    cdef const int32_t[::1] ids
    cdef long long total = 0, pos
    cdef cnp.ndarray[float, ndim=2, mode="c"] out = np.empty((n, w.cfg.vocab_size), np.float32)
    keep = []
    try:
        for k in range(n):
            st = states[k]
            if st.weights is not w:
                raise ValueError("the states of one batch must share their weights")
            ids = tokens[k]
            pos = positions[k]
            if ids.shape[0] < 1 or pos < 0 or pos + ids.shape[0] > w.cfg.seq_len:
                raise ValueError(f"positions {pos}..{pos + ids.shape[0] - 1} do not fit the context "
                                 f"of {w.cfg.seq_len} tokens")
            total += ids.shape[0]
            keep.append(tokens[k])
            seqs[k].state = &st.s
            seqs[k].tokens = &ids[0]
            seqs[k].n = ids.shape[0]
            seqs[k].pos = <int>pos
        if total > first.s.max_batch:
            raise ValueError(f"{total} tokens in one batch: more than the {first.s.max_batch} "
                             "the work buffers hold")
        with nogil:
            flm.flm_forward_batch(&w.cfg, &w.w, &first.s, seqs, n, &out[0, 0], w._n_threads)
    finally:
        free(seqs)
    return out


_path_from_environment()
flm.flm_simd_path()   # pick the kernels now, before threads may race to
