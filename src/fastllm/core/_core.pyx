# cython: language_level=3
"""The boundary between Python and the C run loop.

Weights holds a model's arrays for as long as C may read them and checks
what C cannot (dtypes, contiguity, shapes, from fastllm.spec.schema); a State is
one sequence's run buffers (KV cache, recurrent state) over shared Weights.
Token ids are checked once, by check_token_ids (fastllm.Session calls it);
State.run checks positions and releases the GIL while C computes.
"""
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy
from libc.stdint cimport int32_t
from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock, PyThread_acquire_lock,
                               PyThread_release_lock, WAIT_LOCK)

cdef extern from "pythread.h":
    # An OS thread that runs a C function, whatever threading may have been
    # monkey-patched into (gevent's greenlets would never run a C loop).
    unsigned long PyThread_start_new_thread(void (*)(void *) noexcept nogil, void *)
    unsigned long PYTHREAD_INVALID_THREAD_ID

import mmap
import os
import threading

import numpy as np
cimport numpy as cnp

cnp.import_array()

from fastllm.core cimport cfastllm as flm
from fastllm.spec import schema

# FlmLayer is kind, sizes, window, the RoPE tables and v_norm, then one pointer per schema.LAYER tensor, in
# that order.
cdef flm.FlmLayer _probe
cdef size_t _FIRST = <size_t>(<char *>&_probe.wq - <char *>&_probe)
if (sizeof(flm.FlmLayer) - _FIRST) // sizeof(void *) != len(schema.LAYER):
    raise ImportError("FlmLayer in fastllm.h and fastllm.spec.schema.LAYER list different tensors")
_FIELD_INDEX = {t.field: i for i, t in enumerate(schema.LAYER)}


# ------------------------------------------------------- the compute thread
#
# Every C call that starts OpenMP threads (packing, forward passes) runs on
# one thread per process, whichever thread asks; calls from several threads
# take turns. libgomp gives each thread that starts a parallel region a pool
# of workers of its own, and once the workers of all pools outnumber the
# cores it spins only 100 rounds at a barrier instead of GOMP_SPINCOUNT's.
# A model loaded in the main thread and stepped from another (a server's
# engine thread, a web framework's worker threads) then decoded at a third
# of its speed on 2 cores (benchmarks/caller_thread.py measures it), and
# two threads stepping at once oversubscribed the cores. The hand-over is
# two lock releases: a whole call to pack a 16 x 16 matrix takes 7 us,
# against milliseconds for a forward pass.

ctypedef void (*Job)(void *) noexcept nogil

cdef struct Compute:
    PyThread_type_lock turn    # held by the caller whose job is in hand
    PyThread_type_lock go      # released to hand the job over
    PyThread_type_lock done    # released by the compute thread when the job ends
    Job job
    void *arg

cdef Compute _compute
_compute_thread = None     # its thread id, once started
_compute_start = threading.Lock()


cdef void _compute_loop(void *unused) noexcept nogil:
    # Pure C, on a thread without a Python thread state: it never takes the GIL.
    while True:
        PyThread_acquire_lock(_compute.go, WAIT_LOCK)
        _compute.job(_compute.arg)
        PyThread_release_lock(_compute.done)


cdef int _start_compute_thread() except -1:
    global _compute_thread
    with _compute_start:
        if _compute_thread is not None:
            return 0
        _compute.turn = PyThread_allocate_lock()
        _compute.go = PyThread_allocate_lock()
        _compute.done = PyThread_allocate_lock()
        if _compute.turn == NULL or _compute.go == NULL or _compute.done == NULL:
            raise MemoryError()
        PyThread_acquire_lock(_compute.go, WAIT_LOCK)
        PyThread_acquire_lock(_compute.done, WAIT_LOCK)
        ident = PyThread_start_new_thread(_compute_loop, NULL)
        if ident == PYTHREAD_INVALID_THREAD_ID:
            raise RuntimeError("fastllm could not start its compute thread")
        _compute_thread = ident
    return 0


cdef int _run_job(Job job, void *arg) except -1:
    """job(arg) on the compute thread; returns when it has run. The caller
    keeps everything arg points to alive until then."""
    if _compute_thread is None:
        _start_compute_thread()
    with nogil:
        PyThread_acquire_lock(_compute.turn, WAIT_LOCK)
        _compute.job = job
        _compute.arg = arg
        PyThread_release_lock(_compute.go)
        PyThread_acquire_lock(_compute.done, WAIT_LOCK)
        PyThread_release_lock(_compute.turn)
    return 0


def _forget_compute_thread():
    """In a forked child: the parent's compute thread is not there (its
    locks may be held), so the next call starts one of the child's own."""
    global _compute_thread, _compute_start
    _compute_thread = None
    _compute_start = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_compute_thread)


def compute_thread_ident():
    """The thread id of the thread that runs fastllm's parallel C work (None
    before the first call)."""
    return _compute_thread


cdef struct PackArgs:
    void *dst
    const void *src
    int N, K, wtype, n_threads

cdef void _pack_job(void *p) noexcept nogil:
    cdef PackArgs *a = <PackArgs *>p
    flm.flm_pack(a.dst, a.src, a.N, a.K, a.wtype, a.n_threads)


cdef struct ChecksumArgs:
    const void *data
    size_t n
    int n_threads
    unsigned long long result

cdef void _checksum_job(void *p) noexcept nogil:
    cdef ChecksumArgs *a = <ChecksumArgs *>p
    a.result = flm.flm_checksum(a.data, a.n, a.n_threads)


cdef struct FiniteArgs:
    const void *data
    size_t n
    int wtype, n_threads, result

cdef void _finite_job(void *p) noexcept nogil:
    cdef FiniteArgs *a = <FiniteArgs *>p
    a.result = flm.flm_finite(a.data, a.n, a.wtype, a.n_threads)


cdef struct ForwardArgs:
    const flm.FlmConfig *cfg
    const flm.FlmWeights *w
    flm.FlmState *s
    const int32_t *tokens
    const flm.FlmSeq *seqs
    int n, pos, all_logits, n_threads
    float *logits

cdef void _forward_job(void *p) noexcept nogil:
    cdef ForwardArgs *a = <ForwardArgs *>p
    flm.flm_forward(a.cfg, a.w, a.s, a.tokens, a.n, a.pos, a.logits, a.all_logits, a.n_threads)

cdef void _forward_batch_job(void *p) noexcept nogil:
    cdef ForwardArgs *a = <ForwardArgs *>p
    flm.flm_forward_batch(a.cfg, a.w, a.s, a.seqs, a.n, a.logits, a.n_threads)


cdef struct RollbackArgs:
    const flm.FlmConfig *cfg
    const flm.FlmWeights *w
    flm.FlmState *s
    flm.FlmState *work
    int n, n_threads, result

cdef void _rollback_job(void *p) noexcept nogil:
    cdef RollbackArgs *a = <RollbackArgs *>p
    a.result = flm.flm_state_rollback(a.cfg, a.w, a.s, a.work, a.n, a.n_threads)


cdef int _set_field(flm.FlmLayer *L, str name, const void *p) except -1:
    """Fill the FlmLayer field of that name (a schema.LAYER field)."""
    (<const void **>&L.wq)[<int>_FIELD_INDEX[name]] = p
    return 0


def _path_from_environment():
    name = os.environ.get("FASTLLM_SIMD")
    if name and flm.flm_set_simd_path(name.encode()) != 0:
        raise ImportError(f"FASTLLM_SIMD={name!r}: no such SIMD path on this CPU "
                          "(generic; x86-64: avx2, avx512, avx512_bf16, amx_bf16; "
                          "aarch64: neon, dotprod, i8mm, neon_bf16)")


def _prefetch_from_environment():
    value = os.environ.get("FASTLLM_PREFETCH")
    if not value:
        return
    try:
        set_stream_prefetch(*(int(v) for v in value.split(":")))
    except (TypeError, ValueError, OverflowError) as e:
        raise ImportError(f"FASTLLM_PREFETCH={value!r}: {e}") from None


def stream_prefetch():
    """(bytes, level): how far ahead, into which cache level (1 or 2), the
    kernels ask for the weights they stream, or None where they leave it to
    the hardware (ARM, the generic path)."""
    cdef int nbytes, level
    if flm.flm_stream_prefetch(&nbytes, &level) != 0:
        return None
    return nbytes, level


def set_stream_prefetch(int nbytes, int level=1):
    """Ask for streamed weights nbytes ahead into cache level 1 or 2 instead
    of what this CPU was given (for benchmarks: results are the same bits)."""
    if flm.flm_set_stream_prefetch(nbytes, level) != 0:
        raise ValueError(f"prefetch {nbytes} bytes ahead into L{level}: not a multiple of 64 "
                         "from 0 to 65536 into level 1 or 2, or this CPU's kernels do not prefetch")


def simd_path():
    """The SIMD path this CPU runs: 'avx512', 'avx2', 'i8mm', 'dotprod', 'neon' or 'generic'."""
    return flm.flm_simd_path().decode()


def int8_path():
    """The int8 kernels quantized weights run on: 'avx512_vnni', 'avx2', 'i8mm', 'dotprod', 'neon' or 'generic'."""
    return flm.flm_int8_name().decode()


def set_simd_path(str name):
    """Force a SIMD path (for tests and benchmarks)."""
    if flm.flm_set_simd_path(name.encode()) != 0:
        raise ValueError(f"SIMD path {name!r} is not available on this CPU")


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


cdef int _first_bad_id(const int32_t[::1] ids, int vocab_size) noexcept nogil:
    """Index of the first id outside 0..vocab_size-1, else -1."""
    cdef Py_ssize_t i
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= vocab_size:
            return <int>i
    return -1


cdef _check_ids_at_boundary(const int32_t[::1] ids, int vocab_size):
    # The public paths check ids (check_token_ids); this cheap pass keeps
    # a caller that skipped them from reading outside the embedding table.
    cdef int bad = _first_bad_id(ids, vocab_size)
    if bad >= 0:
        raise ValueError(f"token id {ids[bad]} is outside the vocabulary (0..{vocab_size - 1})")


def weight_types():
    """The C core's table of weight types (quant.h's FlmQuantType), in the
    order of its enum: for each, its name, its enum value (type), the values
    of one GGML block and that block's bytes, the values a row's scales come
    in (superblock; a row's length must be a multiple), its bits per value,
    and whether its weights multiply int8 activations (quantized)."""
    cdef const flm.FlmQuantType *q
    out = []
    for t in range(flm.FLM_TYPES):
        q = flm.flm_quant_type(t)
        out.append({"name": q.name.decode(), "type": t, "block": q.ggml_block, "block_bytes": q.ggml_bytes,
                    "superblock": q.sb, "bits": q.bits, "quantized": bool(flm.flm_is_quantized(t))})
    return out


# Weight storage types by name: the C enum, and how numpy holds the values
# of a row before packing (absent: GGML blocks, as bytes).
TYPES = {t["name"]: t["type"] for t in weight_types()}
_ROW_DTYPES = {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}
# The KV cache's storage types (config.KV_DTYPES) as the C core names them.
_KV_TYPES = {"f32": flm.FLM_F32, "bf16": flm.FLM_BF16, "f16": flm.FLM_F16, "q8_0": flm.FLM_Q8_0}


cdef const flm.FlmQuantType *_weight_type(str dtype) except NULL:
    if dtype not in TYPES:
        raise ValueError(f"unknown weight type {dtype!r}; known: {', '.join(TYPES)}")
    return flm.flm_quant_type(TYPES[dtype])


def block_size(str dtype):
    """(values, bytes) of one block of a weight type: (1, 4) for f32."""
    cdef const flm.FlmQuantType *q = _weight_type(dtype)
    return q.ggml_block, q.ggml_bytes


def finite(values, str dtype, int n_threads=0):
    """Whether values of a weight type as a file stores them (float32, bf16
    bits as uint16, float16, or GGML blocks as uint8) hold no NaN or
    infinity (GGML blocks: in their f16 scales; the quants are integers).
    Threads share the work: the check costs a read of the values, at every
    load of every weight."""
    cdef const flm.FlmQuantType *q = _weight_type(dtype)
    cdef cnp.ndarray arr = np.ascontiguousarray(values)
    want = _ROW_DTYPES.get(dtype, np.uint8)
    if arr.dtype != want:
        raise TypeError(f"{dtype} values are held as {np.dtype(want)}, got {arr.dtype}")
    if arr.nbytes % q.ggml_bytes:
        raise ValueError(f"{arr.nbytes} bytes are not whole {dtype} blocks of {q.ggml_bytes} bytes")
    cdef FiniteArgs job
    job.data = cnp.PyArray_DATA(arr)
    job.n = <size_t>arr.nbytes // q.ggml_bytes * q.ggml_block
    job.wtype = TYPES[dtype]
    job.n_threads = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    _run_job(_finite_job, &job)
    return bool(job.result)


def superblock(str dtype):
    """Values of a row that a type's scales come in: K must be a multiple."""
    return _weight_type(dtype).sb


def row_bytes(str dtype, long long K):
    n, b = block_size(dtype)
    return K // n * b


