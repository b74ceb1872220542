"""Start the OpenMP runtime of the run loop with a short spin-then-sleep wait.

A thread that reaches a barrier first spins, then sleeps. libgomp spins
300,000 rounds by default, 7 ms on a current x86 core, longer than a
scheduler time slice: on cores shared with other work the spinning thread
keeps the core its sibling needs to reach the barrier, and two threads fell
to a third of their speed (benchmarks/wait_policy.py measures it). fastllm
asks for 30,000 rounds (about 0.7 ms): on an idle machine the threads of a
1-4B model's decode step drift apart by more than the 3,000 rounds fastllm
used to ask for, and sleeping then cost a fifth to a quarter of its speed
at 2 threads (Phi-4-mini Q4_K_M: 8.3 tokens/s at 3,000 rounds, 10.2 at
30,000, 10.5-11.3 at libgomp's 300,000), while a sleeping thread is
still woken well within a time slice on a busy one.

A wait setting of the user's own (OMP_WAIT_POLICY, GOMP_SPINCOUNT,
KMP_BLOCKTIME) is left alone. The variables are set only while the runtime
starts (libgomp reads them when it loads, LLVM's libomp at its first
parallel region), so they reach neither other libraries nor child processes.
An OpenMP runtime that another extension already loaded into the process
keeps the settings it started with.
"""
from __future__ import annotations

import os

import numpy as np

# libgomp busy-wait rounds before sleeping (GOMP_SPINCOUNT), and LLVM libomp's
# equivalent in milliseconds (KMP_BLOCKTIME; its smallest step above 0, not
# measured: no libomp platform was at hand).
SPIN_COUNT = "30000"
BLOCK_TIME_MS = "1"
USER_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def wait_policy() -> str:
    """The wait setting the run loop's OpenMP runtime started with, in words."""
    return _policy


def _start_runtime():
    global _policy
    user = {k: os.environ[k] for k in USER_WAIT_VARIABLES if k in os.environ}
    if user:
        _policy = ", ".join(f"{k}={v}" for k, v in user.items()) + " (set by the user)"
        from . import _core
        return _core
    added = {"GOMP_SPINCOUNT": SPIN_COUNT, "KMP_BLOCKTIME": BLOCK_TIME_MS}
    os.environ.update(added)
    try:
        from . import _core
        # A first parallel region starts LLVM libomp (libgomp is already
        # started by now): packing a small matrix is one.
        _core.pack(np.zeros((16, 16), np.float32))
    finally:
        for k in added:
            os.environ.pop(k, None)
    _policy = f"GOMP_SPINCOUNT={SPIN_COUNT}, KMP_BLOCKTIME={BLOCK_TIME_MS} (fastllm default)"
    return _core


_policy = ""
_start_runtime()
