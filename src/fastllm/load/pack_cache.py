"""Packed weights kept on disk, so that a model is packed once.

Loading repacks every matrix of a checkpoint into the run loop's panels
(csrc/gemm.h, quant.h), which costs far more than reading the file. The
first load of a model writes what it packed into one cache file under
$FASTLLM_HOME/packed/; later loads map that file read-only and shared, so
they cost what reading it from the page cache costs, and processes that
serve the same model share its physical pages.

A cache file is named after what it was made from (the source's path and
the load options), and holds what makes it valid: the source's identity
(size, modification time, a hash of its first and last bytes and of a
sample of the rest), the layout version of the panels (FLM_PACK_LAYOUT),
the SIMD and int8 paths, the machine, and a digest of fastllm's own code.
It is only used when all of them match and its checksums (of its header,
its manifest and all of its data) hold; else it is rebuilt. Reading all
of its data for the checksum costs as much again as the first pass over
the weights, so once a file has been checked whole, a record beside it
(NAME.checked) says so, with the file's inode, size and change times and
the machine's boot: a later load in the same boot, of that same unchanged
file, skips the data's checksum (any write to the file, even one that
puts its modification time back, moves its change time). Files are
written to a temporary name and renamed into place, so a reader sees a
whole file or none; a process that finds another filling the same cache
waits for it (a lock file) and then maps its result. A rebuilt cache
replaces the old one (same name), and files whose source is gone are
deleted whenever a cache is written. Files are made read-only: a mapped
file that is truncated under a running model would crash it (SIGBUS).

FASTLLM_PACK_CACHE=0 (or pack_cache=False, `--no-cache`) turns it off.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
import struct
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import importlib
import ctypes

from ..core import _core

try:
    import fcntl
except ImportError:   # Windows: no lock; the rename alone keeps files whole
    fcntl = None
from .hub import cache_dir
from ..spec.files import open_regular
from ..spec.version import __version__
from ..spec.errors import ModelFileError

# Bumped when the file's format, or what load_weights/load_gguf_weights put
# in a model's arrays, changes (the code digest below catches the rest).
FORMAT = 2
MAGIC = b"FLMPACK\0"
SUFFIX = ".flmpack"
# magic, format, manifest bytes, data offset, data bytes, data checksum,
# manifest checksum, then the checksum of those 48 bytes.
_HEAD = struct.Struct("<8sIIQQQQ")
_HEAD_BYTES = 64
_ALIGN = 64                  # every array starts on a cache line
_PAGE = 4096                 # the data starts on a page
_MAX_MANIFEST = 64 << 20
# Source identity, beside its size and time: its first and last bytes and
# evenly spaced samples of the rest (2 MiB of any file).
_HEAD_HASHED = 1 << 20
_TAIL_HASHED = 64 << 10
_SAMPLES, _SAMPLE_BYTES = 64, 16 << 10
_DTYPES = {"<f4": np.float32, "<u2": np.uint16, "<f2": np.float16, "|u1": np.uint8, "<i8": np.int64}


class CacheInvalid(Exception):
    """A cache file that cannot be used: the message says why."""


def enabled(asked: bool | None) -> bool:
    """Whether to use the cache: asked, else FASTLLM_PACK_CACHE (on unless 0/false/no/off)."""
    if asked is not None:
        return bool(asked)
    return os.environ.get("FASTLLM_PACK_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def folder() -> Path:
    return cache_dir() / "packed"


def disk_use() -> tuple:
    """(number of cache files, their bytes) in the cache folder."""
    files = list(folder().glob("*" + SUFFIX)) if folder().is_dir() else []
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return len(files), total


# ------------------------------------------------------------------ keys

def _hash_file(path: Path) -> dict:
    """A file's identity: size, modification time and hashes of its bytes."""
    with open_regular(path, "model file") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        h = hashlib.blake2b(digest_size=16)
        h.update(f.read(min(size, _HEAD_HASHED)))
        if size > _HEAD_HASHED:
            span = size - _HEAD_HASHED - _TAIL_HASHED
            if span > 0:
                for i in range(_SAMPLES):
                    f.seek(_HEAD_HASHED + span * i // _SAMPLES)
                    h.update(f.read(min(_SAMPLE_BYTES, span)))
            f.seek(max(_HEAD_HASHED, size - _TAIL_HASHED))
            h.update(f.read(_TAIL_HASHED))
    return {"name": path.name, "size": size, "mtime_ns": st.st_mtime_ns, "hash": h.hexdigest()}


_code = None


def _code_digest() -> str:
    """A digest of the fastllm that packs: its version, its Python modules
    and its compiled core, so that no other build reuses what this one
    wrote (packed layouts and loaders change without a version bump while
    fastllm is developed)."""
    global _code
    if _code is None:
        h = hashlib.blake2b(__version__.encode(), digest_size=16)
        here = Path(__file__).resolve().parent.parent   # the fastllm package
        for p in sorted(here.rglob("*.py")) + [Path(_core.__file__)]:
            try:
                h.update(str(p.relative_to(here)).encode() + b"\0" + p.read_bytes())
            except OSError:
                pass
        _code = h.hexdigest()
    return _code


def key(sources: list, options: dict) -> dict:
    """What a cache file made from sources (files) with options must record."""
    return {"format": FORMAT, "layout": _core.PACK_LAYOUT, "code": _code_digest(),
            "simd": _core.simd_path(), "int8": _core.int8_path(), "machine": platform.machine(),
            "byteorder": sys.byteorder, "options": options,
            "sources": [str(Path(s).resolve()) for s in sources],
            "identity": [_hash_file(Path(s)) for s in sources]}


def path_for(sources: list, options: dict) -> Path:
    """The cache file for sources and options (where it is, whatever it holds).
    The SIMD paths name files of their own: runs that alternate paths on
    one model (FASTLLM_SIMD=avx512_bf16 for a BF16 file, then the default)
    would otherwise make its file anew at every switch."""
    where = json.dumps([[str(Path(s).resolve()) for s in sources], options,
                        _core.simd_path(), _core.int8_path()], sort_keys=True)
    stem = Path(sources[0]).name[:64] if sources else "model"
    return folder() / f"{stem}-{hashlib.blake2b(where.encode(), digest_size=8).hexdigest()}{SUFFIX}"


# -------------------------------------------------------- writing a file

def _leaves(tree, out: dict):
    """The arrays of tree (a load_*_weights result), each once, in order (by id)."""
    if isinstance(tree, _core.Matrix):
        _leaves(tree.data, out)
    elif isinstance(tree, np.ndarray):
        out.setdefault(id(tree), tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            _leaves(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _leaves(v, out)


def _pwrite(fd: int, data, at: int) -> None:
    """All of data at offset at (one write may take less)."""
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def _encode(tree, where: dict):
    """tree as JSON, arrays by their offset in the data (where: id -> offset)."""
    if isinstance(tree, _core.Matrix):
        return {"matrix": [tree.dtype, tree.N, tree.K, bool(tree.packed), tree.experts,
                           _encode(tree.data, where)]}
    if isinstance(tree, np.ndarray):
        a = np.ascontiguousarray(tree)
        return {"array": [a.dtype.str, list(a.shape), where[id(tree)]]}
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise TypeError("only string keys")
        return {"dict": {k: _encode(v, where) for k, v in tree.items()}}
    if isinstance(tree, (list, tuple)):
        return {"list": [_encode(v, where) for v in tree]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"value": tree}
    raise TypeError(f"cannot store a {type(tree).__name__}")


class _Arena:
    """A temporary cache file beside path that grows as the packed matrices
    of a load are made (the sink of _core.packing_into): each part of a
    matrix is packed into memory of the arena's own, reused for the next,
    and written into the file at once; the matrix is then a read-only map
    of its pages. Written with pwrite rather than packed into a writable
    map of the file: a write fault on a page of a shared file map costs
    about four times what writing the page costs (2.1 against 0.55 us on
    ext4), which made a 3B model's first load 1.4 times slower."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd, name = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
        self.path = Path(name)
        self.size = _PAGE      # the header's page
        self.where = {}        # id(array) -> its offset in the file
        self.arrays = []       # kept alive while their ids are keys
        self.scratch = None    # the memory parts are packed in

    def _grow(self, n: int) -> int:
        """The offset of n more bytes at the end of the file, its blocks
        allocated now (so that a full disk is an OSError here, never a
        short write later)."""
        at, self.size = self.size, self.size + n
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(self.fd, at, n)
        else:
            os.ftruncate(self.fd, self.size)
        return at

    def reserve(self, nbytes: int) -> tuple:
        """(offset, bytes, bytes in whole pages) of a matrix in the file."""
        pages = max(_PAGE, (nbytes + _PAGE - 1) // _PAGE * _PAGE)
        return self._grow(pages), nbytes, pages

    def part(self, where: tuple, at: int, nbytes: int) -> np.ndarray:
        if self.scratch is None or self.scratch.nbytes < nbytes:
            self.scratch = None   # the smaller one freed before the larger is made
            self.scratch = np.empty(nbytes, np.uint8)
        return self.scratch[:nbytes]

    def done(self, where: tuple, at: int, part: np.ndarray) -> None:
        _pwrite(self.fd, part, where[0] + at)

    def result(self, where: tuple) -> np.ndarray:
        offset, nbytes, pages = where
        arr = np.frombuffer(mmap.mmap(self.fd, pages, offset=offset, prot=mmap.PROT_READ), np.uint8, nbytes)
        self.where[id(arr)] = offset
        self.arrays.append(arr)
        return arr

    def finish(self, k: dict, tree, extra: dict) -> bytes:
        """Put the arrays of tree not made here after the others, and the
        manifest after all: the manifest, its header left to _seal."""
        arrays = {}
        _leaves(tree, arrays)
        at = self.size
        tail = []
        for a in arrays.values():
            if id(a) not in self.where:
                self.where[id(a)] = at
                tail.append(a)
                at = (at + a.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if at > self.size:
            self._grow(at - self.size)
        for a in tail:
            _pwrite(self.fd, np.ascontiguousarray(a), self.where[id(a)])
        where = {i: o - _PAGE for i, o in self.where.items()}
        manifest = json.dumps({"key": k, "tree": _encode(tree, where), "extra": extra}).encode()
        _pwrite(self.fd, manifest, self.size)
        self.arrays = []
        self.scratch = None
        return manifest

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        """Close and delete the file (again: nothing happens)."""
        self.arrays = []
        self.scratch = None
        self.close()
        _unlink(self.path)


def _seal(arena: _Arena, path: Path, manifest: bytes) -> tuple:
    """Checksum the data of the file the arena made (once the packed arrays
    are gone: its pages are then all the memory they take), write its
    header and rename it into place, read-only: (device, inode, data
    checksum) of the file, for _map to know it again."""
    try:
        data_bytes = arena.size - _PAGE
        with mmap.mmap(arena.fd, arena.size, prot=mmap.PROT_READ) as m, memoryview(m) as view, \
                view[_PAGE:] as data:
            data_sum = _core.checksum(data)
        head = _HEAD.pack(MAGIC, FORMAT, len(manifest), _PAGE, data_bytes, data_sum, _core.checksum(manifest))
        head += struct.pack("<Q", _core.checksum(head))
        _pwrite(arena.fd, head, 0)
        st = os.fstat(arena.fd)
        arena.close()
        os.chmod(arena.path, 0o444)
        os.replace(arena.path, path)
        return st.st_dev, st.st_ino, data_sum
    except BaseException:
        arena.discard()
        raise


# -------------------------------------------------------- reading a file

def _read_manifest(f, size: int) -> tuple:
    """(manifest dict, data offset, data bytes, data checksum) of an open
    cache file of size bytes, once its header and manifest check out."""
    head = f.read(_HEAD_BYTES)
    if len(head) < _HEAD_BYTES:
        raise CacheInvalid("shorter than its header")
    magic, fmt, n_manifest, data_offset, data_bytes, data_sum, manifest_sum = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise CacheInvalid("not a fastllm packed-weights file")
    if struct.unpack_from("<Q", head, _HEAD.size)[0] != _core.checksum(head[:_HEAD.size]):
        raise CacheInvalid("its header is damaged")
    if fmt != FORMAT:
        raise CacheInvalid(f"written in format {fmt}, this fastllm reads {FORMAT}")
    if n_manifest > _MAX_MANIFEST or data_offset < _HEAD_BYTES or data_offset % _PAGE:
        raise CacheInvalid("its header is inconsistent")
    if data_offset + data_bytes + n_manifest != size:
        raise CacheInvalid(f"{size} bytes, but its header says {data_offset + data_bytes + n_manifest}: "
                           f"cut short or grown")
    f.seek(data_offset + data_bytes)
    raw = f.read(n_manifest)
    if len(raw) != n_manifest or _core.checksum(raw) != manifest_sum:
        raise CacheInvalid("its manifest is damaged")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError):
        raise CacheInvalid("its manifest is not JSON") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("extra"), dict):
        raise CacheInvalid("its manifest is not a manifest")
    return manifest, data_offset, data_bytes, data_sum


def _decode(node, buf, data_offset: int, data_bytes: int, depth: int = 0):
    """The tree of a manifest over the mapped file buf; every array is
    checked to lie inside the data, every matrix to have exactly the bytes
    its type and shape take."""
    if depth > 8 or not isinstance(node, dict) or len(node) != 1:
        raise CacheInvalid("malformed manifest")
    (kind, v), = node.items()
    if kind == "value":
        if v is not None and not isinstance(v, (bool, int, float, str)):
            raise CacheInvalid("malformed value")
        return v
    if kind == "dict" and isinstance(v, dict):
        return {k: _decode(x, buf, data_offset, data_bytes, depth + 1) for k, x in v.items()}
    if kind == "list" and isinstance(v, list):
        return [_decode(x, buf, data_offset, data_bytes, depth + 1) for x in v]
    if kind == "array" and isinstance(v, list) and len(v) == 3:
        dtype, shape, at = v
        if dtype not in _DTYPES or not isinstance(shape, list) or len(shape) > 3 or \
                not all(type(n) is int and 0 <= n < 1 << 40 for n in shape) or \
                type(at) is not int or not 0 <= at <= data_bytes or at % _ALIGN:
            raise CacheInvalid("malformed array")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        nbytes = count * np.dtype(_DTYPES[dtype]).itemsize
        if at + nbytes > data_bytes:
            raise CacheInvalid("an array reaches past the data")
        return np.frombuffer(buf, _DTYPES[dtype], count, data_offset + at).reshape(shape)
    if kind == "matrix" and isinstance(v, list) and len(v) == 6:
        dtype, N, K, packed, experts, data = v
        arr = _decode(data, buf, data_offset, data_bytes, depth + 1)
        if not isinstance(arr, np.ndarray) or not all(type(n) is int and 0 <= n < 1 << 31 for n in (N, K, experts)) \
                or not isinstance(packed, bool) or not isinstance(dtype, str):
            raise CacheInvalid("malformed matrix")
        try:
            if packed:
                return _core.packed_matrix(arr, dtype, N, K, experts)
            if experts:
                raise ValueError("experts are packed")
            m = _core.rows(arr, dtype, K)
            if m.N != N:
                raise ValueError("rows")
            return m
        except (ValueError, TypeError, OverflowError) as e:
            raise CacheInvalid(f"a matrix does not match its bytes ({e})") from None
    raise CacheInvalid("malformed manifest")


# A file's times come from a clock that ticks every few milliseconds, so a
# write in the same tick as the check before it could leave them as they
# were: only a file this long unchanged is recorded as checked.
_SETTLED_NS = 2_000_000_000
CHECKED = ".checked"


def _boot() -> str | None:
    """This boot of the machine, where the system names it (Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _stamp(f, data_sum: int) -> list | None:
    """What a record of the open cache file f, checked whole, holds: None
    where the boot cannot be told."""
    boot = _boot()
    if boot is None:
        return None
    st = os.fstat(f.fileno())
    return [boot, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, data_sum]


def _checked_before(path: Path, stamp) -> bool:
    """Whether the record beside path holds stamp (a record of more than
    4 KiB, or not JSON, holds nothing)."""
    if stamp is None:
        return False
    try:
        with open(path.parent / (path.name + CHECKED), "rb") as f:
            return json.loads(f.read(4096)) == stamp
    except (OSError, ValueError, RecursionError):
        return False


def _record_checked(path: Path, stamp) -> None:
    """Write the record that the file at path, as stamp says, was checked
    whole (a temporary file renamed into place); nothing where it cannot."""
    if stamp is None or time.time_ns() - stamp[5] < _SETTLED_NS:
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + path.name, suffix=CHECKED + ".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(stamp, f)
            os.replace(tmp, path.parent / (path.name + CHECKED))
        except BaseException:
            _unlink(Path(tmp))
            raise
    except OSError:
        pass


def _map(path: Path, want: dict, check=None, sealed=None) -> tuple:
    """(tree, extra) of the cache file at path, mapped read-only and shared,
    if it was made for want (a key), is whole and check(tree) (which
    raises ValueError or TypeError otherwise) takes it; else CacheInvalid.
    sealed: (device, inode, data checksum) of the file as _seal, which has
    just summed its data, left it: that file's data is not summed again."""
    try:
        f = open_regular(path, "packed-weights cache")
    except ModelFileError as e:
        raise CacheInvalid(str(e)) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        manifest, data_offset, data_bytes, data_sum = _read_manifest(f, size)
        if manifest.get("key") != want:
            raise CacheInvalid("it was made from another file, with other options, or by another "
                               "fastllm build or machine")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        buf = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
        stamp = _stamp(f, data_sum)
        st = os.fstat(f.fileno())
    # The file _seal has just summed is not summed again: it would read
    # the same pages of the page cache.
    if sealed == (st.st_dev, st.st_ino, data_sum):
        _record_checked(path, stamp)
    elif not _checked_before(path, stamp):
        if _core.checksum(memoryview(buf)[data_offset:data_offset + data_bytes]) != data_sum:
            raise CacheInvalid("its data is damaged")
        _record_checked(path, stamp)
    tree = _decode(manifest.get("tree"), buf, data_offset, data_bytes)
    if check is not None:
        try:
            check(tree)
        except (ValueError, TypeError, KeyError, OverflowError) as e:
            raise CacheInvalid(f"its weights do not fit the model ({e})") from None
    return tree, manifest["extra"]


# ----------------------------------------- the container, for other files

def write_file(path: Path, want: dict, tree, extra: dict) -> None:
    """Write tree (arrays, lists, dicts of plain values) and extra into a
    file of this format at path, made for want (a key): whole or not at
    all (a temporary file renamed into place), read-only."""
    arena = _Arena(path)
    try:
        manifest = arena.finish(want, tree, extra)
    except BaseException:
        arena.discard()
        raise
    _seal(arena, path, manifest)


def read_file(path: Path, want: dict) -> tuple:
    """(tree, extra) of a file write_file wrote for want, its arrays mapped
    read-only; CacheInvalid where it was made for another key or is not
    whole."""
    return _map(path, want)


def read_header(path: Path) -> tuple:
    """(key, extra) of a file of this format, once its header and manifest
    check out (its data is not read); CacheInvalid otherwise."""
    try:
        f = open_regular(path, "cache file")
    except ModelFileError as e:
        raise CacheInvalid(str(e)) from None
    with f:
        manifest = _read_manifest(f, os.fstat(f.fileno()).st_size)[0]
    return manifest.get("key"), manifest["extra"]


# ------------------------------------------------------------ the cache

def _sources_gone(path: Path) -> bool:
    """Whether the cache file at path was made from files that no longer exist."""
    try:
        with open_regular(path, "packed-weights cache") as f:
            manifest = _read_manifest(f, os.fstat(f.fileno()).st_size)[0]
        sources = manifest["key"]["sources"]
        return not all(os.path.exists(s) for s in sources)
    except Exception:   # unreadable or from another format: left alone
        return False


def _collect_garbage(keep: Path) -> None:
    """Delete cache files whose sources are gone, records of files that
    are gone, and temporary files that no process is writing (their
    writer died)."""
    for p in folder().glob("*" + SUFFIX):
        if p != keep and _sources_gone(p):
            _unlink(p)
            _unlink(p.parent / (p.name + ".lock"))
            _unlink(p.parent / (p.name + CHECKED))
    for p in folder().glob("*" + SUFFIX + CHECKED):
        if not os.path.lexists(p.parent / p.name[:-len(CHECKED)]):
            _unlink(p)
    for p in folder().glob(".*" + SUFFIX + ".*.tmp"):
        if _lock_free(p.parent / (p.name.split(SUFFIX)[0].lstrip(".") + SUFFIX + ".lock")):
            _unlink(p)


def _unlink(p: Path) -> None:
    try:
        p.unlink()
    except OSError:
        pass


def _lock_free(lock: Path) -> bool:
    if fcntl is None:
        return False
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class _Lock:
    """An exclusive lock on path (waits for another process holding it)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self):
        if fcntl is not None:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            except OSError:
                if self.fd is not None:
                    os.close(self.fd)
                self.fd = None
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)   # releases the lock


class PackCacheWarning(UserWarning):
    """The packed-weights cache could not be written (the model loads anyway)."""


def _replay(records: list) -> None:
    """Warnings the loader gave when the cache was made, given again."""
    for module, name, message in records:
        category = UserWarning
        if module.startswith("fastllm."):
            try:
                found = getattr(importlib.import_module(module), name)
                if isinstance(found, type) and issubclass(found, Warning):
                    category = found
            except (ImportError, AttributeError):
                pass
        warnings.warn(message, category, stacklevel=4)


def load(sources: list, options: dict, build, use: bool = True, check=None) -> tuple:
    """(tree, extra, cache file or None): what build() returns (a tree of
    arrays and Matrix objects, and a dict of plain values), from the cache
    file of sources and options when a valid one is there (check(tree), if
    given, raises ValueError or TypeError where the tree does not fit),
    else built and written into it, then mapped from it. use=False:
    build() alone."""
    if not use:
        tree, extra = build()
        return tree, extra, None
    path = path_for(sources, options)
    want = key(sources, options)
    tree = written = None
    with _Lock(path.parent / (path.name + ".lock")) if _can_lock(path) else _NoLock():
        try:
            tree, extra = _map(path, want, check)
        except CacheInvalid as e:
            if os.path.lexists(path):
                sys.stderr.write(f"fastllm: the cache file {path} cannot be used ({e}); making it again\n")
        except OSError:
            pass
        if tree is not None:
            _replay(extra.get("warnings", []))
            return tree, extra, path
        arena = _arena(path)
        try:
            with warnings.catch_warnings(record=True) as caught, \
                    _core.packing_into(arena):
                warnings.simplefilter("always")
                tree, extra = build()
        except OSError as e:
            if arena is None or not _about(e, arena):
                raise
            # The cache file could not grow (a full disk): packed in memory instead.
            arena.discard()
            arena = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tree, extra = build()
        except BaseException:
            if arena:
                arena.discard()
            raise
        extra = dict(extra, warnings=[[w.category.__module__, w.category.__qualname__, str(w.message)]
                                      for w in caught])
        try:
            if arena is None:
                raise OSError(f"cannot write into {path.parent}")
            manifest = arena.finish(want, tree, extra)
            # The packed arrays are dropped for the file's pages: shared with
            # every other process that maps it, and never in memory twice.
            tree = None
            _give_back_freed_memory()
            sealed = _seal(arena, path, manifest)
            arena = None
            tree, extra = _map(path, want, check, sealed)
            written = path
        except (OSError, CacheInvalid, TypeError, ValueError) as e:
            if arena is not None:
                if tree is not None:
                    tree = _copied(tree)   # off the pages of the file about to go
                arena.discard()
            warnings.warn(f"{path.name} could not be cached in {path.parent} ({e}); "
                          f"the next load makes it again", PackCacheWarning, stacklevel=3)
            if tree is None:   # dropped, and not readable back
                tree, extra = build()
    _replay(extra.get("warnings", []))
    if written is not None:
        _collect_garbage(written)
    return tree, extra, written


def _about(e: OSError, arena: "_Arena") -> bool:
    """Whether e came from the arena's file (not from reading the source)."""
    return e.filename is None or Path(e.filename) == arena.path


def _arena(path: Path):
    """An _Arena beside path, or None where none can be made there."""
    try:
        return _Arena(path)
    except OSError:
        return None


def _copied(tree):
    """tree with its arrays (and matrices' data) copied into memory of the process's own."""
    if isinstance(tree, _core.Matrix):
        data = np.array(tree.data)
        if tree.packed:
            return _core.packed_matrix(data, tree.dtype, tree.N, tree.K, tree.experts)
        return _core.rows(data, tree.dtype, tree.K)
    if isinstance(tree, np.ndarray):
        return np.array(tree)
    if isinstance(tree, dict):
        return {k: _copied(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copied(v) for v in tree]
    return tree


def _give_back_freed_memory() -> None:
    """Return the heap that the packed arrays freed to the system (glibc
    keeps freed blocks of the size of most matrices for reuse), so that
    mapping the file does not add to it."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def _can_lock(path: Path) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return True
    except OSError:
        return False


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass
