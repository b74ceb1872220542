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
        {--llama-bench LEVEL=PATH ... | --llama-cpp SRC --work DIR --levels dotprod,i8mm} \
        [--python SYSROOT/usr/bin/python3.11 --sysroot SYSROOT --pythonpath DIR[:DIR]] \
        [--pp 32,64] [--tg 8,32] [--profile N] [--json OUT]

A level names the feature level and so the emulated CPU (neon: cortex-a72,
dotprod: neoverse-n1, i8mm: max); fastllm picks its path from the CPU's
features at run time and runs at every level given. --llama-cpp cross-builds
a static llama-bench per level (once; the builds stay in DIR). Without
--python only llama.cpp is counted. --profile N also counts by function
(from the plugin's per-block profile and the ELF symbols) and lists each
engine's N costliest functions. Prints markdown tables.

llama.cpp's counts repeat to within tens of instructions; fastllm's (a
Python process with three threads) move by a few million a run, which is
why the decode lengths are 24 tokens apart by default.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN_SOURCE = HERE / "qemu_count_plugin.c"
LEVEL_CPU = {"neon": "cortex-a72", "dotprod": "neoverse-n1", "i8mm": "max"}
# llama.cpp's -march per level: its own CPU variants armv8.0_1, armv8.2_2
# (dotprod, fp16 arithmetic) and android_armv8.6_1 (+ i8mm, without SVE).
LEVEL_MARCH = {"neon": "armv8-a", "dotprod": "armv8.2-a+dotprod+fp16", "i8mm": "armv8.6-a+dotprod+fp16+i8mm"}
TOOLCHAIN = """set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
"""


def build_plugin(folder: Path) -> Path:
    lib = folder / "libcount.so"
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(lib), str(PLUGIN_SOURCE)],
                   check=True)
    return lib


class Run:
    """One run of a command under qemu-aarch64: its instruction count, the
    vCPUs (threads) seen, its stdout and, when profiled, instructions by
    function."""

    def __init__(self, plugin: Path, cpu: str, cmd: list, sysroot: Path | None = None, env: dict | None = None,
                 profile: bool = False, maps: Path | None = None):
        with tempfile.TemporaryDirectory() as tmp:
            out, prof = Path(tmp) / "count.txt", Path(tmp) / "profile.txt"
            args = f"{plugin},outfile={out}" + (f",profile={prof}" if profile else "")
            qemu = ["qemu-aarch64", "-cpu", cpu, "-plugin", args] + (["-L", str(sysroot)] if sysroot else [])
            r = subprocess.run(qemu + [str(c) for c in cmd], capture_output=True, text=True,
                               env={**os.environ, **(env or {}), **({"MAPS_OUT": str(maps)} if maps else {})})
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(map(str, cmd))} failed under qemu ({r.returncode}):\n{r.stderr[-3000:]}")
            words = out.read_text().split()   # "insns N vcpus V"
            self.insns, self.vcpus, self.stdout = int(words[1]), int(words[3]), r.stdout
            self.functions = by_function(prof, mappings(maps, Path(cmd[0]))) if profile else None


# ---- profiles: guest addresses to function names ----

def mappings(maps: Path | None, exe: Path) -> list:
    """[(start, end, file offset, path)] of the executable mappings: from the
    guest's /proc/self/maps when it left one, else the (static) program alone."""
    if maps is None:
        return [(0, 1 << 64, 0, str(exe))]
    found = []
    for line in maps.read_text().splitlines():
        f = line.split(maxsplit=5)
        if len(f) == 6 and "x" in f[1]:
            start, end = (int(x, 16) for x in f[0].split("-"))
            found.append((start, end, int(f[2], 16), f[5]))
    return found


@functools.lru_cache(maxsize=None)
def elf_symbols(path: str) -> tuple:
    """(is position-independent, LOAD segments [(offset, size, vaddr)], sorted
    function start addresses, their names)."""
    head = subprocess.run(["readelf", "-hlW", path], capture_output=True, text=True).stdout
    segments = [(int(o, 16), int(fs, 16), int(v, 16)) for o, v, fs in
                re.findall(r"LOAD\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+0x[0-9a-f]+\s+(0x[0-9a-f]+)", head)]
    syms = {}
    for dynamic in ([], ["-D"]):   # stripped files keep their dynamic symbols
        nm = subprocess.run(["aarch64-linux-gnu-nm", "-C", "--defined-only", *dynamic, path],
                            capture_output=True, text=True).stdout
        for line in nm.splitlines():
            f = line.split(" ", 2)
            if len(f) == 3 and f[1] in "TtWwi" and int(f[0], 16):
                syms.setdefault(int(f[0], 16), f[2])
    addrs = sorted(syms)
    pie = re.search(r"Type:\s+DYN", head) is not None
    return pie, segments, addrs, [syms[a] for a in addrs]


