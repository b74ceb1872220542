"""Reading and writing the safetensors format without the safetensors package.

A file is an 8-byte little-endian header length, a JSON header mapping tensor
names to {dtype, shape, data_offsets}, then the raw bytes. Tensors are
returned as read-only numpy views of one memory map, so loading costs no copy
and no more memory than the pages actually touched.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import ModelFileError

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
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One memory-mapped .safetensors file. Tensors stay valid while it lives."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            fd = open(self.path, "rb")
        except OSError as e:
            raise ModelFileError(self.path, f"cannot open: {e.strerror}") from None
        with fd:
            size = os.fstat(fd.fileno()).st_size
            if size < 8:
                raise ModelFileError(self.path, f"too short ({size} bytes) to be a safetensors file")
            (n,) = struct.unpack("<Q", fd.read(8))
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelFileError(self.path, f"header length {n} does not fit in a file of {size} bytes")
            try:
                header = json.loads(fd.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelFileError(self.path, f"header is not valid JSON: {e}") from None
            if not isinstance(header, dict):
                raise ModelFileError(self.path, "header is not a JSON object")
            self.metadata = header.pop("__metadata__", None) or {}
            self._map = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self._data_start = 8 + n
        data_len = size - self._data_start
        self._entries = {}
        for name, info in header.items():
            self._entries[name] = self._check_entry(name, info, data_len)

    def _check_entry(self, name, info, data_len):
        try:
            dtype_name = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(self.path, f"tensor {name!r}: malformed header entry {info!r}") from None
        if dtype_name not in _DTYPES:
            raise ModelFileError(self.path, f"tensor {name!r}: unsupported dtype {dtype_name}")
        if any(d < 0 for d in shape):
            raise ModelFileError(self.path, f"tensor {name!r}: negative dimension in shape {shape}")
        dtype = _DTYPES[dtype_name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise ModelFileError(
                self.path,
                f"tensor {name!r}: data_offsets [{begin}, {end}] do not hold {dtype_name}{list(shape)} "
                f"({nbytes} bytes) inside the {data_len}-byte data section")
        return dtype_name, shape, begin

    def keys(self):
        return list(self._entries)

    def __contains__(self, name):
        return name in self._entries

    def dtype(self, name) -> str:
        return self._entries[name][0]

    def shape(self, name) -> tuple:
        return self._entries[name][1]

    def raw(self, name) -> np.ndarray:
        """The tensor's bytes as a read-only array (BF16 as uint16 bit patterns)."""
        dtype_name, shape, begin = self._entries[name]
        dtype = _DTYPES[dtype_name]
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.zeros(shape, dtype)
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

    def release(self, name):
        """Tell the kernel the pages of a tensor that was copied elsewhere are
        no longer needed, so they stop counting towards resident memory."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        _, shape, begin = self._entries[name]
        start = self._data_start + begin
        end = start + self.raw(name).nbytes
        page = mmap.PAGESIZE
        start = -(-start // page) * page
        end = end // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


class Checkpoint:
    """The tensors of model.safetensors or of a sharded checkpoint."""

    def __init__(self, folder):
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        self.files = {}
        self.where = {}
        if single.exists():
            f = SafetensorsFile(single)
            self.files[single.name] = f
            self.where = {name: f for name in f.keys()}
        elif index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelFileError(index, f"not a valid safetensors index: {e}") from None
            for name, shard in weight_map.items():
                if shard not in self.files:
                    if Path(shard).name != shard:
                        raise ModelFileError(index, f"shard name {shard!r} is not a plain file name")
                    self.files[shard] = SafetensorsFile(folder / shard)
                if name not in self.files[shard]:
                    raise ModelFileError(folder / shard, f"tensor {name!r} listed in the index is missing")
                self.where[name] = self.files[shard]
        else:
            raise ModelFileError(folder, "no model.safetensors or model.safetensors.index.json")

    def __contains__(self, name):
        return name in self.where

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


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bit patterns, nearest-even, NaN kept NaN (as torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16)


def load_file(path) -> dict:
    """All tensors of a file as numpy arrays (memory-mapped, BF16 as uint16 bits)."""
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
