"""Memory read bandwidth at a given thread count, measured by membw.c.

What membw.c measures: OMP_NUM_THREADS OpenMP threads each write, then sum,
their own static slice of one buffer of uint64 (1 GiB by default, far larger
than any last-level cache), so every thread reads pages it touched first,
as the engines' threads read their weights after loading. After one
warm-up read it times `reads` more and reports the fastest: the bytes of
the buffer over that read's wall time, in GB/s (10^9 bytes). This is the
rate at which t threads can stream memory, the ceiling that token
generation, which reads every weight once per token, cannot pass.

The benchmarks call it before each repetition and report the median, since
on a shared machine the figure moves from one moment to the next.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "membw.c"


def build(folder: Path | None = None) -> Path:
    """membw.c compiled (with $CC, default cc, and OpenMP) into folder, once."""
    exe = Path(folder or tempfile.gettempdir()) / "fastllm-membw"
    if not exe.exists() or exe.stat().st_mtime < SOURCE.stat().st_mtime:
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_name(f"{exe.name}.tmp{os.getpid()}")
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-fopenmp", str(SOURCE), "-o", str(tmp)],
                       check=True, capture_output=True, text=True)
        os.replace(tmp, exe)
    return exe


def measure(exe: Path, threads: int, mib: int = 1024, reads: int = 5) -> float:
    """GB/s of the fastest of `reads` reads of a mib MiB buffer by `threads` threads."""
    r = subprocess.run([str(exe), str(mib), str(reads)], capture_output=True, text=True, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return json.loads(r.stdout)["gb_per_s"]