def symbolize(addr: int, maps: list) -> str:
    for start, end, offset, path in maps:
        if start <= addr < end:
            break
    else:
        return "?"
    pie, segments, addrs, names = elf_symbols(path)
    vaddr = addr
    if pie:
        at = addr - start + offset
        seg = next((s for s in segments if s[0] - s[0] % 4096 <= at < s[0] + s[1]), None)
        vaddr = at + (seg[2] - seg[0] if seg else 0)
    i = bisect.bisect_right(addrs, vaddr) - 1
    return names[i] if i >= 0 else f"{Path(path).name}+?"


def by_function(profile: Path, maps: list) -> collections.Counter:
    total = collections.Counter()
    for line in profile.read_text().splitlines():
        addr, n, runs = line.split()
        total[symbolize(int(addr, 16), maps)] += int(n) * int(runs)
    return total


def per_token(runs: dict, passes: int) -> float:
    """Instructions per token from two runs {tokens: Run}, each doing
    `passes` counted passes over its tokens."""
    (n1, r1), (n2, r2) = sorted(runs.items())
    return (r2.insns - r1.insns) / (passes * (n2 - n1))


def per_token_by_function(runs: dict, passes: int) -> dict:
    (n1, r1), (n2, r2) = sorted(runs.items())
    if r1.functions is None:
        return {}
    return {f: (r2.functions[f] - r1.functions[f]) / (passes * (n2 - n1))
            for f in set(r1.functions) | set(r2.functions)}


def build_llama_bench(src: Path, work: Path, level: str, jobs: int = 2) -> Path:
    """A static aarch64 llama-bench for one level, cross-built (Debian's
    g++-aarch64-linux-gnu) into work/build-LEVEL unless already there."""
    build = work / f"build-{level}"
    exe = build / "bin" / "llama-bench"
    if exe.exists():
        return exe
    work.mkdir(parents=True, exist_ok=True)
    (work / "toolchain-aarch64.cmake").write_text(TOOLCHAIN)
    off = ["LLAMA_OPENSSL", "LLAMA_BUILD_TESTS", "LLAMA_BUILD_EXAMPLES", "LLAMA_BUILD_SERVER", "LLAMA_BUILD_APP",
           "BUILD_SHARED_LIBS", "GGML_NATIVE", "GGML_OPENMP"]
    subprocess.run(["cmake", "-S", src, "-B", build, "-G", "Ninja", f"-DCMAKE_TOOLCHAIN_FILE={work}/toolchain-aarch64.cmake",
                    "-DCMAKE_BUILD_TYPE=Release", f"-DGGML_CPU_ARM_ARCH={LEVEL_MARCH[level]}",
                    "-DCMAKE_EXE_LINKER_FLAGS=-static", *(f"-D{o}=OFF" for o in off)], check=True)
    subprocess.run(["nice", "ninja", "-C", build, f"-j{jobs}", "llama-bench"], check=True)
    return exe


def llama_cmd(bench: Path, gguf: Path, pp: int, tg: int) -> list:
    return [bench, "-m", gguf, "-t", "1", "-r", "1", "-p", pp, "-n", tg]


# scale_worker.py, then the guest's view of its own mappings (MAPS_OUT), by
# which a profile's addresses are put to the functions of each library.
WORKER = ("import os, runpy, sys\n"
          "sys.argv = sys.argv[1:]\n"
          "try:\n"
          "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
          "finally:\n"
          "    if os.environ.get('MAPS_OUT'):\n"
          "        open(os.environ['MAPS_OUT'], 'w').write(open('/proc/self/maps').read())\n")


def fastllm_cmd(python: Path, gguf: Path, pp: int, tg: int) -> list:
    # -S: no site module, so nothing of the host's Python is looked for.
    return [python, "-S", "-c", WORKER, HERE / "scale_worker.py", "fastllm", gguf, "gguf", 1, pp, tg, 1]


