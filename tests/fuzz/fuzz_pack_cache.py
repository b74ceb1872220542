"""Fuzz the packed-weights cache reader (fastllm.load.pack_cache): each input is
the cache file of a tiny GGUF model, which pack_cache.load must either map
(and then it holds exactly the weights an uncached load packs) or notice as
unusable and rebuild; in both cases the model then runs. Nothing else is
acceptable: an exception, a crash, a hang, weights that differ.

Inputs whose header byte 63 (padding, read by nothing) is odd are first
"resealed": their checksums recomputed, so that mutations reach the
manifest's JSON and the arrays and matrices it describes, which the
checksums would otherwise turn away first. Those may then hold other
weights than the model's, as long as every array lies inside the file and
every matrix has the bytes its type and shape take (else: rebuilt).

The cache key is fixed (the tiny model, this format and panel layout, a
digest of its packed bytes), so that the seeds stay valid while the rest of
the code changes.

    python tests/fuzz/fuzz_pack_cache.py CORPUS_COPY -runs=1000000 -rss_limit_mb=2048 -timeout=10
"""
import atexit
import contextlib
import io
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _target import instrumented, main  # noqa: E402

with instrumented():
    import numpy as np
    from fastllm.core import _core
    from fastllm.load import pack_cache
    from fastllm.formats.gguf import read_gguf_model
    from fastllm.load.weights import load_gguf_weights

import file_seeds  # noqa: E402

_TMP = Path(tempfile.mkdtemp(prefix="fuzz-pack-cache-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
atexit.register(shutil.rmtree, _TMP, True)
_SOURCE = _TMP / "tiny.gguf"
_HOME = _TMP / "home"
OPTIONS = {"dtype": "gguf"}


def _setup():
    import gguf
    _SOURCE.write_bytes(file_seeds.tiny_gguf(lambda name: gguf.GGMLQuantizationType.Q4_1))
    return read_gguf_model(_SOURCE)


_HEADER = _setup()
_CONFIG = _HEADER.config


def build():
    arrays, types = load_gguf_weights(_HEADER)
    return arrays, {"types": dict(types)}


def check(tree):
    _core.Weights(_CONFIG, tree, 8)


def leaves(tree) -> list:
    if isinstance(tree, _core.Matrix):
        return [(tree.dtype, tree.shape, tree.packed, np.asarray(tree.data).tobytes())]
    if isinstance(tree, np.ndarray):
        return [(tree.dtype.str, tree.shape, tree.tobytes())]
    if isinstance(tree, dict):
        return [(k, leaves(v)) for k, v in tree.items()]
    if isinstance(tree, list):
        return [leaves(v) for v in tree]
    return [tree]


_WANT = leaves(build()[0])
# The packed bytes are in the key: where a change of fastllm's packing makes
# the seeds stale, they are rebuilt rather than taken for damaged files
# (and file_seeds.py makes them anew).
KEY = {"format": pack_cache.FORMAT, "layout": _core.PACK_LAYOUT, "fuzz": "tiny-q4_1",
       "weights": __import__("hashlib").blake2b(repr(_WANT).encode(), digest_size=8).hexdigest()}


def cache_path() -> Path:
    return _HOME / "packed" / ("tiny.gguf" + pack_cache.SUFFIX)


@contextlib.contextmanager
def fixed_cache():
    """The cache in the scratch folder under the fixed key, for one input."""
    saved = pack_cache.key, pack_cache.path_for, os.environ.get("FASTLLM_HOME")
    pack_cache.key = lambda sources, options: KEY
    pack_cache.path_for = lambda sources, options: cache_path()
    os.environ["FASTLLM_HOME"] = str(_HOME)
    try:
        yield
    finally:
        pack_cache.key, pack_cache.path_for = saved[0], saved[1]
        if saved[2] is None:
            del os.environ["FASTLLM_HOME"]
        else:
            os.environ["FASTLLM_HOME"] = saved[2]
        shutil.rmtree(_HOME, ignore_errors=True)


def reseal(data: bytes) -> bytes:
    """data with the checksums of its header, manifest and data recomputed
    (where its header's numbers let them be)."""
    if len(data) < 64:
        return data
    magic, fmt, n_manifest, data_offset, data_bytes, _, _ = pack_cache._HEAD.unpack_from(data)
    manifest = data[data_offset + data_bytes:data_offset + data_bytes + n_manifest]
    body = data[data_offset:data_offset + data_bytes]
    head = pack_cache._HEAD.pack(magic, fmt, n_manifest, data_offset, data_bytes,
                                 _core.checksum(np.frombuffer(body, np.uint8)),
                                 _core.checksum(np.frombuffer(manifest, np.uint8)))
    head += struct.pack("<Q", _core.checksum(np.frombuffer(head, np.uint8)))
    return head + data[len(head):]


def TestOneInput(data: bytes) -> None:
    resealed = len(data) >= 64 and data[63] & 1
    if resealed:
        data = reseal(data)
    with fixed_cache(), contextlib.redirect_stderr(io.StringIO()) as err:
        path = cache_path()
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        tree, extra, where = pack_cache.load([_SOURCE], OPTIONS, build, True, check)
        assert where == path, where
        rebuilt = "cannot be used" in err.getvalue()
        if not resealed or rebuilt:
            assert leaves(tree) == _WANT, "a cache file that was used holds other weights"
        weights = _core.Weights(_CONFIG, tree, 8)
        state = _core.State(weights, 4, 1)
        state.run(np.array([0, _CONFIG.vocab_size - 1], np.int32), 0)
        # Whatever was there, a whole file is there now, and maps as it is.
        seen = len(err.getvalue())
        again, _, where = pack_cache.load([_SOURCE], OPTIONS, build, True, check)
        assert where == path and "cannot be used" not in err.getvalue()[seen:]
        assert leaves(again) == leaves(tree)


def seeds() -> dict:
    """The seed corpus: the tiny model's cache file as written, the same to
    be resealed (header byte 63 odd), the file cut short, and one of a
    format to come."""
    with fixed_cache(), contextlib.redirect_stderr(io.StringIO()):
        pack_cache.load([_SOURCE], OPTIONS, build, True, check)
        whole = cache_path().read_bytes()
    resealed = bytearray(whole)
    resealed[63] |= 1
    other = bytearray(resealed)
    other[8:12] = struct.pack("<I", pack_cache.FORMAT + 1)
    return {"tiny-q4_1": whole, "tiny-q4_1-resealed": bytes(resealed), "tiny-q4_1-cut": whole[:len(whole) // 2],
            "tiny-q4_1-next-format": bytes(other)}

if __name__ == "__main__":
    main(TestOneInput, instrument_all=True)
