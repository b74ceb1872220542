#!/usr/bin/env python
"""fastllm and llama.cpp on the very same GGUF files, side by side.

Each repetition times every (file, threads) case once with each engine, in
turn (fastllm, llama.cpp, fastllm, ...), every run in a process of its own:
scale_worker.py for fastllm (the file at its own precision, int8
activations) and llama-bench for llama.cpp, both with llama-bench's protocol
(pp N: one pass over N tokens after a warm-up pass; tg N: N single-token
steps). The table gives the median tokens/s of each engine over the
repetitions and their ratio, fastllm's peak RSS beside the file size, and
how close fastllm's decode comes to the bandwidth ceiling of the bytes a
token reads (the file's matrix bytes; membw.c measures the bandwidth in
the same run).

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
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def fastllm_run(path: Path, threads: int, pp: int, tg: int) -> tuple:
    """({test: tok/s}, peak RSS in MiB) of one fastllm process."""
    r = subprocess.run([sys.executable, str(HERE / "scale_worker.py"), "fastllm", str(path), "gguf",
                        str(threads), str(pp), str(tg), "1"], capture_output=True, text=True, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
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


def bandwidth(threads: int) -> float:
    """GB/s of reading a 1 GiB buffer (membw.c), median of its reads."""
    exe = Path(tempfile.gettempdir()) / "fastllm-membw"
    if not exe.exists():
        subprocess.run(["cc", "-O2", "-fopenmp", str(HERE / "membw.c"), "-o", str(exe)], check=True)
    r = subprocess.run([str(exe), "1024"], capture_output=True, text=True, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    return json.loads(r.stdout)["gb_per_s"]


def matrix_bytes(path: Path) -> int:
    """Bytes of the 2-D tensors a token reads (all but the embedding when
    the head has its own matrix)."""
    import gguf
    tensors = gguf.GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    return sum(int(t.n_bytes) for t in tensors if len(t.shape) == 2
               and not (t.name == "token_embd.weight" and "output.weight" in names))


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
    runs = {}
    for rep in range(args.reps):
        for path in args.files:
            for t in threads:
                f, rss = fastllm_run(path, t, args.pp, args.tg)
                runs.setdefault((path, t, "fastllm"), []).append(f)
                runs.setdefault((path, t, "rss"), []).append(rss)
                runs.setdefault((path, t, "llama.cpp"), []).append(
                    llama_run(args.llama_bench, path, t, args.pp, args.tg))
                print(f"rep {rep + 1}/{args.reps} {path.name} t={t}: fastllm {f}, "
                      f"llama.cpp {runs[(path, t, 'llama.cpp')][-1]}", file=sys.stderr, flush=True)
    bw = {t: bandwidth(t) for t in threads}
    print(f"\nmedians of {args.reps} interleaved runs, tokens/s; bandwidth (1 GiB read): "
          + ", ".join(f"{t} threads {bw[t]:.1f} GB/s" for t in threads))
    print(f"| file | threads | pp{args.pp} fastllm / llama.cpp | ratio | tg{args.tg} fastllm / llama.cpp | ratio "
          f"| tg of ceiling | fastllm peak RSS / file |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.files:
        mb = matrix_bytes(path)
        for t in threads:
            med = {e: {k: statistics.median(r[k] for r in runs[(path, t, e)]) for k in runs[(path, t, e)][0]}
                   for e in ("fastllm", "llama.cpp")}
            pp, tg = f"pp{args.pp}", f"tg{args.tg}"
            ceiling = bw[t] * 1e9 / mb
            print(f"| {path.name} | {t} | {med['fastllm'][pp]:.0f} / {med['llama.cpp'][pp]:.0f} | "
                  f"{med['fastllm'][pp] / med['llama.cpp'][pp]:.2f} | {med['fastllm'][tg]:.1f} / "
                  f"{med['llama.cpp'][tg]:.1f} | {med['fastllm'][tg] / med['llama.cpp'][tg]:.2f} | "
                  f"{med['fastllm'][tg] / ceiling:.0%} | {max(runs[(path, t, 'rss')]):.0f} / "
                  f"{os.path.getsize(path) / 2**20:.0f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
