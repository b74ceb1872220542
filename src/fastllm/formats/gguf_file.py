"""Reading the GGUF container: header, metadata and tensor table, bounded.

A GGUF file is a header (magic, version, tensor and key counts), the
metadata key/value pairs, a table of tensor infos (name, dims, type, offset)
and then the tensor data, aligned. Every count, length and offset in it is
checked against what is left of the file before anything is allocated or
looped over, so a few bytes claiming 2**40 entries fail at once with a
ModelFileError naming the file and the field, instead of running for ever.

Tensor data is read with ordinary reads, not mapped, so a file truncated
while it is converted gives an error rather than SIGBUS. The ``gguf``
package supplies only the quantization tables and the dequantizers.
"""
from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..spec.errors import ConversionError, ModelFileError  # noqa: F401 (ConversionError: importers name it from here)
from ..spec.files import open_regular, read_at
from ..core import _core

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# ggml's limits: tensors have at most 4 dimensions; names are short. An
# array longer than this is no vocabulary or merge list anyone ships.
_MAX_DIMS = 4
_MAX_ARRAY = 1 << 24
_CHUNK = 1 << 20

# GGUF value type -> struct format of one scalar (8 is a string, 9 an array).
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
               7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}


class GGUFError(ModelFileError):
    """A GGUF file whose container is malformed; the message says where."""




class GGUFTensor(NamedTuple):
    name: str
    tensor_type: object   # gguf.GGMLQuantizationType
    dims: tuple           # GGUF order: the row length first
    n_bytes: int
    offset: int           # from the start of the file

    @property
    def shape(self) -> tuple:
        """numpy / HF order: the row length last."""
        return tuple(reversed(self.dims))


_U64 = struct.Struct("<Q")


