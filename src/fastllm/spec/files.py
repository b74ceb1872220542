"""Opening model files safely: regular files only, read with a size bound.

A FIFO, socket or device named like a model file would block open() or
read() forever (a FIFO with no writer, /dev/zero), so the type is checked on
the open descriptor itself, opened without blocking; what is read is
bounded so that a huge or endless file fails with a clear error instead of
filling memory.
"""
from __future__ import annotations

import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor

from .errors import ModelFileError

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path, what: str, mode: int):
    raise ModelFileError(path, f"{what} is {_kind(mode)}, not a regular file; "
                               f"replace it with the file itself")


def check_regular(path, what: str) -> os.stat_result:
    """The stat of path (following symlinks), refusing anything that is not
    a regular file. Missing or unreadable paths raise ModelFileError too."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelFileError(path, f"{what} not found") from None
    except OSError as e:
        raise ModelFileError(path, f"cannot read {what}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        _refuse(path, what, st.st_mode)
    return st


def open_regular(path, what: str, buffering: int = -1):
    """path opened for binary reading, once it is known to be a regular file
    (buffering=0: unbuffered, so every read sees the file as it is now).

    The check is made on the descriptor, so a path swapped for a FIFO
    between a stat and the open cannot make the open or the reads block.
    """
    flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NOCTTY", 0)
    nonblock = getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | nonblock)
    except FileNotFoundError:
        raise ModelFileError(path, f"{what} not found") from None
    except OSError as e:
        raise ModelFileError(path, f"cannot open {what}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _refuse(path, what, st.st_mode)
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=buffering)
    except BaseException:
        os.close(fd)
        raise


# Reads of a model's weights go in pieces to a few threads: one core
# copies from the page cache at 3-5 GB/s, and a load reads every byte.
_PIECE = 8 << 20
_MAX_READERS = 8
_readers = None


def _forget_readers():
    global _readers
    _readers = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_readers)   # a child has none of the parent's threads


def read_at(f, out, offset: int) -> int:
    """Read len(out) bytes of the open file f, from offset, into out (a
    writable buffer): how many there were, fewer only where the file ends
    first. Big reads are split among threads."""
    global _readers
    out = memoryview(out).cast("B")
    n = len(out)
    threads = min(_MAX_READERS, os.cpu_count() or 1)
    if n < 2 * _PIECE or threads < 2 or not hasattr(os, "preadv"):
        f.seek(offset)
        got = 0
        while got < n and (k := f.readinto(out[got:])):
            got += k
        return got
    fd = f.fileno()

    def piece(start: int) -> int:
        end, at = min(n, start + _PIECE), start
        while at < end and (k := os.preadv(fd, [out[at:end]], offset + at)):
            at += k
        return at - start

    if _readers is None:
        _readers = ThreadPoolExecutor(threads, thread_name_prefix="fastllm-read")
    starts = range(0, n, _PIECE)
    counts = list(_readers.map(piece, starts))   # all of them: none reads on after f is closed
    got = 0
    for start, k in zip(starts, counts):
        got += k
        if k < min(_PIECE, n - start):   # the file ends in this piece
            break
    return got


def read_bounded(path, limit: int, what: str) -> bytes:
    """The whole content of the regular file path, refusing more than limit bytes."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ModelFileError(path, f"{what} is {size} bytes, more than the {limit} bytes "
                                       f"such a file may have")
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ModelFileError(path, f"cannot read {what}: {e.strerror or e}") from None
    if len(data) > limit:  # it grew while being read
        raise ModelFileError(path, f"{what} is more than the {limit} bytes such a file may have")
    return data

def read_json(path, limit: int, what: str):
    """The JSON value of a regular file of at most limit bytes, else
    ModelFileError naming the file."""
    data = read_bounded(path, limit, what)
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(path, f"not valid JSON: {e}") from None
    except RecursionError:
        raise ModelFileError(path, "not valid JSON: nested too deeply") from None