cdef class Matrix:
    """A weight matrix for the run loop: its type, shape (N, K), and data,
    either packed into panels (every matrix the loop multiplies by) or as
    plain rows (an embedding table, read one row per token)."""
    cdef flm.FlmMatrix m
    cdef readonly object data
    cdef readonly str dtype
    cdef readonly int N, K
    cdef readonly bint packed
    cdef readonly int experts   # a mixture's expert matrices: this many (N, K) ones; else 0

    def __cinit__(self, cnp.ndarray data, str dtype, int N, int K, bint packed, int experts=0):
        self.data, self.dtype, self.N, self.K, self.packed = data, dtype, N, K, packed
        self.experts = experts
        self.m.data = cnp.PyArray_DATA(data)
        self.m.type = TYPES[dtype]

    @property
    def shape(self):
        if self.experts:
            return (self.experts, self.N, self.K)
        return (self.N, self.K)

    @property
    def params(self):
        return max(self.experts, 1) * self.N * self.K

    @property
    def nbytes(self):
        return self.data.nbytes

    def row(self, int r):
        """Row r as float32 values, as the run loop sees them."""
        if not 0 <= r < self.N or self.experts:
            raise IndexError(r)
        cdef cnp.ndarray out = np.empty(self.K, np.float32)
        cdef const char *base = <const char *>self.m.data
        if self.packed:
            flm.flm_packed_row(<float *>cnp.PyArray_DATA(out), self.m.data, r, self.K, self.m.type)
        elif self.dtype == "f32":
            out[:] = self.data[r]
        elif self.dtype == "bf16":
            out[:] = (self.data[r].astype(np.uint32) << 16).view(np.float32)
        else:
            stride = row_bytes(self.dtype, self.K)
            flm.flm_quant_dequant_row(<float *>cnp.PyArray_DATA(out), base + <size_t>r * <size_t>stride,
                                      self.K, self.m.type)
        return out


def _check_rows(data, str dtype, int K):
    """data as a contiguous (N, row) array of a type's rows, and N."""
    if K < 1 or K % superblock(dtype):
        raise ValueError(f"{dtype} rows hold whole blocks of {superblock(dtype)} values; K = {K}")
    cdef cnp.ndarray src = np.ascontiguousarray(data)
    want = _ROW_DTYPES.get(dtype, np.uint8)
    width = K if dtype in _ROW_DTYPES else row_bytes(dtype, K)
    if src.ndim != 2 or src.dtype != want or src.shape[1] != width:
        raise TypeError(f"{dtype} rows of {K} values are a 2-D {np.dtype(want)} array of width {width}, "
                        f"got {src.dtype} {tuple(np.shape(src))}")
    return src, src.shape[0]


# Where packed matrices are made: numpy's memory, unless a load on this
# thread has given another place (fastllm.load.pack_cache: the file being
# written). A matrix is packed in parts: sink.reserve(n) its n bytes, then
# for each part sink.part(where, at, size) (a writable uint8 array to pack
# it into) and sink.done(where, at, part) once it is packed, and last
# sink.result(where), the matrix's bytes as a uint8 array.
_packing = threading.local()


class _InMemory:
    """Packed matrices in numpy's memory, each part packed in place."""

    @staticmethod
    def reserve(size_t n):
        return np.empty(n, np.uint8)

    @staticmethod
    def part(dst, size_t at, size_t n):
        return dst[at:at + n]

    @staticmethod
    def done(dst, size_t at, part):
        pass

    @staticmethod
    def result(dst):
        return dst


def _sink():
    sink = getattr(_packing, "sink", None)
    return _InMemory if sink is None else sink


class packing_into:
    """Within it, the packed matrices this thread makes go to sink (an
    object with reserve, part, done and result, as _InMemory's) instead of
    numpy's own memory."""

    def __init__(self, sink):
        self.sink = sink

    def __enter__(self):
        self.before = getattr(_packing, "sink", None)
        _packing.sink = self.sink
        return self

    def __exit__(self, *exc):
        _packing.sink = self.before


def pack(matrix, int n_threads=0, str dtype=None, int K=0):
    """Pack an (N, K) matrix into the panel layout the run loop reads: a
    Matrix. matrix holds float32 values, bf16 bit patterns as uint16, f16
    values as float16, or (with dtype, and K the values per row) rows of
    GGML blocks as uint8."""
    if dtype is None:
        arr = np.asarray(matrix)
        dtype = {np.dtype(np.float32): "f32", np.dtype(np.uint16): "bf16",
                 np.dtype(np.float16): "f16"}.get(arr.dtype)
        if dtype is None or arr.ndim != 2:
            raise TypeError("pack takes a 2-D float32, uint16 (bf16) or float16 matrix, "
                            "or GGML blocks with their dtype")
        K = arr.shape[1]
    src, N = _check_rows(matrix, dtype, K)
    cdef int n = N, k = K, wtype = TYPES[dtype]
    cdef size_t size = flm.flm_packed_bytes(n, k, wtype)
    sink = _sink()
    where = sink.reserve(size)
    cdef cnp.ndarray dst = sink.part(where, 0, size)
    cdef int nt = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    cdef PackArgs job
    job.dst = cnp.PyArray_DATA(dst)
    job.src = cnp.PyArray_DATA(<cnp.ndarray>src)
    job.N, job.K, job.wtype, job.n_threads = n, k, wtype, nt
    _run_job(_pack_job, &job)
    sink.done(where, 0, dst)
    return Matrix(sink.result(where), dtype, N, K, True)


def pack_experts(expert, int n_experts, str dtype, int N, int K, int n_threads=0):
    """Pack n_experts (N, K) matrices of one type, expert e's rows given by
    expert(e) (as pack takes them), each into its own slice of one buffer:
    a Matrix of shape (n_experts, N, K). One expert's rows at a time are
    in memory beside the packed buffer."""
    if dtype not in TYPES:
        raise ValueError(f"unknown weight type {dtype!r}; known: {', '.join(TYPES)}")
    cdef int wtype = TYPES[dtype]
    cdef size_t stride = flm.flm_expert_bytes(N, K, wtype)
    sink = _sink()
    where = sink.reserve(stride * n_experts)
    cdef cnp.ndarray dst
    cdef int nt = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    cdef PackArgs job
    for e in range(n_experts):
        src, n = _check_rows(expert(e), dtype, K)
        if n != N:
            raise ValueError(f"expert {e} has {n} rows, expected {N}")
        dst = sink.part(where, stride * e, stride)
        job.dst = cnp.PyArray_DATA(dst)
        job.src = cnp.PyArray_DATA(<cnp.ndarray>src)
        job.N, job.K, job.wtype, job.n_threads = N, K, wtype, nt
        _run_job(_pack_job, &job)
        sink.done(where, stride * e, dst)
        src = None   # this expert's rows, before the next is read
    return Matrix(sink.result(where), dtype, N, K, True, n_experts)


