"""Reading and writing the safetensors format without the safetensors package.

A file is an 8-byte little-endian header length, a JSON header mapping tensor
names to {dtype, shape, data_offsets}, then the raw bytes. The header is
checked against the file's size before anything is allocated. Tensors are
read either as fresh copies (what the model loader keeps) or as read-only
views of a memory map (no copy, for tools that only look).
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from ..spec.errors import ModelFileError
from ..spec.files import open_regular, read_bounded

# safetensors dtype -> (numpy dtype of the raw bytes, bytes per element).
# BF16 has no numpy dtype: it is exposed as uint16 bit patterns and turned into
# float32 by bf16_to_f32.
_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# The largest header accepted: safetensors itself refuses more. A header is
# three levels deep ({name: {"shape": [...]}}), so deeper JSON is refused
# before it is parsed rather than left to the parser's recursion limit.
_MAX_HEADER = 100 * 1024 * 1024
_MAX_HEADER_DEPTH = 3
_MAX_INDEX = 64 * 1024 * 1024
# Offsets and sizes past this are nonsense for any file that can exist.
_MAX_BYTES = 1 << 62


class SafetensorsFile:
    """One .safetensors file, checked against its size when opened.

    read() gives a fresh copy of a tensor, read with ordinary reads, so what
    it returns stays valid whatever happens to the file afterwards. raw()
    gives a read-only view of a memory map instead: no copy, but touching it
    after the file was truncated kills the process with SIGBUS.
    """

    def __init__(self, path):
        self.path = Path(path)
        self._file = open_regular(self.path, "safetensors file", buffering=0)
        self._map = None
        try:
            self._size = os.fstat(self._file.fileno()).st_size
            header = self._read_header()
        except BaseException:
            self._file.close()
            raise
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise ModelFileError(self.path, "header: __metadata__ is not a JSON object")
        data_len = self._size - self._data_start
        self._entries = {}
        for name, info in header.items():
            self._entries[name] = self._check_entry(name, info, data_len)
        self._check_no_overlap()

    def _read_header(self) -> dict:
        size = self._size
        if size < 8:
            raise ModelFileError(self.path, f"too short ({size} bytes) to be a safetensors file")
        self._file.seek(0)
        (n,) = struct.unpack("<Q", self._file.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise ModelFileError(self.path, f"header length {n} does not fit in a file of {size} bytes "
                                            f"(at most {_MAX_HEADER} bytes are allowed)")
        raw = self._file.read(n)
        if len(raw) != n:
            raise ModelFileError(self.path, "the file got shorter while its header was read")
        depth = json_depth(raw)
        if depth > _MAX_HEADER_DEPTH:
            raise ModelFileError(self.path, f"header JSON is nested {depth} levels deep; "
                                            f"a safetensors header has {_MAX_HEADER_DEPTH}")
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFileError(self.path, f"header is not valid JSON: {e}") from None
        if not isinstance(header, dict):
            raise ModelFileError(self.path, "header is not a JSON object")
        self._data_start = 8 + n
        return header

    def _check_entry(self, name, info, data_len):
        def bad(problem):
            return ModelFileError(self.path, f"tensor {name!r}: {problem} (header entry {str(info)[:200]})")

        if not isinstance(info, dict):
            raise bad("the entry is not a JSON object")
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
            raise bad(f"unsupported dtype {dtype_name!r}")
        # bool is an int in Python: true would pass as 1.
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise bad("shape is not a list of integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)):
            raise bad("data_offsets is not a list of two integers")
        if any(d < 0 for d in shape):
            raise bad(f"negative dimension in shape {shape}")
        shape = tuple(shape)
        dtype = _DTYPES[dtype_name]
        nbytes = math.prod(shape) * dtype.itemsize   # Python ints: no wrap-around
        begin, end = offsets
        if nbytes > _MAX_BYTES or not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise bad(f"data_offsets [{begin}, {end}] do not hold {dtype_name}{list(shape)} "
                      f"({nbytes} bytes) inside the {data_len}-byte data section")
        return dtype_name, shape, begin, end

    def _check_no_overlap(self):
        # Two tensors sharing bytes would silently read each other's data.
        spans = sorted((begin, end, name) for name, (_, _, begin, end) in self._entries.items() if end > begin)
        for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
            if begin_b < end_a:
                raise ModelFileError(self.path, f"tensors {a!r} and {b!r} overlap in the data section")

    def keys(self):
        return list(self._entries)

    def close(self):
        """Close the file; views raw() gave stay valid (the map holds its own reference)."""
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __contains__(self, name):
        return name in self._entries

    def dtype(self, name) -> str:
        return self._entries[name][0]

    def shape(self, name) -> tuple:
        return self._entries[name][1]

    def read(self, name, start: int = 0, stop: int | None = None) -> np.ndarray:
        """A fresh, writable copy of the tensor (BF16 as uint16 bit patterns),
        read with ordinary reads: a file that shrank since it was opened
        gives a ModelFileError, not a SIGBUS. start, stop: only the entries
        [start:stop] of its first axis, to read a big tensor a slice at a time."""
        dtype_name, shape, begin, end = self._entries[name]
        if shape:
            start, stop, _ = slice(start, stop).indices(shape[0])
            per_index = (end - begin) // shape[0] if shape[0] else 0
            shape = (max(stop - start, 0), *shape[1:])
            begin += start * per_index
        out = np.empty(shape, _DTYPES[dtype_name])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        try:
            self._file.seek(self._data_start + begin)
            while buf:   # one read returns at most ~2 GB
                got = self._file.readinto(buf)
                if not got:
                    raise ModelFileError(self.path, f"tensor {name!r}: the file ends before the tensor "
                                                    f"does; it was truncated after it was opened")
                buf = buf[got:]
        except OSError as e:
            raise ModelFileError(self.path, f"tensor {name!r}: cannot read: {e.strerror or e}") from None
        return out

    def raw(self, name) -> np.ndarray:
        """The tensor's bytes as a read-only view of a memory map (BF16 as
        uint16 bit patterns)."""
        dtype_name, shape, begin, _ = self._entries[name]
        dtype = _DTYPES[dtype_name]
        count = math.prod(shape)
        if count == 0:
            return np.zeros(shape, dtype)
        if self._map is None:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(self._map, dtype=dtype, count=count,
                             offset=self._data_start + begin).reshape(shape)

    def float32(self, name, a=None) -> np.ndarray:
        """The tensor (or a, its raw array rearranged) as float32: a view for
        F32, one converted copy otherwise."""
        dtype_name = self._entries[name][0]
        a = self.raw(name) if a is None else a
        if dtype_name == "F32":
            return a
        if dtype_name == "BF16":
            return bf16_to_f32(a)
        if dtype_name in ("F16", "F64"):
            return a.astype(np.float32)
        raise ModelFileError(self.path, f"tensor {name!r}: dtype {dtype_name} is not a float type")


# Per-byte lookup tables: one indexing pass each over the header.
def _byte_table(values: dict, dtype) -> np.ndarray:
    table = np.zeros(256, dtype)
    for ch, v in values.items():
        table[ord(ch)] = v
    return table


_IS_QUOTE = _byte_table({'"': True}, bool)
_IS_BACKSLASH = _byte_table({"\\": True}, bool)
_NESTING = _byte_table({"[": 1, "{": 1, "]": -1, "}": -1}, np.int64)


def json_depth(raw: bytes, chunk: int = 1 << 16) -> int:
    """How deeply the arrays and objects of a JSON text nest, in linear time
    and without recursion (brackets inside strings do not count). The text
    is scanned in chunks, the state carried over, so that another thread
    gets the GIL between them while a megabyte body is scanned."""
    depth = deepest = 0
    inside = 0      # 1 inside a string at the chunk's start
    slashes = 0     # backslashes ending the text before the chunk
    for start in range(0, len(raw), chunk):
        b = np.frombuffer(raw, np.uint8, min(chunk, len(raw) - start), start)
        i = np.arange(b.size)
        # A quote ends a string unless an odd run of backslashes precedes it.
        last_other = np.maximum.accumulate(np.where(_IS_BACKSLASH[b], -1 - slashes, i))
        run_before = np.concatenate(([slashes], i[:-1] - last_other[:-1]))
        quote = _IS_QUOTE[b] & ~(run_before % 2).astype(bool)
        strings = (np.cumsum(quote) + inside) % 2
        levels = depth + np.cumsum(np.where(strings == 0, _NESTING[b], 0))
        deepest = max(deepest, int(levels.max()))
        depth, inside, slashes = int(levels[-1]), int(strings[-1]), int(i[-1] - last_other[-1])
    return deepest


class Checkpoint:
    """The tensors of model.safetensors or of a sharded checkpoint."""

    def __init__(self, folder):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        self.files = {}
        self.where = {}
        if os.path.lexists(single):
            f = SafetensorsFile(single)
            self.files[single.name] = f
            self.where = {name: f for name in f.keys()}
        elif os.path.lexists(index):
            for name, shard in self._weight_map(index).items():
                if shard not in self.files:
                    self.files[shard] = SafetensorsFile(folder / shard)
                if name not in self.files[shard]:
                    raise ModelFileError(folder / shard, f"tensor {name!r} listed in the index is missing")
                self.where[name] = self.files[shard]
        else:
            raise ModelFileError(folder, "no model.safetensors or model.safetensors.index.json")

    @staticmethod
    def _weight_map(index: Path) -> dict:
        raw = read_bounded(index, _MAX_INDEX, "safetensors index")
        try:
            weight_map = json.loads(raw)["weight_map"]
        except (KeyError, TypeError, RecursionError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFileError(index, f"not a valid safetensors index: {type(e).__name__}: {e}") from None
        if not isinstance(weight_map, dict):
            raise ModelFileError(index, f"weight_map is a {type(weight_map).__name__}, not an object "
                                        f"mapping tensor names to shard files")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or Path(shard).name != shard:
                raise ModelFileError(index, f"weight_map[{name!r}]: shard {shard!r} is not a plain file name")
        return weight_map

    def __contains__(self, name):
        return name in self.where

    def close(self):
        for f in self.files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def file_of(self, name) -> SafetensorsFile:
        try:
            return self.where[name]
        except KeyError:
            raise ModelFileError(next(iter(self.files.values())).path if self.files else None,
                                 f"tensor {name!r} is missing") from None

def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an fp32: widen the bit pattern and shift."""
    out = np.empty(bits.shape, dtype=np.uint32)
    np.left_shift(bits, 16, out=out, dtype=np.uint32)
    return out.view(np.float32)


