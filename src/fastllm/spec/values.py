"""Checks of single config values, shared by config.py and the family
modules (a bool is an int in Python: it is never taken for a count)."""
from __future__ import annotations

import math

import numpy as np

from .errors import ModelFileError


def number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def positive_int(v) -> bool:
    # The C core holds sizes as int.
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2**31


# A head's width (the widest real ones are 512): the RoPE tables, the
# attention's per-head scratch and a layer's Q/K/V rows are sized by it
# before any weight is read, so a claimed 300 million would be gigabytes.
MAX_HEAD_DIM = 8192


def head_dim_ok(v) -> bool:
    """A head width fastllm runs: positive, even (RoPE rotates pairs) and
    at most MAX_HEAD_DIM."""
    return positive_int(v) and v % 2 == 0 and v <= MAX_HEAD_DIM


def token_id(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31


def shortest_float32(x) -> float:
    """The shortest decimal that maps to the same float32 as x. GGUF stores
    hyperparameters as float32; this gives back what the original
    config.json said (1e-05 rather than 9.999999747378752e-06) and computes
    identically."""
    f = np.float32(x)
    for digits in range(1, 18):
        s = f"{float(f):.{digits}g}"
        if np.float32(float(s)) == f:
            return float(s)
    return float(f)


def need_int(raw: dict, key: str, path) -> int:
    """raw[key], a positive int the C core can hold, or a ModelFileError
    naming the key."""
    if key not in raw or raw[key] is None:
        raise ModelFileError(path, f"missing key {key!r}")
    value = raw[key]
    if not positive_int(value):
        raise ModelFileError(path, f"{key!r} must be a positive integer below 2**31, got {value!r}")
    return value