def packed_matrix(data, str dtype, int N, int K, int experts=0):
    """A Matrix of packed panels over data as flm_pack (or pack_experts, with
    experts > 0) wrote them: a 1-D uint8 array of exactly the bytes the
    shape and type take, checked here, since C reads all of them."""
    if dtype not in TYPES:
        raise ValueError(f"unknown weight type {dtype!r}")
    if N < 1 or experts < 0 or K < 1 or K % superblock(dtype):
        raise ValueError(f"no {dtype} matrix has N = {N}, K = {K}, {experts} experts")
    cdef int wtype = TYPES[dtype]
    want = flm.flm_expert_bytes(N, K, wtype) * experts if experts else flm.flm_packed_bytes(N, K, wtype)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1 \
            or not data.flags.c_contiguous or data.nbytes != want:
        raise ValueError(f"a packed {dtype} matrix of {N} x {K}"
                         f"{f' x {experts} experts' if experts else ''} is {want} contiguous bytes")
    return Matrix(data, dtype, N, K, True, experts)


# What packed weights on disk must have been written with (see FLM_PACK_LAYOUT).
PACK_LAYOUT = flm.FLM_PACK_LAYOUT


def skip_strings(const unsigned char[::1] buf, Py_ssize_t pos, Py_ssize_t count):
    """Step over up to count GGUF strings (a little-endian u64 length, then
    that many bytes) in buf from pos, while each lies whole in buf: (the
    position after the last one stepped over, how many). A vocabulary's
    400,000 strings are skipped in a millisecond, where a Python loop takes
    a tenth of a second at every load."""
    cdef Py_ssize_t n = buf.shape[0], walked = 0
    cdef unsigned long long length
    cdef int b
    while walked < count and n - pos >= 8:
        length = 0
        for b in range(8):
            length |= (<unsigned long long>buf[pos + b]) << (8 * b)
        if length > <unsigned long long>(n - pos - 8):
            break
        pos += 8 + <Py_ssize_t>length
        walked += 1
    return pos, walked


def checksum(const unsigned char[::1] data, int n_threads=0):
    """flm_checksum of a buffer (csrc/checksum.h): the same for any n_threads."""
    cdef ChecksumArgs job
    job.data = &data[0] if data.shape[0] else NULL
    job.n = data.shape[0]
    job.n_threads = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    _run_job(_checksum_job, &job)
    return job.result


def pack_in_chunks(read_rows, int N, int K, str dtype, int chunk_rows, int n_threads=0):
    """pack for a matrix too big to hold twice: its N rows of GGML blocks
    (or float32, bf16, f16 values) come from read_rows(first, n), chunk_rows
    at a time (a multiple of the panel height, so that each chunk fills
    whole panels: a contiguous slice of the packed bytes)."""
    if chunk_rows < 1 or chunk_rows % flm.FLM_PANEL:
        raise ValueError(f"chunk_rows must be a positive multiple of {flm.FLM_PANEL}, got {chunk_rows}")
    if N < 1:
        raise ValueError(f"a matrix has at least one row, got N = {N}")
    cdef int wtype = TYPES[dtype]
    sink = _sink()
    where = sink.reserve(flm.flm_packed_bytes(N, K, wtype))
    cdef cnp.ndarray dst
    cdef int nt = n_threads if n_threads > 0 else (os.cpu_count() or 1)
    cdef PackArgs job
    cdef int first, n
    cdef size_t at
    for first in range(0, N, chunk_rows):
        n = min(chunk_rows, N - first)
        src, got = _check_rows(read_rows(first, n), dtype, K)
        if got != n:
            raise ValueError(f"read_rows({first}, {n}) gave {got} rows")
        at = flm.flm_packed_bytes(first, K, wtype)
        dst = sink.part(where, at, flm.flm_packed_bytes(n, K, wtype))
        job.dst = cnp.PyArray_DATA(dst)
        job.src = cnp.PyArray_DATA(<cnp.ndarray>src)
        job.N, job.K, job.wtype, job.n_threads = n, K, wtype, nt
        _run_job(_pack_job, &job)
        sink.done(where, at, dst)
    return Matrix(sink.result(where), dtype, N, K, True)


def rows(matrix, str dtype=None, int K=0):
    """An embedding table as plain rows (float32, bf16 bits as uint16, or
    GGML blocks as uint8 with dtype and K): a Matrix read one row per token."""
    if dtype is None:
        arr = np.asarray(matrix)
        dtype = {np.dtype(np.float32): "f32", np.dtype(np.uint16): "bf16"}.get(arr.dtype)
        if dtype is None or arr.ndim != 2:
            raise TypeError("rows takes a 2-D float32 or uint16 (bf16) matrix, or GGML blocks with their dtype")
        K = arr.shape[1]
    src, N = _check_rows(matrix, dtype, K)
    return Matrix(src, dtype, N, K, False)


