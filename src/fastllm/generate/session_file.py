"""A sequence's state in a file: the keys and values of its tokens, its
recurrent states and the windows its rings hold, and its checkpoints, so
that another Session, in this process or a later one, holds those tokens
without running them again (Session.save_file / load_file, the server's
prompt cache on disk).

The file is the packed-weights cache's container (fastllm.load.pack_cache):
a checksummed header, data and manifest, written under a temporary name
and renamed into place. Keys and values are only valid for the weights,
kernels and settings that computed them, so a file records all of them
(the key): the model files' identity, fastllm's code, the SIMD and int8
paths, the KV cache's type, the activations and the context's layout. A
file is used only when its key is this model's and every checksum holds.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..load import pack_cache
from ..spec.errors import ModelFileError

SUFFIX = ".flmsession"
# Bumped when what a file holds changes (the code digest catches the rest).
FORMAT = 1


def key(weights, weight_files) -> dict:
    """What a session file of these weights (a _core.Weights read from
    weight_files, Model.weight_files) must record; ValueError for weights
    built in memory, which no file identifies."""
    if weight_files is None:
        raise ValueError("this model's weights were not read from files (Model.from_pretrained): "
                         "its sessions cannot be saved to or loaded from files")
    sources, options = weight_files
    return {"kind": "session", "format": FORMAT, "weights": pack_cache.key(sources, options),
            "kv_dtype": weights.kv_dtype, "float_acts": bool(weights.float_acts),
            "seq_len": weights.seq_len, "max_pass": weights.max_pass}


def write(path, want: dict, tokens, prefix: np.ndarray, at, checkpoints, rope_long: bool) -> None:
    """Write a sequence of tokens: prefix (State.save_prefix), at
    (State.save_position at its end, or None) and checkpoints ((position,
    State.save_position there) pairs)."""
    tree = {"prefix": prefix, "at": at, "checkpoints": [arr for _, arr in checkpoints]}
    extra = {"tokens": [int(t) for t in tokens], "checkpoints": [int(p) for p, _ in checkpoints],
             "rope_long": bool(rope_long)}
    pack_cache.write_file(Path(path), want, tree, extra)


def header(path) -> tuple:
    """(key, tokens, checkpoint positions) of a session file, its header
    and manifest checked (its data is not read): what tells whether it may
    serve a prompt; pack_cache.CacheInvalid otherwise."""
    want, extra = pack_cache.read_header(Path(path))
    tokens, points = extra.get("tokens"), extra.get("checkpoints")
    if not isinstance(tokens, list) or not isinstance(points, list):
        raise pack_cache.CacheInvalid("it holds no token list")
    return want, tuple(tokens), tuple(points)


def read(path, want: dict, vocab_size: int, n_ctx: int) -> dict:
    """What write() wrote at path: {tokens, prefix, at, checkpoints,
    rope_long}, the arrays mapped read-only, once the file is whole, made
    for want, and its tokens and checkpoints make sense for a context of
    n_ctx tokens of a vocabulary of vocab_size; else ModelFileError naming
    the file. (Whether the arrays fit the model's caches, the State checks
    as it takes them.)"""
    path = Path(path)
    try:
        tree, extra = pack_cache.read_file(path, want)
    except pack_cache.CacheInvalid as e:
        raise ModelFileError(path, f"not a session file of this model ({e})") from None
    except OSError as e:
        raise ModelFileError(path, f"cannot be read ({e.strerror or e})") from None
    tokens, points, rope_long = extra.get("tokens"), extra.get("checkpoints"), extra.get("rope_long")

    def ints(v, low, high):
        return isinstance(v, list) and all(type(x) is int and low <= x < high for x in v)
    if not ints(tokens, 0, vocab_size) or not tokens or len(tokens) > n_ctx:
        raise ModelFileError(path, f"its tokens are not 1 to {n_ctx} ids of a vocabulary of {vocab_size}")
    if not ints(points, 1, len(tokens) + 1) or points != sorted(set(points)) or not isinstance(rope_long, bool):
        raise ModelFileError(path, "its checkpoints or settings are malformed")
    if not isinstance(tree, dict) or not isinstance(tree.get("prefix"), np.ndarray) or \
            not isinstance(tree.get("checkpoints"), list) or len(tree["checkpoints"]) != len(points):
        raise ModelFileError(path, "its arrays are malformed")
    saved = [tree["at"]] + tree["checkpoints"]
    if not all(a is None or isinstance(a, np.ndarray) and a.dtype == np.float32 for a in saved):
        raise ModelFileError(path, "its saved states are malformed")
    return {"tokens": tokens, "prefix": tree["prefix"], "at": tree["at"], "rope_long": rope_long,
            "checkpoints": list(zip(points, tree["checkpoints"]))}
