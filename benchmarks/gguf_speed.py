#!/usr/bin/env python
"""fastllm and llama.cpp on the very same GGUF files, side by side.

Each repetition first measures the memory read bandwidth at every thread
count (membw.c: the fastest of 5 reads of a 1 GiB buffer by t OpenMP
threads, each summing the slice it first wrote; see membw.py), then times
every (file, threads) case once with each engine, every run in a process of
its own: scale_worker.py for fastllm (the file at its own precision, int8
activations) and llama-bench for llama.cpp, both with llama-bench's
protocol (pp N: one pass over N tokens after a warm-up pass; tg N: N
single-token steps). The engine that runs first alternates from one
repetition to the next, so that neither always finds the caches and the
CPU's clock in the state the other left. The table gives the median
tokens/s of each engine over the repetitions and their ratio, fastllm's
peak RSS beside the file size, and each engine's decode against the
ceiling that the median bandwidth sets for the bytes a token reads (the
file's matrix bytes).

    python benchmarks/gguf_speed.py FILE.gguf [...] --llama-bench PATH \
        [--threads 1,2] [--pp 512] [--tg 128] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import membw

HERE = Path(__file__).resolve().parent
ENGINES = ("fastllm", "llama.cpp")


def fastllm_output(path: Path, threads: int, pp: int, tg: int, dtype: str = "gguf") -> dict:
    """scale_worker.py's report of one fastllm process (load_s, peak_rss_mib, results)."""
    r = subprocess.run([sys.executable, str(HERE / "scale_worker.py"), "fastllm", str(path), dtype,
                        str(threads), str(pp), str(tg), "1"], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def fastllm_run(path: Path, threads: int, pp: int, tg: int, dtype: str = "gguf") -> tuple:
    """({test: tok/s}, peak RSS in MiB) of one fastllm process."""
    out = fastllm_output(path, threads, pp, tg, dtype)
    return {row["test"]: row["tok_s"] for row in out["results"]}, out["peak_rss_mib"]


def llama_run(llama_bench: str, path: Path, threads: int, pp: int, tg: int) -> dict:
    r = subprocess.run([llama_bench, "-m", str(path), "-t", str(threads), "-r", "1", "-p", str(pp),
                        "-n", str(tg), "-o", "jsonl"], capture_output=True, text=True, check=True)
    got = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            j = json.loads(line)
            got[f"pp{j['n_prompt']}" if j["n_prompt"] else f"tg{j['n_gen']}"] = j["avg_ts"]
    return got


def matrix_bytes(path: Path) -> int:
    """Bytes of the matrices one decoded token reads: every 2-D tensor but
    the embedding when the head has its own matrix, and of a mixture's
    expert tensors (3-D, one matrix per expert) the share of the experts a
    token uses (expert_used_count of expert_count)."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    tensors = reader.tensors
    names = {t.name for t in tensors}

    def number(suffix):
        keys = [k for k in reader.fields if k.endswith(suffix)]
        return int(reader.fields[keys[0]].parts[-1][0]) if keys else 0

    used, count = number(".expert_used_count"), number(".expert_count")
    total = 0
    for t in tensors:
        if len(t.shape) == 2 and not (t.name == "token_embd.weight" and "output.weight" in names):
            total += int(t.n_bytes)
        elif len(t.shape) == 3 and count:
            total += int(t.n_bytes) * used // count
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--llama-bench", required=True)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    exe = membw.build()
    runs, bw = {}, {t: [] for t in threads}
    for rep in range(args.reps):
        for t in threads:
            bw[t].append(membw.measure(exe, t))
        engines = ENGINES if rep % 2 == 0 else ENGINES[::-1]
        for path in args.files:
            for t in threads:
                for engine in engines:
                    if engine == "fastllm":
                        f, rss = fastllm_run(path, t, args.pp, args.tg)
                        runs.setdefault((path, t, "rss"), []).append(rss)
                    else:
                        f = llama_run(args.llama_bench, path, t, args.pp, args.tg)
                    runs.setdefault((path, t, engine), []).append(f)
                print(f"rep {rep + 1}/{args.reps} ({engines[0]} first) {path.name} t={t}: "
                      + ", ".join(f"{e} {runs[(path, t, e)][-1]}" for e in ENGINES), file=sys.stderr, flush=True)
        print(f"rep {rep + 1}/{args.reps} bandwidth: "
              + ", ".join(f"{t} threads {bw[t][-1]:.1f} GB/s" for t in threads), file=sys.stderr, flush=True)
    median_bw = {t: statistics.median(bw[t]) for t in threads}
    print(f"\nmedians of {args.reps} interleaved runs (first engine alternating), tokens/s; "
          "bandwidth (membw, median of one reading per repetition): "
          + ", ".join(f"{t} threads {median_bw[t]:.1f} GB/s ({min(bw[t]):.1f}-{max(bw[t]):.1f})" for t in threads))
    print(f"| file | threads | pp{args.pp} fastllm / llama.cpp | ratio | tg{args.tg} fastllm / llama.cpp | ratio "
          f"| tg of ceiling fastllm / llama.cpp | fastllm peak RSS / file |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.files:
        mb = matrix_bytes(path)
        for t in threads:
            med = {e: {k: statistics.median(r[k] for r in runs[(path, t, e)]) for k in runs[(path, t, e)][0]}
                   for e in ENGINES}
            pp, tg = f"pp{args.pp}", f"tg{args.tg}"
            ceiling = median_bw[t] * 1e9 / mb
            print(f"| {path.name} | {t} | {med['fastllm'][pp]:.0f} / {med['llama.cpp'][pp]:.0f} | "
                  f"{med['fastllm'][pp] / med['llama.cpp'][pp]:.2f} | {med['fastllm'][tg]:.1f} / "
                  f"{med['llama.cpp'][tg]:.1f} | {med['fastllm'][tg] / med['llama.cpp'][tg]:.2f} | "
                  f"{med['fastllm'][tg] / ceiling:.0%} / {med['llama.cpp'][tg] / ceiling:.0%} | "
                  f"{max(runs[(path, t, 'rss')]):.0f} / {os.path.getsize(path) / 2**20:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