cdef const void *_matrix_ptr(object m, tuple shape, bint packed, str what) except NULL:
    if not isinstance(m, Matrix):
        raise TypeError(f"{what}: expected a fastllm.core._core.Matrix, got {type(m).__name__}")
    cdef Matrix mat = <Matrix>m
    if mat.shape != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {mat.shape}")
    if mat.packed != packed:
        raise ValueError(f"{what}: expected {'packed panels' if packed else 'plain rows'}")
    return &mat.m


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
    weights the dict of weights.load_weights: matrices as Matrix objects
    (packed, see pack; the embedding as rows, or None where tied), vectors
    in float32; with "v_heads_tiled" true, the Gated DeltaNet tensors hold
    their value heads in llama.cpp's tiled order, not HF's grouped one
    (weights.load_gguf_weights says when). The context holds n_ctx
    positions. With float_acts, quantized weights multiply fp32
    activations (their exact dequantized values) rather than int8 blocks
    of them. A sequence runs at most max_pass tokens in one pass: a
    sliding-window layer's cache holds its window and one pass (a ring),
    where that is less than n_ctx."""
    cdef flm.FlmConfig cfg
    cdef flm.FlmWeights w
    cdef flm.FlmLayer *layers
    cdef readonly object config
    cdef object _keep
    cdef bint long_rope   # the layers have LongRoPE's long tables
    cdef int _n_threads

    def __cinit__(self, config, dict weights, int n_ctx, int n_threads=1, str kv_dtype="f32",
                  bint float_acts=False, int max_pass=512):
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        if max_pass < 1:
            raise ValueError(f"max_pass must be positive, got {max_pass}")
        layers = weights["layers"]
        if len(layers) != config.num_hidden_layers:
            raise ValueError(f"expected {config.num_hidden_layers} layers, got {len(layers)}")
        self.config = config
        self.n_threads = n_threads
        cdef flm.FlmConfig *c = &self.cfg
        # Buffers and the cache are sized by the widest layer.
        views = config.layer_configs()
        c.dim, c.hidden_dim = config.hidden_size, config.max_size("intermediate_size")
        c.n_layers, c.n_heads = config.num_hidden_layers, config.num_attention_heads
        c.n_kv_heads, c.head_dim = config.max_size("num_key_value_heads"), config.max_size("head_dim")
        c.vocab_size, c.seq_len, c.rope_dim = config.vocab_size, n_ctx, config.rope_dim
        c.float_acts = float_acts
        if kv_dtype not in _KV_TYPES:
            raise ValueError(f"kv_dtype must be one of {tuple(_KV_TYPES)}, got {kv_dtype!r}")
        if kv_dtype == "q8_0":
            for i, view in enumerate(views):
                if view.head_dim % 32 and config.layer_kind(i) != "linear_attention":
                    raise ValueError(f"{config.path}: kv_dtype q8_0 keeps blocks of 32 values, and layer {i}'s "
                                     f"head_dim is {view.head_dim}: choose f16, bf16 or f32")
        c.kv_type = _KV_TYPES[kv_dtype]
        c.max_pass = max_pass
        c.norm_eps, c.attn_scale = config.rms_norm_eps, config.attention_scale
        c.lin_k_heads, c.lin_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        c.lin_k_dim, c.lin_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        c.conv_kernel = config.linear_conv_kernel_dim
        c.lin_v_tiled = bool(weights.get("v_heads_tiled", False))
        c.embed_scale, c.residual_scale = config.embedding_multiplier, config.residual_multiplier
        c.logits_div, c.qk_norm_whole = config.logits_scaling, config.qk_norm_whole
        c.activation = flm.FLM_GELU_TANH if config.hidden_act == "gelu_pytorch_tanh" else flm.FLM_SILU
        c.attn_softcap = config.attn_logit_softcapping or 0.0
        c.logit_softcap = config.final_logit_softcapping or 0.0
        c.n_experts, c.n_experts_used = config.num_experts, config.num_experts_per_tok
        c.expert_dim, c.norm_topk_prob = config.moe_intermediate_size, config.norm_topk_prob
        c.shared_dim = config.shared_expert_intermediate_size
        c.per_layer_dim = config.hidden_size_per_layer_input
        c.nextn = "eh_proj" in weights

        self.layers = <flm.FlmLayer *>calloc(c.n_layers, sizeof(flm.FlmLayer))
        if self.layers == NULL:
            raise MemoryError()
        value_norms = {}
        for i, d in enumerate(layers):
            kind = d.get("kind", schema.ATTENTION)
            if kind not in (schema.ATTENTION, schema.LINEAR):
                raise ValueError(f"layer {i}: unknown kind {kind!r}")
            lc = views[i]
            self.layers[i].kind = flm.FLM_LINEAR_ATTENTION if kind == schema.LINEAR else flm.FLM_ATTENTION
            self.layers[i].head_dim, self.layers[i].n_kv_heads = lc.head_dim, lc.num_key_value_heads
            self.layers[i].rope_dim, self.layers[i].hidden_dim = lc.rope_dim, lc.intermediate_size
            self.layers[i].kv_layer = config.kv_layer(i)
            self.layers[i].window = config.attention_window(i)
            if config.gemma4_layers:   # values RMS-normed without a weight of their own
                ones = value_norms.setdefault(lc.head_dim, np.ones(lc.head_dim, np.float32))
                self.layers[i].v_norm = <const float *>_ptr(ones, np.float32, (lc.head_dim,), "value norm")
            expected = {t.field: t for t in schema.layer_tensors(lc, kind, config.layer_ffn(i))}
            missing, unknown = sorted(expected.keys() - d.keys()), sorted(d.keys() - expected.keys() - {"kind"})
            if missing or unknown:
                raise ValueError(f"layer {i}: " + "; ".join(
                    f"{what} weights {names}" for what, names in (("missing", missing), ("unknown", unknown))
                    if names))
            for name, t in expected.items():
                _set_field(&self.layers[i], name, _array_ptr(d[name], t, lc, f"layer {i} {name}"))
        self.w.layers = self.layers
        # One set of tables per distinct RoPE (Gemma 3's sliding layers have
        # their own); a NoPE layer's stay NULL.
        tables = {}
        self.long_rope = False
        q_scales = config.query_position_scales(n_ctx)
        for i in range(c.n_layers):
            if q_scales is not None:
                self.layers[i].q_pos_scale = <const float *>_ptr(q_scales, np.float32, (n_ctx,),
                                                                 "query position scales")
            if not config.layer_rope(i):
                continue
            rc = views[i]
            shape = (n_ctx, rc.rope_dim // 2)
            key = (rc.rope_theta, repr(rc.rope_scaling), rc.rope_dim)
            if key not in tables:
                tables[key] = (*rc.rope_tables(n_ctx), rc.rope_tables_long(n_ctx))
            cos, sin, long_tables = tables[key]
            self.layers[i].rope_cos = <const float *>_ptr(cos, np.float32, shape, "rope cos")
            self.layers[i].rope_sin = <const float *>_ptr(sin, np.float32, shape, "rope sin")
            if long_tables is not None:
                self.long_rope = True
                self.layers[i].rope_cos_long = <const float *>_ptr(long_tables[0], np.float32, shape,
                                                                   "rope cos (long)")
                self.layers[i].rope_sin_long = <const float *>_ptr(long_tables[1], np.float32, shape,
                                                                   "rope sin (long)")
        # embed None: tied, the rows are read from the packed head.
        embed = weights["embed"]
        if isinstance(embed, np.ndarray):
            embed = rows(embed)
        self.w.embed = NULL if embed is None else <const flm.FlmMatrix *>_array_ptr(
            embed, schema.EMBED, config, "embedding")
        self.w.lm_head = <const flm.FlmMatrix *>_array_ptr(weights["lm_head"], schema.LM_HEAD, config, "lm_head")
        self.w.norm = <const float *>_array_ptr(weights["norm"], schema.NORM, config, "final norm")
        if config.per_layer_inputs:
            ple = {t.field: t for t in schema.PER_LAYER_MODEL}
            table = weights["embed_per_layer"]
            if isinstance(table, np.ndarray):
                table = rows(table)
                weights = dict(weights, embed_per_layer=table)
            self.w.embed_per_layer = <const flm.FlmMatrix *>_matrix_ptr(
                table, ple["embed_per_layer"].shape(config), False, "per-layer embedding")
            self.w.per_layer_proj = <const flm.FlmMatrix *>_array_ptr(
                weights["per_layer_proj"], ple["per_layer_proj"], config, "per-layer projection")
            self.w.per_layer_norm = <const float *>_array_ptr(
                weights["per_layer_norm"], ple["per_layer_norm"], config, "per-layer projection norm")
        if c.nextn:
            dim = config.hidden_size
            self.w.eh_proj = <const flm.FlmMatrix *>_matrix_ptr(weights["eh_proj"], (dim, 2 * dim), True,
                                                                 "nextn projection")
            self.w.enorm = <const float *>_ptr(weights["enorm"], np.float32, (dim,), "nextn embedding norm")
            self.w.hnorm = <const float *>_ptr(weights["hnorm"], np.float32, (dim,), "nextn hidden norm")
        # Copies of the containers: the arrays stay alive whatever the caller
        # later does with its dict and lists.
        self._keep = (dict(weights, embed=embed, layers=[dict(d) for d in layers]), tables, q_scales, value_norms)

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

    def work_bytes(self, int max_batch, int max_threads=0):
        """Bytes of the work buffers of a State for passes of up to max_batch tokens."""
        max_threads = max(max_threads, self._n_threads, os.cpu_count() or 1)
        return flm.flm_state_work_floats(&self.cfg, max_batch, max_threads) * 4

    @property
    def max_pass(self):
        """The most tokens of one sequence one pass runs."""
        return self.cfg.max_pass

    @property
    def kv_dtype(self):
        """Storage of the KV cache: "f32", "bf16", "f16" or "q8_0"."""
        return {v: k for k, v in _KV_TYPES.items()}[self.cfg.kv_type]

    @property
    def weight_types(self):
        """Parameters of the matrices by weight type, e.g. {"q4_k": ..., "q6_k": ...}."""
        counts = {}
        for m in self._matrices():
            counts[m.dtype] = counts.get(m.dtype, 0) + m.params
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    @property
    def nbytes(self):
        """Bytes of every weight array C reads."""
        arrays = [self._keep[0]["norm"]] + [self._keep[0][k] for k in ("per_layer_norm",) if k in self._keep[0]] + [a for d in self._keep[0]["layers"] for k, a in d.items()
                                            if k != "kind" and not isinstance(a, Matrix)]
        return sum(m.nbytes for m in self._matrices()) + sum(a.nbytes for a in arrays)

    def _matrices(self):
        w = self._keep[0]
        found = [w["lm_head"]] + ([w["embed"]] if w["embed"] is not None else [])
        found += [w[name] for name in ("embed_per_layer", "per_layer_proj") if name in w]
        return found + [a for d in w["layers"] for a in d.values() if isinstance(a, Matrix)]

    @property
    def float_acts(self):
        return bool(self.cfg.float_acts)

    @property
    def vocab_size(self):
        return self.cfg.vocab_size


cdef const void *_array_ptr(object arr, object t, object config, str what) except NULL:
    """What C reads for a schema tensor, once its type and shape are right:
    a matrix's FlmMatrix, a vector's data."""
    shape = t.shape(config)
    if t.matrix:
        return _matrix_ptr(arr, shape, t is not schema.EMBED, what)
    return _ptr(arr, np.float32, shape, what)


def _lazy_zeros(size_t n):
    """n float32 zeros in fresh pages that cost memory only once written:
    the KV cache grows with the positions used, not with n_ctx. (numpy asks
    for 2 MB huge pages for large arrays, and the first key written to each
    layer and head would then bring in 2 MB. Private: an anonymous map is
    shared by default, which puts the cache in shared memory, counted
    apart from the process's own and kept across a fork.)"""
    buf = mmap.mmap(-1, max(n, 1) * 4, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, np.float32, n)


cdef class State:
    """The run state of one sequence over shared Weights: work buffers, the
    KV cache and the recurrent state of linear layers. A State serves one
    thread at a time; fastllm.Session keeps track of what it holds."""
    cdef flm.FlmState s
    cdef readonly Weights weights
    cdef cnp.ndarray _work
    cdef cnp.ndarray _cache
    cdef cnp.ndarray _saved   # rollback buffers (enable_rollback), or None
    cdef cnp.ndarray _kept

    def __cinit__(self, Weights weights, int max_batch=512, int max_threads=0):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.weights = weights
        # One attention score row per thread that may ever run.
        max_threads = max(max_threads, weights._n_threads, os.cpu_count() or 1)
        self._work = np.zeros(flm.flm_state_work_floats(&weights.cfg, max_batch, max_threads), np.float32)
        self._cache = _lazy_zeros(flm.flm_state_cache_floats(&weights.cfg, weights.layers))
        flm.flm_state_init(&self.s, &weights.cfg, weights.layers, max_batch, max_threads,
                           <float *>cnp.PyArray_DATA(self._work), <float *>cnp.PyArray_DATA(self._cache))

    @property
    def rope_long(self):
        """Whether this sequence is rotated with the long LongRoPE tables."""
        return bool(self.s.rope_long)

    @rope_long.setter
    def rope_long(self, bint value):
        if value and not self.weights.long_rope:
            raise ValueError("these weights have no long rope tables")
        self.s.rope_long = value

    def enable_rollback(self, int rows):
        """Let a pass of at most rows tokens be cut back to any prefix of
        them (rollback): the recurrent layers then save their states and
        inputs in buffers of this state's own. Nothing to hold, and nothing
        done, for a model without recurrent layers."""
        cdef Weights w = self.weights
        if not 1 <= rows <= 1 << 16:
            raise ValueError(f"rollback rows must be from 1 to 65536, got {rows}")
        if rows <= self.s.keep_rows or not flm.flm_state_saved_floats(&w.cfg):
            return
        self._saved = np.empty(flm.flm_state_saved_floats(&w.cfg), np.float32)
        self._kept = np.empty(flm.flm_state_keep_floats(&w.cfg, rows), np.float32)
        self.s.lin_saved = <float *>cnp.PyArray_DATA(self._saved)
        self.s.lin_keep = <float *>cnp.PyArray_DATA(self._kept)
        self.s.keep_rows = rows
        self.s.kept = -1

    def kv_bytes(self, int n):
        """Bytes of keys and values the first n positions take in the cache
        (a sliding-window layer's ring at most its slots)."""
        return flm.flm_state_kv_bytes(&self.weights.cfg, &self.s, max(n, 0))

    @property
    def rewind_room(self):
        """How many tokens back from the furthest position this state has
        written it can always go: its sliding-window layers' rings still
        hold the window before (at least max_pass); None where no cache is
        a ring (an attention cache can go back anywhere)."""
        room = flm.flm_state_rewind_room(&self.weights.cfg, &self.s)
        return None if room < 0 else room

    def save_position(self, int pos):
        """What this state needs besides its attention caches to go back to
        position pos later, as it is now at pos (the recurrent layers'
        states, the windows before pos its rings hold), or None where it
        needs nothing: restore_position puts it back."""
        cdef Weights w = self.weights
        cdef size_t lin = flm.flm_state_saved_floats(&w.cfg), win = flm.flm_state_window_floats(&w.cfg, &self.s)
        if not lin and not win:
            return None
        cdef cnp.ndarray out = np.empty(lin + win, np.float32)
        if lin:
            memcpy(cnp.PyArray_DATA(out), self.s.lin_state, lin * sizeof(float))
        if win:
            flm.flm_state_window(&w.cfg, &self.s, pos, <float *>cnp.PyArray_DATA(out) + lin, 1)
        return out

    def restore_position(self, int pos, saved):
        """Go back to position pos with what save_position(pos) saved."""
        cdef Weights w = self.weights
        cdef size_t lin = flm.flm_state_saved_floats(&w.cfg), win = flm.flm_state_window_floats(&w.cfg, &self.s)
        if saved is None and not lin and not win:
            return
        cdef cnp.ndarray arr = saved
        if arr is None or arr.dtype != np.float32 or arr.size != lin + win or not arr.flags.c_contiguous:
            raise ValueError("not what save_position saved of this model's states")
        if not 0 <= pos <= w.cfg.seq_len:
            raise ValueError(f"position {pos} is outside the context of {w.cfg.seq_len}")
        if lin:
            memcpy(self.s.lin_state, cnp.PyArray_DATA(arr), lin * sizeof(float))
        if win:
            flm.flm_state_window(&w.cfg, &self.s, pos, <float *>cnp.PyArray_DATA(arr) + lin, 0)
        self.s.kept = -1

    def save_prefix(self, int n):
        """The keys and values of positions 0 .. n-1 of the caches that are
        not rings, as bytes (a uint8 array): with save_position(n), what a
        sequence of n tokens holds. load_prefix puts them back."""
        cdef Weights w = self.weights
        if not 0 <= n <= w.cfg.seq_len:
            raise ValueError(f"position {n} is outside the context of {w.cfg.seq_len}")
        cdef cnp.ndarray out = np.empty(flm.flm_state_prefix_bytes(&w.cfg, &self.s, n), np.uint8)
        flm.flm_state_prefix(&w.cfg, &self.s, n, cnp.PyArray_DATA(out), 1)
        return out

    def load_prefix(self, int n, data):
        """Put back what save_prefix(n) saved."""
        cdef Weights w = self.weights
        if not 0 <= n <= w.cfg.seq_len:
            raise ValueError(f"position {n} is outside the context of {w.cfg.seq_len}")
        cdef cnp.ndarray arr = data
        if arr is None or arr.dtype != np.uint8 or not arr.flags.c_contiguous or \
                arr.size != flm.flm_state_prefix_bytes(&w.cfg, &self.s, n):
            raise ValueError(f"not what save_prefix saved of {n} positions of this model's caches")
        flm.flm_state_prefix(&w.cfg, &self.s, n, cnp.PyArray_DATA(arr), 0)

    def release(self, int n):
        """Give back to the system the pages of the caches (not the rings)
        that positions from n on take: they cost memory again only once
        written. For a sequence that held many more tokens than it holds
        now. Returns the bytes given back."""
        cdef Weights w = self.weights
        n = max(n, 0)
        cdef int count = flm.flm_state_tail(&w.cfg, &self.s, n, NULL, 0)
        base = (<object>self._cache).base
        buf = getattr(base, "obj", base)   # the anonymous map (_lazy_zeros), under a memoryview
        if count == 0 or not isinstance(buf, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        cdef cnp.ndarray ranges = np.empty(2 * count, np.uint64)
        flm.flm_state_tail(&w.cfg, &self.s, n, <size_t *>cnp.PyArray_DATA(ranges), count)
        page, freed = mmap.PAGESIZE, 0
        for i in range(count):
            start, length = int(ranges[2 * i]), int(ranges[2 * i + 1])
            first, last = -(-start // page) * page, (start + length) // page * page
            if last > first:
                buf.madvise(mmap.MADV_DONTNEED, first, last - first)
                freed += last - first
        return freed

    @property
    def recurrent_bytes(self):
        """Bytes of the recurrent layers' states (0 for a model without them)."""
        return flm.flm_state_saved_floats(&self.weights.cfg) * 4

    @property
    def rollback_bytes(self):
        """Bytes of the rollback buffers (0 until enable_rollback, and for a
        model without recurrent layers)."""
        return 0 if self._saved is None else self._saved.nbytes + self._kept.nbytes

    def rollback(self, int n, State work=None):
        """Keep only the first n tokens of the last pass, which ran with
        keep=True (recurrent layers: their states after those tokens,
        bit for bit; attention layers need nothing). The replay runs in the
        work buffers of work (default: this state's)."""
        cdef State wk = self if work is None else work
        if wk.weights is not self.weights:
            raise ValueError("states of different weights")
        cdef Weights w = self.weights
        if not flm.flm_state_saved_floats(&w.cfg):
            return
        cdef RollbackArgs job
        job.cfg, job.w, job.s, job.work, job.n, job.n_threads = &w.cfg, &w.w, &self.s, &wk.s, n, w._n_threads
        _run_job(_rollback_job, &job)
        if job.result != 0:
            raise ValueError(f"cannot roll back to {n} tokens of the last pass: it kept "
                             f"{max(self.s.kept, 0)} (run it with keep=True, after enable_rollback)")

    def save_recurrent(self):
        """A copy of the recurrent layers' states (conv windows and delta-rule
        states) as they are now, or None for a model without recurrent
        layers. restore_recurrent puts it back."""
        cdef size_t n = flm.flm_state_saved_floats(&self.weights.cfg)
        if not n:
            return None
        cdef cnp.ndarray out = np.empty(n, np.float32)
        memcpy(cnp.PyArray_DATA(out), self.s.lin_state, n * sizeof(float))
        return out

    def restore_recurrent(self, saved):
        """Give the recurrent layers the states save_recurrent copied."""
        cdef size_t n = flm.flm_state_saved_floats(&self.weights.cfg)
        if saved is None and not n:
            return
        cdef cnp.ndarray arr = saved
        if arr is None or arr.dtype != np.float32 or arr.size != n or not arr.flags.c_contiguous:
            raise ValueError("not a copy of this model's recurrent states")
        memcpy(self.s.lin_state, cnp.PyArray_DATA(arr), n * sizeof(float))
        self.s.kept = -1

    def copy_from(self, State other, int n, bint whole):
        """Hold what other holds for its first n positions (with whole, its
        recurrent states too: then n must be all it has run)."""
        if other.weights is not self.weights:
            raise ValueError("states of different weights")
        if not 0 <= n <= self.weights.cfg.seq_len:
            raise ValueError(f"cannot copy {n} positions")
        flm.flm_state_copy(&self.weights.cfg, &self.s, &other.s, n, whole)

    def run(self, const int32_t[::1] tokens, int pos, bint all_logits=False, bint hidden_states=False,
            bint keep=False, bint hidden=False, nextn_h=None, bint logits=True):
        """Run tokens (ids checked by check_token_ids) at positions pos.. and
        return float32 logits: (vocab,) for the last token, or (n, vocab)
        with all_logits. With hidden_states, also each layer's output,
        (n_layers, n, dim). Linear layers start afresh at pos 0 and must
        otherwise continue right after the last token run. keep: the pass
        may be rolled back (see rollback). hidden: also the final-normed
        hidden state of every token, (n, dim), after the logits. nextn_h:
        for a nextn model, the hidden state each token follows, (n, dim).
        logits False: no LM head, and only the hidden states come back."""
        cdef Weights w = self.weights
        cdef int n = tokens.shape[0]
        if n < 1 or pos < 0 or pos > w.cfg.seq_len - n:
            raise ValueError(f"positions {pos}..{pos + n - 1} do not fit the context of "
                             f"{w.cfg.seq_len} tokens")
        _check_ids_at_boundary(tokens, w.cfg.vocab_size)
        cdef cnp.ndarray[float, ndim=2, mode="c"] out = np.empty(
            (n if all_logits else 1, w.cfg.vocab_size), np.float32)
        cdef int nt = w._n_threads
        cdef cnp.ndarray trace = None
        if hidden_states:
            trace = np.empty((w.cfg.n_layers, n, w.cfg.dim), np.float32)
            self.s.trace = <float *>cnp.PyArray_DATA(trace)
            self.s.trace_tokens = n
        cdef cnp.ndarray normed = None
        if hidden:
            normed = np.empty((n, w.cfg.dim), np.float32)
            self.s.hidden = <float *>cnp.PyArray_DATA(normed)
        cdef cnp.ndarray follows = _nextn_input(w, nextn_h, n)
        if follows is not None:
            self.s.nextn_h = <const float *>cnp.PyArray_DATA(follows)
        cdef ForwardArgs job
        job.cfg, job.w, job.s, job.tokens, job.seqs = &w.cfg, &w.w, &self.s, &tokens[0], NULL
        job.n, job.pos, job.all_logits, job.n_threads = n, pos, all_logits, nt
        job.logits = &out[0, 0] if logits else NULL
        self.s.keep = keep
        try:
            _run_job(_forward_job, &job)
        finally:
            self.s.trace = NULL
            self.s.hidden = NULL
            self.s.nextn_h = NULL
            self.s.keep = 0
        result = out if all_logits else out[0]
        if hidden:
            result = (result, normed) if logits else normed
        return (result, trace) if hidden_states else result

    def hidden(self, const int32_t[::1] tokens, int pos):
        """Run tokens (ids checked by check_token_ids) at positions pos.. as
        run() does, without the LM head: the final-normed hidden state of
        every token, float32 (n, dim)."""
        return self.run(tokens, pos, hidden=True, logits=False)


cdef cnp.ndarray _nextn_input(Weights w, h, int n):
    """h as the (n, dim) float32 rows a nextn model reads, checked; None
    where the model is not one (and then h must be None)."""
    if not w.cfg.nextn:
        if h is not None:
            raise ValueError("hidden states to follow are for a multi-token-prediction block")
        return None
    if h is None:
        raise ValueError("a multi-token-prediction block needs the hidden state each token follows")
    arr = np.ascontiguousarray(h, np.float32)
    if arr.shape != (n, w.cfg.dim):
        raise ValueError(f"the hidden states to follow must be ({n}, {w.cfg.dim}), got {arr.shape}")
    return arr


def run_batch(list states, list tokens, list positions, State work=None, list n_logits=None,
              list keep=None):
    """Run tokens[k] (int32 arrays, ids checked) at positions[k].. of
    states[k], all in one pass over the shared weights, in the work buffers
    of work (default: states[0]); returns the float32 logits of each
    sequence's last n_logits[k] tokens (default 1), sequence after
    sequence, (sum of n_logits, vocab). keep[k]: the pass may be rolled
    back for states[k] (State.rollback). Each sequence's results are
    exactly those of State.run alone."""
    cdef int n = len(states)
    if n < 1 or len(tokens) != n or len(positions) != n:
        raise ValueError("run_batch takes one token array and one position per state")
    if n_logits is not None and len(n_logits) != n or keep is not None and len(keep) != n:
        raise ValueError("run_batch takes one n_logits and one keep per state")
    cdef State first = states[0] if work is None else work
    cdef Weights w = first.weights
    if len({id(s) for s in states}) != n:
        raise ValueError("a state appears twice in one batch")
    cdef flm.FlmSeq *seqs = <flm.FlmSeq *>calloc(n, sizeof(flm.FlmSeq))
    if seqs == NULL:
        raise MemoryError()
    cdef State st
    cdef const int32_t[::1] ids
    cdef long long total = 0, pos, rows = 0
    cdef int want
    cdef cnp.ndarray[float, ndim=2, mode="c"] out
    cdef ForwardArgs job
    held = []   # the token arrays C reads, alive until it has run
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
            if ids.shape[0] > w.cfg.max_pass and flm.flm_state_rewind_room(&w.cfg, &st.s) >= 0:
                raise ValueError(f"{ids.shape[0]} tokens of one sequence in one batch: more than the "
                                 f"{w.cfg.max_pass} its sliding-window caches hold besides their window")
            _check_ids_at_boundary(ids, w.cfg.vocab_size)
            want = 1 if n_logits is None else n_logits[k]
            if not 0 <= want <= ids.shape[0]:
                raise ValueError(f"logits of {want} of a sequence's {ids.shape[0]} tokens")
            total += ids.shape[0]
            rows += want
            held.append(tokens[k])
            seqs[k].state = &st.s
            seqs[k].tokens = &ids[0]
            seqs[k].n = ids.shape[0]
            seqs[k].pos = <int>pos
            seqs[k].n_logits = want
        if total > first.s.max_batch:
            raise ValueError(f"{total} tokens in one batch: more than the {first.s.max_batch} "
                             "the work buffers hold")
        out = np.empty((max(rows, 1), w.cfg.vocab_size), np.float32)
        for k in range(n):
            seqs[k].state.keep = keep is not None and bool(keep[k])
        job.cfg, job.w, job.s, job.tokens, job.seqs = &w.cfg, &w.w, &first.s, NULL, seqs
        job.n, job.pos, job.all_logits, job.n_threads, job.logits = n, 0, 0, w._n_threads, &out[0, 0]
        _run_job(_forward_batch_job, &job)
    finally:
        for k in range(n):
            if seqs[k].state != NULL:
                seqs[k].state.keep = 0
        free(seqs)
    return out[:rows]


# Keys per block of attention's online softmax; a sliding-window layer's ring
# holds a whole number of them.
KEY_BLOCK = flm.FLM_KEY_BLOCK

_path_from_environment()
_prefetch_from_environment()
flm.flm_simd_path()   # pick the kernels now, before threads may race to
