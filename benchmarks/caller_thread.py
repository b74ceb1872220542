"""Decode speed by the thread that calls the model.

Steps the model from the main thread, then from a second thread, then from
four threads at once (each its own Session, taking turns through the engine's
compute thread), and prints the median tokens/s of each over rounds. With the
OpenMP work started from whichever thread called, a second calling thread ran
at a third of the main thread's speed on 2 cores (libgomp keeps one worker
pool per calling thread and stops spinning at barriers once the pools
outnumber the cores); all calls now run on one compute thread.

    python benchmarks/caller_thread.py [--model M] [-t THREADS] [-n TOKENS] [-r ROUNDS]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from fastllm import Model


def decode(model, prompt, n: int) -> float:
    """Tokens/s of n greedy one-token steps after prompt, in a fresh Session."""
    session = model.new_session()
    logits = session.prefill(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = session.step(int(np.argmax(logits)))
    return n / (time.perf_counter() - t0)


def in_thread(fn, *args):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def together(model, prompt, n: int, callers: int) -> float:
    """Aggregate tokens/s of `callers` threads decoding at once."""
    start = threading.Barrier(callers)

    def run():
        start.wait()
        decode(model, prompt, n)
    threads = [threading.Thread(target=run) for _ in range(callers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return callers * n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-n", "--n-gen", type=int, default=64)
    p.add_argument("-r", "--rounds", type=int, default=5)
    args = p.parse_args(argv)
    model = Model.from_pretrained(args.model, threads=args.threads, n_ctx=1024)
    prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    decode(model, prompt, 8)   # warm-up
    results = {"main thread": [], "second thread": [], "4 threads at once (aggregate)": []}
    for _ in range(args.rounds):
        results["main thread"].append(decode(model, prompt, args.n_gen))
        results["second thread"].append(in_thread(decode, model, prompt, args.n_gen))
        results["4 threads at once (aggregate)"].append(together(model, prompt, args.n_gen, 4))
    print(f"| caller ({args.threads} OpenMP threads) | decode tokens/s, median of {args.rounds} |")
    print("|---|---:|")
    for name, rates in results.items():
        print(f"| {name} | {statistics.median(rates):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
