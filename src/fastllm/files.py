"""Reading the small files of a model folder with a bound.

A config or tokenizer file is JSON of at most some megabytes; a path that
is a FIFO, a device (/dev/zero) or a multi-gigabyte file would otherwise
hang the loader or fill memory before any check runs.
"""
from __future__ import annotations

import os
import stat

from .errors import ModelFileError


def check_regular(path, what: str):
    """ModelFileError unless path is a regular file (links are followed)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ModelFileError(path, f"{what} not found") from None
    except OSError as e:
        raise ModelFileError(path, f"cannot read {what}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise ModelFileError(path, f"{what} is not a regular file")


def read_bounded(path, limit: int, what: str) -> bytes:
    """The bytes of a regular file of at most limit bytes, else ModelFileError."""
    check_regular(path, what)
    try:
        # O_NONBLOCK: a file swapped for a FIFO after the check cannot hang open().
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ModelFileError(path, f"cannot read {what}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelFileError(path, f"{what} is not a regular file")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ModelFileError(path, f"cannot read {what}: {e.strerror or e}") from None
    if len(data) > limit:
        raise ModelFileError(path, f"{what} is larger than {limit} bytes: not a {what}")
    return data