# Values rounded at a time: the rounding's uint32 temporaries stay a few MB
# whatever the tensor, so bf16 never needs more memory than float32 would.
_BF16_SLICE = 1 << 18


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bit patterns, nearest-even, NaN kept NaN (as torch does)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16)
    bits, rounded_bits = x.reshape(-1).view(np.uint32), out.reshape(-1)
    for start in range(0, bits.size, _BF16_SLICE):
        u = bits[start:start + _BF16_SLICE]
        rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
        nan = np.greater(u & np.uint32(0x7FFFFFFF), np.uint32(0x7F800000))
        rounded_bits[start:start + u.size] = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded)
    return out


def load_file(path) -> dict:
    """All tensors of a file as numpy arrays (memory-mapped views, BF16 as
    uint16 bits)."""
    f = SafetensorsFile(path)
    return {name: f.raw(name) for name in f.keys()}


_NP_TO_ST = {np.dtype(v).newbyteorder("<") if v.itemsize > 1 else v: k for k, v in _DTYPES.items() if k != "BF16"}


def save_file(path, tensors: dict, metadata: dict | None = None, bf16: bool = False) -> None:
    """Write tensors (numpy arrays) to a safetensors file.

    With bf16=True every float32 tensor is rounded to bf16 on the way out.
    Tensors are written one at a time, so peak memory is one tensor's copy.
    """
    entries, offset = {}, 0
    plan = []
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if bf16 and arr.dtype == np.float32:
            st_dtype, itemsize = "BF16", 2
        else:
            dt = arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
            if dt not in _NP_TO_ST:
                raise ValueError(f"{name}: cannot store numpy dtype {arr.dtype} in safetensors")
            st_dtype, itemsize = _NP_TO_ST[dt], arr.dtype.itemsize
        nbytes = arr.size * itemsize
        entries[name] = {"dtype": st_dtype, "shape": list(arr.shape),
                         "data_offsets": [offset, offset + nbytes]}
        plan.append((arr, st_dtype))
        offset += nbytes
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    header.update(entries)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr, st_dtype in plan:
            if st_dtype == "BF16":
                data = f32_to_bf16(arr)
            else:
                data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
            f.write(data.tobytes(order="C"))
