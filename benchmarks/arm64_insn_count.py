#!/usr/bin/env python
"""Guest instructions per token of fastllm and llama.cpp built for aarch64,
counted under qemu-user: the same GGUF file, the same emulated CPU, 1 thread.

qemu_count_plugin.c (built here with the host's cc) counts every guest
instruction a run executes. Load, start-up and warm-up cost the same in two
runs that differ only in the number of tokens, so differencing them leaves
the work per token:

    prompt:   runs of pp P1 and pp P2, each one warm-up pass over the prompt
              and one counted pass (llama-bench's protocol, -r 1):
              (count(P2) - count(P1)) / (2 (P2 - P1))
    decode:   runs of tg G1 and tg G2 (a one-token warm-up, then G steps
              from an empty cache): (count(G2) - count(G1)) / (G2 - G1)

llama.cpp runs as llama-bench (`-t 1 -r 1`), fastllm as scale_worker.py on
an aarch64 Python (the protocol is the same). Both see random tokens and
compute logits for the last token only; neither samples.

    python benchmarks/arm64_insn_count.py FILE.gguf [...] \
        --llama-bench dotprod=DIR/llama-bench [--llama-bench i8mm=DIR2/llama-bench] \
        [--python SYSROOT/usr/bin/python3.11 --sysroot SYSROOT --pythonpath DIR[:DIR]] \
        [--pp 32,64] [--tg 8,16]

A level names the feature level and so the emulated CPU (neon: cortex-a72,
dotprod: neoverse-n1, i8mm: max); fastllm picks its path from the CPU's
features at run time and runs at every level given. Without --python only
llama.cpp is counted. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN_SOURCE = HERE / "qemu_count_plugin.c"
LEVEL_CPU = {"neon": "cortex-a72", "dotprod": "neoverse-n1", "i8mm": "max"}


def build_plugin(folder: Path) -> Path:
    lib = folder / "libcount.so"
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(lib), str(PLUGIN_SOURCE)],
                   check=True)
    return lib


def count(plugin: Path, cpu: str, cmd: list, sysroot: Path | None = None, env: dict | None = None) -> tuple:
    """(instructions, vCPUs seen, stdout) of one run of cmd under qemu-aarch64."""
    with tempfile.NamedTemporaryFile("r", suffix=".txt") as out:
        qemu = ["qemu-aarch64", "-cpu", cpu, "-plugin", f"{plugin},outfile={out.name}"]
        if sysroot:
            qemu += ["-L", str(sysroot)]
        r = subprocess.run(qemu + [str(c) for c in cmd], capture_output=True, text=True,
                           env={**os.environ, **(env or {})})
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed under qemu ({r.returncode}):\n{r.stderr[-3000:]}")
        words = out.read().split()   # "insns N vcpus V"
    return int(words[1]), int(words[3]), r.stdout


def per_token(runs: dict, passes: int) -> float:
    """Instructions per token from two runs {tokens: count}, each doing
    `passes` counted passes over its tokens."""
    (n1, c1), (n2, c2) = sorted(runs.items())
    return (c2 - c1) / (passes * (n2 - n1))


def llama_cmd(bench: Path, gguf: Path, pp: int, tg: int) -> list:
    return [bench, "-m", gguf, "-t", "1", "-r", "1", "-p", pp, "-n", tg]


def fastllm_cmd(python: Path, gguf: Path, pp: int, tg: int) -> list:
    # -S: no site module, so nothing of the host's Python is looked for.
    return [python, "-S", HERE / "scale_worker.py", "fastllm", gguf, "gguf", 1, pp, tg, 1]


# One thread everywhere (numpy's OpenBLAS too), and a fixed hash seed so that
# the interpreter's own work does not change from one run to the next.
FASTLLM_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def measure(run, pps, tgs, prime: bool = False) -> dict:
    """{pp, tg: instructions per token, vcpus, info} for one engine, file and
    CPU. prime: one uncounted run first, for what a first run does once
    (fastllm caches a GGUF's tokenizer and config on first load)."""
    if prime:
        run(0, 0)
    pp_runs, tg_runs, vcpus, info = {}, {}, set(), None
    for p in pps:
        pp_runs[p], v, info = run(p, 0)
        vcpus.add(v)
    for g in tgs:
        tg_runs[g], v, info = run(0, g)
        vcpus.add(v)
    return {"pp": per_token(pp_runs, 2), "tg": per_token(tg_runs, 1), "vcpus": sorted(vcpus),
            "info": info, "pp_runs": pp_runs, "tg_runs": tg_runs}


def fastllm_info(stdout: str) -> str:
    return json.loads(stdout.strip().splitlines()[-1])["info"]["simd"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", nargs="+", type=Path)
    p.add_argument("--llama-bench", action="append", default=[], metavar="LEVEL=PATH",
                   help="an aarch64 llama-bench (static) built for LEVEL: neon, dotprod or i8mm")
    p.add_argument("--levels", default=None,
                   help="feature levels to run fastllm at (default: those of --llama-bench)")
    p.add_argument("--python", type=Path, help="an aarch64 python3 that can import fastllm")
    p.add_argument("--sysroot", type=Path, help="the aarch64 root its shared libraries are in (qemu -L)")
    p.add_argument("--pythonpath", default="", help="PYTHONPATH for that python (fastllm and numpy)")
    p.add_argument("--pp", default="32,64", help="two prompt lengths")
    p.add_argument("--tg", default="8,16", help="two decode lengths")
    p.add_argument("--json", type=Path, help="also write every count here")
    args = p.parse_args()
    pps = [int(x) for x in args.pp.split(",")]
    tgs = [int(x) for x in args.tg.split(",")]
    if len(pps) != 2 or len(tgs) != 2 or pps[0] == pps[1] or tgs[0] == tgs[1] or min(pps + tgs) < 1:
        sys.exit("--pp and --tg each take two different positive lengths")
    benches = dict(item.split("=", 1) for item in args.llama_bench)
    levels = args.levels.split(",") if args.levels else list(benches)
    for level in list(benches) + levels:
        if level not in LEVEL_CPU:
            sys.exit(f"unknown level {level!r}: one of {', '.join(LEVEL_CPU)}")
    if not levels:
        sys.exit("give --llama-bench LEVEL=PATH or --levels")

    rows, dump = [], []
    with tempfile.TemporaryDirectory() as tmp:
        plugin = build_plugin(Path(tmp))
        for gguf in args.gguf:
            for level in levels:
                cpu = LEVEL_CPU[level]
                got = {}
                if level in benches:
                    def run_llama(pp, tg):
                        n, v, _ = count(plugin, cpu, llama_cmd(Path(benches[level]), gguf, pp, tg))
                        return n, v, f"llama-bench {level}"
                    got["llama.cpp"] = measure(run_llama, pps, tgs)
                if args.python:
                    env = {"PYTHONPATH": args.pythonpath, **FASTLLM_ENV}

                    def run_fastllm(pp, tg):
                        n, v, out = count(plugin, cpu, fastllm_cmd(args.python, gguf, pp, tg), args.sysroot, env)
                        return n, v, fastllm_info(out)
                    got["fastllm"] = measure(run_fastllm, pps, tgs, prime=True)
                for engine, m in got.items():
                    dump.append({"file": gguf.name, "level": level, "cpu": cpu, "engine": engine, **m})
                    print(f"{gguf.name} {cpu} {engine}: pp {m['pp']:,.0f} tg {m['tg']:,.0f} per token "
                          f"(vcpus {m['vcpus']}, {m['info']})", file=sys.stderr, flush=True)
                rows.append((gguf.name, level, cpu, got))

    if args.json:
        args.json.write_text(json.dumps(dump, indent=1))
    print(f"\nGuest instructions per token, 1 thread (pp {pps[0]}->{pps[1]}, tg {tgs[0]}->{tgs[1]}), millions:\n")
    print("| file | CPU (qemu) | engine (path) | prompt, per token | decode, per token |")
    print("|---|---|---|---|---|")
    for name, level, cpu, got in rows:
        for engine, m in got.items():
            print(f"| {name} | {cpu} | {engine} ({m['info']}) | {m['pp'] / 1e6:.2f} | {m['tg'] / 1e6:.2f} |")
        if len(got) == 2:
            f, l = got["fastllm"], got["llama.cpp"]
            print(f"| | | fastllm / llama.cpp | {f['pp'] / l['pp']:.2f} | {f['tg'] / l['tg']:.2f} |")


if __name__ == "__main__":
    main()