# One thread everywhere (numpy's OpenBLAS too), and a fixed hash seed so that
# the interpreter's own work does not change from one run to the next.
FASTLLM_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def measure(run, pps, tgs, prime: bool = False) -> dict:
    """{pp, tg: instructions per token, vcpus, info} for one engine, file and
    CPU. prime: one uncounted run first, for what a first run does once
    (fastllm caches a GGUF's tokenizer and config on first load)."""
    if prime:
        run(0, 0)
    pp_runs = {p: run(p, 0) for p in pps}
    tg_runs = {g: run(0, g) for g in tgs}
    every = [*pp_runs.values(), *tg_runs.values()]
    return {"pp": per_token(pp_runs, 2), "tg": per_token(tg_runs, 1),
            "pp_functions": per_token_by_function(pp_runs, 2), "tg_functions": per_token_by_function(tg_runs, 1),
            "vcpus": sorted({r.vcpus for r in every}), "info": every[-1].info,
            "pp_runs": {p: r.insns for p, r in pp_runs.items()}, "tg_runs": {g: r.insns for g, r in tg_runs.items()}}


def top_functions(m: dict, n: int) -> list:
    """The n functions with the most decode instructions per token, as rows."""
    names = sorted(m["tg_functions"], key=lambda f: -m["tg_functions"][f])[:n]
    return [(f, m["pp_functions"].get(f, 0.0), m["tg_functions"][f]) for f in names]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", nargs="+", type=Path)
    p.add_argument("--llama-bench", action="append", default=[], metavar="LEVEL=PATH",
                   help="an aarch64 llama-bench (static) built for LEVEL: neon, dotprod or i8mm")
    p.add_argument("--llama-cpp", type=Path, help="llama.cpp's sources: build llama-bench for each of --levels")
    p.add_argument("--work", type=Path, help="where --llama-cpp's builds go (kept for later runs)")
    p.add_argument("--levels", default=None,
                   help="feature levels to run at (default: those of --llama-bench)")
    p.add_argument("--python", type=Path, help="an aarch64 python3 that can import fastllm")
    p.add_argument("--sysroot", type=Path, help="the aarch64 root its shared libraries are in (qemu -L)")
    p.add_argument("--pythonpath", default="", help="PYTHONPATH for that python (fastllm and numpy)")
    p.add_argument("--pp", default="32,64", help="two prompt lengths")
    p.add_argument("--tg", default="8,32", help="two decode lengths")
    p.add_argument("--json", type=Path, help="also write every count here")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also count by function and list each engine's N costliest functions")
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
    if args.llama_cpp:
        if not args.work:
            sys.exit("--llama-cpp needs --work DIR for its builds")
        for level in levels:
            benches.setdefault(level, build_llama_bench(args.llama_cpp, args.work.resolve(), level))

    rows, dump, profile = [], [], args.profile > 0
    with tempfile.TemporaryDirectory() as tmp:
        plugin = build_plugin(Path(tmp))
        for gguf in args.gguf:
            for level in levels:
                cpu = LEVEL_CPU[level]
                got = {}
                if level in benches:
                    def run_llama(pp, tg):
                        r = Run(plugin, cpu, llama_cmd(Path(benches[level]), gguf, pp, tg), profile=profile)
                        r.info = f"llama-bench {level}"
                        return r
                    got["llama.cpp"] = measure(run_llama, pps, tgs)
                if args.python:
                    env = {"PYTHONPATH": args.pythonpath, **FASTLLM_ENV}

                    def run_fastllm(pp, tg):
                        r = Run(plugin, cpu, fastllm_cmd(args.python, gguf, pp, tg), args.sysroot, env,
                                profile=profile, maps=Path(tmp) / "maps.txt" if profile else None)
                        r.info = json.loads(r.stdout.strip().splitlines()[-1])["info"]["simd"]
                        return r
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
    if profile:
        for name, level, cpu, got in rows:
            for engine, m in got.items():
                print(f"\n{engine} on {name}, {cpu}: the {args.profile} functions with the most decode "
                      f"instructions, millions per token (a difference of two runs: negative where the "
                      f"longer run takes another path through a function)\n")
                print("| function | prompt | decode |")
                print("|---|---|---|")
                for f, pp, tg in top_functions(m, args.profile):
                    print(f"| `{f}` | {pp / 1e6:.2f} | {tg / 1e6:.2f} |")


if __name__ == "__main__":
    main()