class _Cursor:
    """Sequential reads of a file whose size is known, refusing any read
    that would pass its end; the file is read in chunks as it is walked."""

    def __init__(self, f, size: int, path: Path, pos: int = 0):
        """pos: the offset f is at, where the walk starts."""
        self.f, self.size, self.path = f, size, path
        self.buf = bytearray()
        self.base = pos   # file offset of buf[0]
        self.pos = pos

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left():
            raise GGUFError(self.path, f"{what} needs {n} bytes at offset {self.pos}, "
                                       f"past the end of the {self.size}-byte file")
        end = self.pos + n
        have = self.base + len(self.buf)
        if end > have:
            del self.buf[:self.pos - self.base]
            self.base = self.pos
            want = max(end - self.pos - len(self.buf), min(_CHUNK, self.size - have))
            chunk = self.f.read(want)
            self.buf += chunk
            if self.base + len(self.buf) < end:
                raise GGUFError(self.path, f"the file got shorter while {what} was read")
        start = self.pos - self.base
        self.pos = end
        return memoryview(self.buf)[start:start + n]

    def unpack(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))[0]

    def strings(self, count: int, what: str, keep: bool = True):
        """count strings (a vocabulary: 10^5 of them), read straight out of
        the buffer where they lie whole in it; None where not kept, which
        skips them undecoded."""
        if not keep:
            done = 0
            while done < count:
                start = self.pos - self.base
                end, walked = _core.skip_strings(self.buf, start, count - done)
                self.pos += end - start
                done += walked
                if done < count:   # one the buffer does not hold whole: refill, check the file's end
                    self.string(f"{what}[{done}]")
                    done += 1
            return None
        out = []
        length = _U64.unpack_from
        for i in range(count):
            start = self.pos - self.base
            if start + 8 <= len(self.buf):
                (n,) = length(self.buf, start)
                end = start + 8 + n
                if end <= len(self.buf):
                    self.pos += 8 + n
                    try:
                        out.append(self.buf[start + 8:end].decode("utf-8"))
                    except UnicodeDecodeError as e:
                        raise GGUFError(self.path, f"{what}[{i}] is not valid UTF-8 "
                                                   f"({e.reason} at byte {e.start})") from None
                    continue
            out.append(self.string(f"{what}[{i}]"))   # refills the buffer, checks the file's end
        return out

    def string(self, what: str) -> str:
        n = self.unpack("Q", f"the length of {what}")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(self.path, f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


class GGUFContents(NamedTuple):
    version: int
    metadata: dict
    tensors: list   # of GGUFTensor, in file order
    data_start: int
    array_lengths: dict = {}   # key -> elements, for every array (those not decoded too)
    string_spans: dict = {}    # key -> (file offset, elements) of each string array not decoded


def _value(cur: _Cursor, vtype: int, what: str, keep_strings: bool = True, lengths: dict | None = None,
           key: str | None = None, spans: dict | None = None):
    if vtype == _STRING:
        return cur.string(what)
    if vtype in _SCALARS:
        return cur.unpack(_SCALARS[vtype], what)
    if vtype != _ARRAY:
        raise GGUFError(cur.path, f"{what} has unknown value type {vtype}")
    itype = cur.unpack("I", f"the element type of {what}")
    count = cur.unpack("Q", f"the length of {what}")
    if itype == _ARRAY:
        raise GGUFError(cur.path, f"{what} is an array of arrays, which GGUF readers do not support")
    if itype == _STRING:
        least = 8
    elif itype in _SCALARS:
        least = struct.calcsize(_SCALARS[itype])
    else:
        raise GGUFError(cur.path, f"{what} is an array of unknown value type {itype}")
    if count > _MAX_ARRAY or count * least > cur.left():
        raise GGUFError(cur.path, f"{what} claims {count} {_TYPE_NAMES[itype]} elements, more than "
                                  f"the {cur.left()} bytes left in the file can hold")
    if lengths is not None:
        lengths[key] = count
    if itype == _STRING:
        if not keep_strings and spans is not None:
            spans[key] = (cur.pos, count)
        return cur.strings(count, what, keep_strings)
    raw = cur.take(count * least, what)
    return np.frombuffer(raw, np.dtype("<" + _SCALARS[itype]), count).tolist()


def _tensor_info(cur: _Cursor, index: int, gguf) -> tuple:
    name = cur.string(f"the name of tensor {index}")
    what = f"tensor {name!r}"
    n_dims = cur.unpack("I", f"the dimension count of {what}")
    if n_dims > _MAX_DIMS:
        raise GGUFError(cur.path, f"{what} has {n_dims} dimensions; ggml allows at most {_MAX_DIMS}")
    dims = tuple(cur.unpack("Q", f"dimension {d} of {what}") for d in range(n_dims))
    raw_type = cur.unpack("I", f"the type of {what}")
    offset = cur.unpack("Q", f"the data offset of {what}")
    try:
        ttype = gguf.GGMLQuantizationType(raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[ttype]
    except (ValueError, KeyError):
        raise GGUFError(cur.path, f"{what} has unknown tensor type {raw_type}") from None
    row = dims[0] if dims else 1
    if row % block:
        raise GGUFError(cur.path, f"{what}: rows of {row} values are not whole {ttype.name} blocks of {block}")
    n_bytes = math.prod(dims) // block * type_size   # Python ints: no wrap-around
    return name, ttype, dims, n_bytes, offset


def read_gguf(path, gguf, string_arrays: bool = True) -> GGUFContents:
    """The metadata (key -> str, number, bool or list) and tensor table of
    the GGUF file at path, every size checked against the file's. Without
    string_arrays, arrays of strings (the vocabulary, the merges) are
    walked but not decoded, and read as None: loading the tensors needs
    only the rest, and their counts (array_lengths) can be checked against
    the tensors before a vocabulary is built; read_string_arrays decodes
    them later from where they lie (string_spans), without a second walk
    of the header."""
    path = Path(path)
    with open_regular(path, "GGUF file") as f:
        size = os.fstat(f.fileno()).st_size
        cur = _Cursor(f, size, path)
        if bytes(cur.take(4, "the magic")) != _MAGIC:
            raise GGUFError(path, "not a GGUF file (it does not start with the GGUF magic)")
        version = cur.unpack("I", "the version")
        if version & 0xFFFF == 0 and version:
            raise GGUFError(path, "big-endian GGUF files are not supported")
        if version not in _VERSIONS:
            raise GGUFError(path, f"GGUF version {version} is not supported (only {_VERSIONS})")
        n_tensors = cur.unpack("Q", "the tensor count")
        n_kv = cur.unpack("Q", "the metadata key count")
        # A key/value takes at least 13 bytes, a tensor info at least 24.
        if n_kv * 13 + n_tensors * 24 > cur.left():
            raise GGUFError(path, f"{n_kv} metadata keys and {n_tensors} tensors cannot fit in "
                                  f"the {size}-byte file")
        metadata, lengths, strings = {}, {}, {}
        for i in range(n_kv):
            key = cur.string(f"the name of metadata key {i}")
            if key in metadata:
                raise GGUFError(path, f"metadata key {key!r} appears twice")
            vtype = cur.unpack("I", f"the value type of {key!r}")
            metadata[key] = _value(cur, vtype, f"metadata {key!r}", string_arrays, lengths, key, strings)
        infos = [_tensor_info(cur, i, gguf) for i in range(n_tensors)]
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(path, f"general.alignment {alignment!r} is not a positive power of two")
        data_start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, ttype, dims, n_bytes, offset in infos:
        if name in names:
            raise GGUFError(path, f"tensor {name!r} appears twice")
        names.add(name)
        if offset % alignment:
            raise GGUFError(path, f"tensor {name!r}: data offset {offset} is not a multiple of "
                                  f"the alignment {alignment}")
        if data_start + offset + n_bytes > size:
            raise GGUFError(path, f"tensor {name!r}: {n_bytes} bytes at data offset {offset} run past "
                                  f"the end of the {size}-byte file")
        tensors.append(GGUFTensor(name, ttype, dims, n_bytes, data_start + offset))
    spans = sorted((t.offset, t.offset + t.n_bytes, t.name) for t in tensors if t.n_bytes)
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise GGUFError(path, f"tensors {a!r} and {b!r} overlap in the data section")
    return GGUFContents(version, metadata, tensors, data_start, lengths, strings)


def read_string_arrays(path, contents: GGUFContents) -> GGUFContents:
    """contents, read by read_gguf without string_arrays, with those arrays
    decoded from the places its walk of the header found them. Each string
    is checked as read_gguf checks it (its length against the file's end,
    its UTF-8), and a file cut short since the walk is refused."""
    path = Path(path)
    if not contents.string_spans:
        return contents
    metadata = dict(contents.metadata)
    with open_regular(path, "GGUF file") as f:
        size = os.fstat(f.fileno()).st_size
        if size < max((t.offset + t.n_bytes for t in contents.tensors), default=contents.data_start):
            raise GGUFError(path, "the file got shorter since its header was read")
        for key, (offset, count) in contents.string_spans.items():
            f.seek(offset)
            metadata[key] = _Cursor(f, size, path, offset).strings(count, f"metadata {key!r}")
    return contents._replace(metadata=metadata, string_spans={})


def read_tensor_bytes(path, tensor: GGUFTensor, start: int = 0, length: int | None = None) -> np.ndarray:
    """The raw bytes of one tensor (or of length of them from start), as a
    fresh uint8 array."""
    if length is None:
        length = tensor.n_bytes - start
    if not 0 <= start <= start + length <= tensor.n_bytes:
        raise ValueError(f"bytes {start}..{start + length} are not within tensor {tensor.name!r} "
                         f"of {tensor.n_bytes} bytes")
    out = np.empty(length, np.uint8)
    with open_regular(path, "GGUF file") as f:
        got = read_at(f, out, tensor.offset + start)
    if got != length:
        raise GGUFError(path, f"tensor {tensor.name!r}: the file ends before the tensor does; "
                              f"it was truncated after it was opened")
    return out
