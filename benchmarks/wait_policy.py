"""How OpenMP's wait policy holds up when the cores are shared.

Runs `fastllm bench` in a fresh process per setting (the OpenMP runtime reads
its wait policy once, when it loads), with 0, 1 or 2 competing busy-loop
processes on the same machine, settings interleaved within each round, and
prints median tokens/s per setting and load.

    python benchmarks/wait_policy.py                   # default model, 2 threads
    python benchmarks/wait_policy.py --model M -t 2 -p 64 -n 16 -r 5 --loads 0,1,2

The competing processes are plain Python loops that stop by themselves.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Environment of each setting. "fastllm default" leaves the variables unset,
# so fastllm picks its own default (fastllm/core/_openmp.py).
SETTINGS = {
    "fastllm default": {},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "GOMP_SPINCOUNT=1000": {"GOMP_SPINCOUNT": "1000"},
    "GOMP_SPINCOUNT=3000": {"GOMP_SPINCOUNT": "3000"},
    "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"},
    "libgomp default (300000)": {"GOMP_SPINCOUNT": "300000"},
    "active": {"OMP_WAIT_POLICY": "active"},
}
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def start_load(n: int, seconds: float) -> list[subprocess.Popen]:
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def bench_once(env_extra: dict, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "fastllm", "bench", "-p", str(args.n_prompt), "-n", str(args.n_gen),
           "-r", "1", "-t", str(args.threads), "--json"]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    rows = json.loads(out.stdout)["results"]
    return {r["test"]: r["tokens_per_s_median"] for r in rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("-t", "--threads", type=int, default=2, help="fastllm threads (default: 2)")
    p.add_argument("-p", "--n-prompt", type=int, default=64, help="prompt tokens (default: 64)")
    p.add_argument("-n", "--n-gen", type=int, default=16, help="generated tokens (default: 16)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="rounds (default: 3)")
    p.add_argument("--loads", default="0,1,2", help="competing busy processes (default: 0,1,2)")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help="comma-separated: any of " + ", ".join(SETTINGS) +
                        ", or VAR=VALUE for " + ", ".join(WAIT_VARS))
    p.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    for name in names:
        var, eq, value = name.partition("=")
        if name not in SETTINGS and eq and var in WAIT_VARS:
            SETTINGS[name] = {var: value}  # any other value of a wait variable
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings: {unknown}")
    loads = [int(x) for x in args.loads.split(",")]

    results: dict = {}
    for load in loads:
        for rep in range(args.repetitions):
            procs = start_load(load, 600)
            try:
                time.sleep(0.2 if load else 0)
                for name in names:
                    for test, tps in bench_once(SETTINGS[name], args).items():
                        results.setdefault((load, name, test), []).append(tps)
            finally:
                for pr in procs:
                    pr.kill()
                    pr.wait()
    tests = sorted({k[2] for k in results}, key=lambda t: (t[:2] != "pp", t))
    print(f"fastllm bench, {args.threads} threads, median of {args.repetitions} (tokens/s)")
    print("| competing processes | setting | " + " | ".join(tests) + " |")
    print("|---|---|" + "---|" * len(tests))
    for load in loads:
        for name in names:
            cells = [f"{statistics.median(results[(load, name, t)]):.1f}" for t in tests]
            print(f"| {load} | {name} | " + " | ".join(cells) + " |")
    if args.json:
        print(json.dumps([{"load": k[0], "setting": k[1], "test": k[2], "runs": v}
                          for k, v in results.items()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
