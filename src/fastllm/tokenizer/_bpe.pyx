# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""BPE merge loop and merge table for fastllm.tokenizer.

The merge order must reproduce HuggingFace `tokenizers` exactly, including its
quirks, because any divergence changes token ids.  `tokenizers` keeps a
min-heap of candidate merges ordered by (rank, position) and, when it pops a
candidate, only checks that the pair now at that position still merges into
the same token id (not that it has the same rank).  We keep the same heap and
the same staleness test instead of a simpler "lowest rank first" scan, so the
rare files where two different pairs merge into one token behave identically.
"""

from libc.stdlib cimport malloc, free, realloc
from libc.string cimport memcpy
from libc.stdint cimport uint64_t, uint32_t, int32_t, int64_t
from libc.string cimport memcmp
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_New, PyList_SET_ITEM, PyList_GET_ITEM, PyList_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF

cdef uint64_t EMPTY_KEY = 0xFFFFFFFFFFFFFFFFULL


cdef struct Entry:
    uint64_t key
    int32_t rank
    int32_t new_id


cdef struct Cand:
    int32_t rank
    int32_t pos
    int32_t new_id


cdef struct Sym:
    int32_t c
    int32_t prev
    int32_t next
    int32_t alive


cdef inline bint _room(Py_ssize_t count, uint64_t cap) noexcept nogil:
    # Whether cap slots (linear probing) hold count entries and one more
    # at most 3/4 full: a lookup then takes about 2 probes where it hits and
    # 4 where it misses, and the tables of a 151k-token vocabulary take half
    # the memory they take at most half full (8 MiB of merges, 2 of tokens).
    # A table never fills, so a search always ends at an empty slot.
    return count >= 0 and <uint64_t>(count + 1) * 4 <= cap * 3


cdef inline uint64_t _mix(uint64_t k) noexcept nogil:
    # splitmix64 finaliser: pair keys are highly structured (small ids), so a
    # plain modulo would cluster badly under linear probing.
    k ^= k >> 30
    k *= 0xBF58476D1CE4E5B9ULL
    k ^= k >> 27
    k *= 0x94D049BB133111EBULL
    k ^= k >> 31
    return k


cdef inline bint _cand_less(Cand a, Cand b) noexcept nogil:
    if a.rank != b.rank:
        return a.rank < b.rank
    return a.pos < b.pos


cdef class MergeTable:
    """Open-addressing hash map (left_id, right_id) -> (rank, merged_id)."""

    cdef Entry* table
    cdef uint64_t mask
    cdef Py_ssize_t count
    # Scratch buffers reused across calls; every method holds the GIL, so a
    # single table is never merged from two threads at once.
    cdef Sym* syms
    cdef Cand* heap
    cdef Py_ssize_t syms_cap
    cdef Py_ssize_t heap_cap

    def __cinit__(self, Py_ssize_t expected=0):
        cdef uint64_t cap = 16
        cdef uint64_t i
        while not _room(expected, cap):
            cap <<= 1
        self.table = <Entry*>malloc(cap * sizeof(Entry))
        if self.table == NULL:
            raise MemoryError()
        for i in range(cap):
            self.table[i].key = EMPTY_KEY
        self.mask = cap - 1
        self.count = 0
        self.syms = NULL
        self.heap = NULL
        self.syms_cap = 0
        self.heap_cap = 0

    def __dealloc__(self):
        free(self.table)
        free(self.syms)
        free(self.heap)

    def __len__(self):
        return self.count

    cdef void _grow(self) except *:
        cdef uint64_t old_cap = self.mask + 1
        cdef uint64_t new_cap = old_cap * 2
        cdef Entry* old = self.table
        cdef Entry* nt = <Entry*>malloc(new_cap * sizeof(Entry))
        cdef uint64_t i, j
        if nt == NULL:
            raise MemoryError()
        for i in range(new_cap):
            nt[i].key = EMPTY_KEY
        for i in range(old_cap):
            if old[i].key != EMPTY_KEY:
                j = _mix(old[i].key) & (new_cap - 1)
                while nt[j].key != EMPTY_KEY:
                    j = (j + 1) & (new_cap - 1)
                nt[j] = old[i]
        self.table = nt
        self.mask = new_cap - 1
        free(old)

    cdef inline void _put(self, int32_t a, int32_t b, int32_t rank, int32_t new_id) except *:
        cdef uint64_t key = (<uint64_t><uint32_t>a << 32) | <uint64_t><uint32_t>b
        cdef uint64_t j
        if not _room(self.count, self.mask + 1):
            self._grow()
        j = _mix(key) & self.mask
        while self.table[j].key != EMPTY_KEY:
            if self.table[j].key == key:
                # A repeated pair keeps the later rank, as a Rust HashMap
                # collected from the merges list does.
                self.table[j].rank = rank
                self.table[j].new_id = new_id
                return
            j = (j + 1) & self.mask
        self.table[j].key = key
        self.table[j].rank = rank
        self.table[j].new_id = new_id
        self.count += 1

    cdef inline Entry* _get(self, int32_t a, int32_t b) noexcept nogil:
        cdef uint64_t key = (<uint64_t><uint32_t>a << 32) | <uint64_t><uint32_t>b
        cdef uint64_t j = _mix(key) & self.mask
        while self.table[j].key != EMPTY_KEY:
            if self.table[j].key == key:
                return &self.table[j]
            j = (j + 1) & self.mask
        return NULL

    def add(self, int a, int b, int rank, int new_id):
        self._put(a, b, rank, new_id)

    def get(self, int a, int b):
        cdef Entry* e = self._get(a, b)
        if e == NULL:
            return None
        return (e.rank, e.new_id)

    def to_bytes(self):
        """The table as bytes (its slots as they are in memory), for from_bytes."""
        return (<char *>self.table)[:(self.mask + 1) * sizeof(Entry)], self.count

    @staticmethod
    def from_bytes(const unsigned char[::1] data, Py_ssize_t count):
        """A table from what to_bytes gave (on this machine): slots whose
        number is a power of two, with room as _room gives it."""
        cdef Py_ssize_t n = data.shape[0]
        cdef uint64_t cap = <uint64_t>n // sizeof(Entry)
        if n % sizeof(Entry) or cap < 16 or cap & (cap - 1) or not 0 <= count or not _room(count, cap):
            raise ValueError("not the bytes of a merge table")
        cdef MergeTable t = MergeTable(0)
        cdef Entry *slots = <Entry *>malloc(n)
        if slots == NULL:
            raise MemoryError()
        memcpy(slots, &data[0], n)
        cdef uint64_t i
        cdef Py_ssize_t used = 0
        for i in range(cap):
            if slots[i].key != EMPTY_KEY:
                used += 1
        if used != count:
            free(slots)
            raise ValueError("not the bytes of a merge table")
        free(t.table)
        t.table, t.mask, t.count = slots, cap - 1, count
        return t

    def load_merges(self, list merges, dict vocab, Py_ssize_t prefix_len):
        """Fill the table from tokenizer.json merges.

        Each merge is either "left right" or [left, right].  The merged token is
        left + right[prefix_len:], where prefix_len is the length of the
        continuing-subword prefix that the right half carries.  Returns None,
        or (index, missing_token) for the first merge naming a token absent
        from the vocabulary (missing_token is None for a malformed entry).
        """
        cdef Py_ssize_t i, n = len(merges)
        cdef object m, left, right, merged, parts
        cdef PyObject* ia
        cdef PyObject* ib
        cdef PyObject* inew
        for i in range(n):
            m = merges[i]
            if type(m) is list and PyList_GET_SIZE(m) == 2:
                left = <object>PyList_GET_ITEM(m, 0)
                right = <object>PyList_GET_ITEM(m, 1)
            elif type(m) is str:
                parts = (<str>m).split(" ")
                if len(parts) != 2:
                    return (i, None)
                left = parts[0]
                right = parts[1]
            elif isinstance(m, (list, tuple)) and len(m) == 2:
                left = m[0]
                right = m[1]
            else:
                return (i, None)
            if type(left) is not str or type(right) is not str:
                return (i, None)
            ia = PyDict_GetItem(vocab, left)
            if ia == NULL:
                return (i, left)
            ib = PyDict_GetItem(vocab, right)
            if ib == NULL:
                return (i, right)
            if prefix_len:
                merged = left + right[prefix_len:]
            else:
                merged = left + right
            inew = PyDict_GetItem(vocab, merged)
            if inew == NULL:
                return (i, merged)
            self._put(<int32_t>(<object>ia), <int32_t>(<object>ib), <int32_t>i, <int32_t>(<object>inew))
        return None

    cdef int _reserve(self, Py_ssize_t n) except -1:
        cdef Sym* s
        cdef Cand* h
        if n > self.syms_cap:
            s = <Sym*>realloc(self.syms, n * sizeof(Sym))
            if s == NULL:
                raise MemoryError()
            self.syms = s
            self.syms_cap = n
        # Every merge pushes at most two candidates, plus the initial n - 1.
        if 3 * n > self.heap_cap:
            h = <Cand*>realloc(self.heap, 3 * n * sizeof(Cand))
            if h == NULL:
                raise MemoryError()
            self.heap = h
            self.heap_cap = 3 * n
        return 0

    cdef Py_ssize_t _merge(self, Py_ssize_t n) noexcept nogil:
        """Merge self.syms[0:n] in place; returns the number of live symbols."""
        cdef Sym* syms = self.syms
        cdef Cand* heap = self.heap
        cdef Py_ssize_t hn = 0
        cdef Py_ssize_t i, k, child, alive
        cdef Cand top, cand, tmp
        cdef Entry* e
        cdef int32_t nxt, prv, rnext

        for i in range(n - 1):
            e = self._get(syms[i].c, syms[i + 1].c)
            if e != NULL:
                cand.rank = e.rank
                cand.pos = <int32_t>i
                cand.new_id = e.new_id
                # sift up
                k = hn
                hn += 1
                while k > 0 and _cand_less(cand, heap[(k - 1) >> 1]):
                    heap[k] = heap[(k - 1) >> 1]
                    k = (k - 1) >> 1
                heap[k] = cand

        while hn > 0:
            top = heap[0]
            hn -= 1
            if hn > 0:
                tmp = heap[hn]
                k = 0
                while True:
                    child = 2 * k + 1
                    if child >= hn:
                        break
                    if child + 1 < hn and _cand_less(heap[child + 1], heap[child]):
                        child += 1
                    if _cand_less(heap[child], tmp):
                        heap[k] = heap[child]
                        k = child
                    else:
                        break
                heap[k] = tmp

            if not syms[top.pos].alive:
                continue
            nxt = syms[top.pos].next
            if nxt < 0:
                continue
            e = self._get(syms[top.pos].c, syms[nxt].c)
            if e == NULL or e.new_id != top.new_id:
                continue

            syms[top.pos].c = top.new_id
            rnext = syms[nxt].next
            syms[top.pos].next = rnext
            syms[nxt].alive = 0
            if rnext >= 0:
                syms[rnext].prev = top.pos

            prv = syms[top.pos].prev
            if prv >= 0:
                e = self._get(syms[prv].c, syms[top.pos].c)
                if e != NULL:
                    cand.rank = e.rank
                    cand.pos = prv
                    cand.new_id = e.new_id
                    k = hn
                    hn += 1
                    while k > 0 and _cand_less(cand, heap[(k - 1) >> 1]):
                        heap[k] = heap[(k - 1) >> 1]
                        k = (k - 1) >> 1
                    heap[k] = cand
            if rnext >= 0:
                e = self._get(syms[top.pos].c, syms[rnext].c)
                if e != NULL:
                    cand.rank = e.rank
                    cand.pos = top.pos
                    cand.new_id = e.new_id
                    k = hn
                    hn += 1
                    while k > 0 and _cand_less(cand, heap[(k - 1) >> 1]):
                        heap[k] = heap[(k - 1) >> 1]
                        k = (k - 1) >> 1
                    heap[k] = cand

        alive = 0
        for i in range(n):
            if syms[i].alive:
                syms[alive].c = syms[i].c
                alive += 1
        return alive

    cdef list _run(self, Py_ssize_t n):
        cdef Py_ssize_t m = self._merge(n)
        cdef list out = PyList_New(m)
        cdef Py_ssize_t i
        cdef object v
        for i in range(m):
            v = self.syms[i].c
            Py_INCREF(v)
            PyList_SET_ITEM(out, i, v)
        return out

    cdef inline void _init_sym(self, Py_ssize_t i, Py_ssize_t n, int32_t c) noexcept nogil:
        self.syms[i].c = c
        self.syms[i].prev = <int32_t>(i - 1)
        self.syms[i].next = <int32_t>(i + 1) if i + 1 < n else -1
        self.syms[i].alive = 1

    def merge_ids(self, list ids):
        """Run BPE merges over a word given as its initial symbol ids."""
        cdef Py_ssize_t n = len(ids), i
        if n < 2:
            return list(ids)
        self._reserve(n)
        for i in range(n):
            self._init_sym(i, n, <int32_t>ids[i])
        return self._run(n)

    def merge_bytes(self, bytes data, int32_t[::1] byte_ids):
        """Run BPE over the bytes of one pre-token (byte-level models).

        byte_ids maps each byte value to the vocabulary id of its byte-level
        character; every entry must be valid (callers check this once).
        """
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data), i
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
        cdef list out
        cdef object v
        if n == 1:
            v = byte_ids[p[0]]
            return [v]
        if n == 0:
            return []
        self._reserve(n)
        for i in range(n):
            self._init_sym(i, n, byte_ids[p[i]])
        return self._run(n)


def encode_pieces(list pieces, dict cache, object miss, Py_ssize_t cache_limit):
    """Encode pre-tokens through the piece cache; returns all ids.

    The cache maps a pre-token string to its list of ids; `miss(piece)`
    computes the ids of a piece not in the cache.  This is the hot loop of
    encoding (most pieces of real text are cache hits), so it stays in C.
    """
    cdef list out = []
    cdef Py_ssize_t i, n = len(pieces)
    cdef object piece, hit
    for i in range(n):
        piece = pieces[i]
        hit = cache.get(piece)
        if hit is None:
            hit = miss(piece)
            if len(cache) >= cache_limit:
                cache.clear()
            cache[piece] = hit
        out.extend(<list>hit)
    return out


cdef inline uint64_t _hash_bytes(const char *p, Py_ssize_t n) noexcept nogil:
    # FNV-1a over the bytes, then _mix: token texts are short.
    cdef uint64_t h = 0xCBF29CE484222325ULL
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ <unsigned char>p[i]) * 0x100000001B3ULL
    return _mix(h ^ <uint64_t>n)


cdef class Vocab:
    """A BPE model's vocabulary, token -> id, kept compact: the tokens'
    UTF-8 bytes in one buffer, their offsets and ids, and an open-addressing
    table of their indices: about 20 bytes a token beside its text, where a
    dict of str and int takes about 120 (30 MB for a 248k vocabulary). It
    reads like that dict (get, [], in, len, iteration, keys, values, items,
    in the order the tokens came)."""

    cdef bytes blob
    cdef object _offsets, _ids   # int64 and uint32 arrays (buffers the pointers below read)
    cdef const int64_t *off
    cdef const uint32_t *idp
    cdef int32_t *slots
    cdef uint64_t mask
    cdef Py_ssize_t n

    def __cinit__(self):
        self.slots = NULL
        self.n = 0

    def __dealloc__(self):
        free(self.slots)

    @staticmethod
    def from_dict(dict vocab):
        """The Vocab of a dict of str -> int (ids from 0 to 2**32-1);
        UnicodeEncodeError (a ValueError) for a token with a lone surrogate,
        which has no UTF-8 bytes."""
        import numpy as np
        texts = [k.encode("utf-8") for k in vocab]
        offsets = np.zeros(len(texts) + 1, np.int64)
        np.cumsum([len(t) for t in texts], out=offsets[1:])
        ids = np.fromiter(vocab.values(), np.int64, len(texts))
        return Vocab.from_parts(b"".join(texts), offsets, ids)

    @staticmethod
    def from_parts(bytes blob, offsets, ids):
        """The Vocab of tokens blob[offsets[i]:offsets[i+1]] (UTF-8) with ids
        ids[i]; ValueError unless the parts hold together (offsets rising
        within blob, each token whole UTF-8, ids whole numbers from 0 to
        2**32-1, no token twice)."""
        import numpy as np
        offsets = np.asarray(offsets)
        ids = np.asarray(ids)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets.dtype.kind not in "iu" or ids.dtype.kind not in "iu" \
                or ids.shape != (len(offsets) - 1,) or offsets[0] != 0 or offsets[len(offsets) - 1] != len(blob) \
                or np.any(np.diff(offsets) < 0) or np.any(ids < 0) or np.any(ids >= 2**32):
            raise ValueError("not the parts of a vocabulary")
        offsets = np.ascontiguousarray(offsets, np.int64)
        # Valid UTF-8 as a whole, and no token starting on a continuation
        # byte: then every token's bytes are valid UTF-8 by themselves.
        blob.decode("utf-8")
        starts = offsets[:len(offsets) - 1]
        starts = starts[starts < len(blob)]
        if np.any((np.frombuffer(blob, np.uint8)[starts] & 0xC0) == 0x80):
            raise ValueError("a token of the vocabulary starts inside a character")
        cdef Vocab v = Vocab()
        v.blob = blob
        v._offsets = offsets
        v._ids = np.ascontiguousarray(ids, np.uint32)
        cdef const int64_t[::1] o = v._offsets
        cdef const uint32_t[::1] d = v._ids
        v.off = &o[0]
        v.idp = &d[0] if d.shape[0] else NULL
        v.n = d.shape[0]
        v._build()
        return v

    cdef int _build(self) except -1:
        cdef uint64_t cap = 16, j
        cdef Py_ssize_t i
        cdef const char *base = self.blob
        while not _room(self.n, cap):
            cap <<= 1
        self.slots = <int32_t *>malloc(cap * sizeof(int32_t))
        if self.slots == NULL:
            raise MemoryError()
        for j in range(cap):
            self.slots[j] = -1
        self.mask = cap - 1
        for i in range(self.n):
            if self._index(base + self.off[i], self.off[i + 1] - self.off[i]) >= 0:
                raise ValueError("a token appears twice in the vocabulary")
            j = _hash_bytes(base + self.off[i], self.off[i + 1] - self.off[i]) & self.mask
            while self.slots[j] >= 0:
                j = (j + 1) & self.mask
            self.slots[j] = <int32_t>i
        return 0

    cdef Py_ssize_t _index(self, const char *p, Py_ssize_t size) noexcept:
        """The index of the token with these bytes, or -1."""
        cdef uint64_t j = _hash_bytes(p, size) & self.mask
        cdef int32_t i
        cdef const char *base = self.blob
        while True:
            i = self.slots[j]
            if i < 0:
                return -1
            if self.off[i + 1] - self.off[i] == size and memcmp(base + self.off[i], p, size) == 0:
                return i
            j = (j + 1) & self.mask

    cdef Py_ssize_t _index_of(self, key) except -2:
        cdef Py_ssize_t size
        cdef const char *p
        if type(key) is not str:
            return -1
        try:
            p = PyUnicode_AsUTF8AndSize(key, &size)
        except UnicodeEncodeError:   # a lone surrogate: in no vocabulary
            return -1
        return self._index(p, size)

    cdef str _token(self, Py_ssize_t i):
        cdef const char *base = self.blob
        return PyUnicode_DecodeUTF8(base + self.off[i], self.off[i + 1] - self.off[i], NULL)

    def get(self, key, default=None):
        cdef Py_ssize_t i = self._index_of(key)
        return default if i < 0 else self.idp[i]

    def __getitem__(self, key):
        cdef Py_ssize_t i = self._index_of(key)
        if i < 0:
            raise KeyError(key)
        return self.idp[i]

    def __contains__(self, key):
        return self._index_of(key) >= 0

    def __len__(self):
        return self.n

    def __iter__(self):
        cdef Py_ssize_t i
        for i in range(self.n):
            yield self._token(i)

    def keys(self):
        return list(self)

    def values(self):
        return [self.idp[i] for i in range(self.n)]

    def items(self):
        cdef Py_ssize_t i
        return [(self._token(i), self.idp[i]) for i in range(self.n)]

    def parts(self):
        """(blob, offsets, ids): what from_parts takes."""
        return self.blob, self._offsets, self._ids
