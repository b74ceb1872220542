#!/usr/bin/env python
"""fastllm against llama.cpp on the same GGUF files: decode and prompt speed,
load time, peak memory, and the memory two servers share.

    python benchmarks/perf_targets.py FILE.gguf [...] --llama-cpp DIR [--threads 1,2]
        [--pp 512] [--tg 128] [--reps 3] [--load-reps 3] [--parts speed,load,share]
        [--home DIR] [--json OUT] [--llama-no-amx]

DIR is llama.cpp's source tree with its build in DIR/build/bin (llama-bench,
libllama). fastllm runs with FASTLLM_HOME=--home (default: a folder of its
own under the system's temporary folder), where its packed-weights cache is
made once before anything is timed.

speed: each repetition reads `membw` at every thread count, then runs every
(file, threads) case once per engine, each run a process of its own, the
engine that goes first alternating (gguf_speed.py's runners: fastllm's
scale_worker.py on the file at its own types, int8 activations, f32 KV
cache, its packed weights mapped from the cache, made before the first
run; `llama-bench -r 1` with its
defaults). Medians of the repetitions, their ratios, each engine's decode
as a share of the ceiling the median bandwidth sets for the bytes of the
matrices a decoded token reads (gguf_speed.matrix_bytes: of a mixture's
experts, the share a token uses), and fastllm's peak RSS against the file's size, its KV
cache (and recurrent state) at the context of max(pp, tg), and 100 MiB.
`--pp 0` times decoding alone (and `--tg 0` prompts alone).

load: seconds from the start to the logits of a one-token prompt, the file
in the page cache, each run a process of its own, at the largest thread
count: fastllm's Model.from_pretrained, new_session and one step with its
cache warm, the first load of a cache file made before it ("cached", which
reads the whole file for its checksum; the file is left 2 s to settle, as
pack_cache asks before it records a file as checked) and the load after
that ("checked": the record says the file was checked whole and is
unchanged), with its cache file deleted first ("first load", which packs
and writes it), and with the cache off (FASTLLM_PACK_CACHE=0);
llama.cpp's llama_model_load_from_file, llama_init_from_model and one
llama_decode (benchmarks/llama_load.c, the calls llama-cli makes) with mmap
and without. Medians of --load-reps.

share: two `fastllm serve` processes on the first file, each answering one
request, then the proportional set size (PSS, /proc/PID/smaps_rollup) of
both against the resident size (RSS) of one: pages that both map from the
cache file count half in each.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import gguf_speed  # noqa: E402
import membw  # noqa: E402
from moe_speed import build_llama_load, llama_load_times  # noqa: E402


def log(msg: str) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"[{time.strftime('%H:%M:%S')} load {load:.1f}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------- workers

_PRELOAD = None   # the no-AMX shim for llama.cpp's runs (--llama-no-amx)


@contextlib.contextmanager
def llama_env():
    """os.environ as llama.cpp's runs get it (they inherit it)."""
    before = os.environ.get("LD_PRELOAD")
    if _PRELOAD:
        os.environ["LD_PRELOAD"] = _PRELOAD
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def build_no_amx(out: Path) -> str:
    exe = out / "no_amx.so"
    src = HERE / "no_amx_shim.c"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(src), "-o", str(exe), "-ldl"], check=True)
    return str(exe)


def worker_load(path: str, threads: int, fresh: bool) -> None:
    """In a process of its own: the seconds fastllm takes to load path and
    give a one-token prompt's logits; fresh: its cache file deleted first."""
    import resource

    from fastllm import Model
    from fastllm.load import pack_cache
    if fresh:
        for p in pack_cache.folder().glob(Path(path).name[:64] + "-*" + pack_cache.SUFFIX):
            p.unlink()
    t0 = time.perf_counter()
    model = Model.from_pretrained(path, n_ctx=512, threads=threads)
    t1 = time.perf_counter()
    model.new_session().step(0)
    t2 = time.perf_counter()
    print(json.dumps({"load_s": t1 - t0, "first_token_s": t2 - t0,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "cached": model.pack_cache_file is not None}))


def fastllm_load(path: Path, threads: int, env: dict, fresh: bool = False) -> dict:
    r = subprocess.run([sys.executable, __file__, "--worker-load", str(path), str(threads)]
                       + (["--fresh"] if fresh else []), capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"fastllm load of {path} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- bounds

def context_mib(path: Path, n_ctx: int) -> float:
    """fastllm's f32 KV cache at n_ctx (attention layers) and recurrent
    state (linear-attention layers) for the model of a GGUF file."""
    from fastllm.spec import schema
    from fastllm.formats.gguf import read_gguf_model
    cfg = read_gguf_model(path).config
    total = 0
    for i, lc in enumerate(cfg.layer_configs()):
        if cfg.layer_kind(i) == schema.LINEAR:
            k = cfg.linear_num_key_heads * cfg.linear_key_head_dim
            v = cfg.linear_num_value_heads * cfg.linear_value_head_dim
            total += (cfg.linear_conv_kernel_dim - 1) * (2 * k + v) + cfg.linear_num_value_heads \
                * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        elif cfg.kv_layer(i) == i:   # layers that reuse another's cache hold none
            total += 2 * lc.num_key_value_heads * lc.head_dim * n_ctx
    return total * 4 / 2**20


# ------------------------------------------------------------------ parts

def speed(files, args, env, report):
    bench = args.llama_cpp / "build" / "bin" / "llama-bench"
    exe = membw.build()
    threads = [int(t) for t in args.threads.split(",")]
    runs, bw = {}, {t: [] for t in threads}
    os.environ.update(env)
    for path in files:   # the packed-weights cache made, so that every timed run maps it
        fastllm_load(path, threads[0], env)
    for rep in range(args.reps):
        for t in threads:
            bw[t].append(membw.measure(exe, t))
        engines = gguf_speed.ENGINES if rep % 2 == 0 else gguf_speed.ENGINES[::-1]
        for path in files:
            for t in threads:
                for engine in engines:
                    if engine == "fastllm":
                        out = gguf_speed.fastllm_output(path, t, args.pp, args.tg)
                        got = {row["test"]: row["tok_s"] for row in out["results"]}
                        runs.setdefault((path, t, "rss"), []).append(out["peak_rss_mib"])
                    else:
                        with llama_env():
                            got = gguf_speed.llama_run(str(bench), path, t, args.pp, args.tg)
                    runs.setdefault((path, t, engine), []).append(got)
                log(f"speed rep {rep + 1}/{args.reps} ({engines[0]} first) {path.name} t={t}: "
                    + ", ".join(f"{e} {runs[(path, t, e)][-1]}" for e in gguf_speed.ENGINES))
    median_bw = {t: statistics.median(bw[t]) for t in threads}
    pp, tg = f"pp{args.pp}", f"tg{args.tg}"
    lines = [f"speed: medians of {args.reps} interleaved runs (first engine alternating), tokens/s; membw "
             + ", ".join(f"{t} threads {median_bw[t]:.1f} GB/s ({min(bw[t]):.1f}-{max(bw[t]):.1f})" for t in threads),
             "", f"| file | threads | {pp} fastllm / llama.cpp | ratio | {tg} fastllm / llama.cpp | ratio "
             "| tg of ceiling fastllm / llama.cpp | fastllm peak RSS / file + KV + 100 MiB |",
             "|---|---|---|---|---|---|---|---|"]
    rows = []
    for path in files:
        mb = gguf_speed.matrix_bytes(path)
        bound = os.path.getsize(path) / 2**20 + context_mib(path, max(args.pp, args.tg)) + 100
        for t in threads:
            med = {e: {k: statistics.median(r[k] for r in runs[(path, t, e)]) for k in runs[(path, t, e)][0]}
                   for e in gguf_speed.ENGINES}
            f, l = med["fastllm"], med["llama.cpp"]
            ceiling = median_bw[t] * 1e9 / mb
            rss = max(runs[(path, t, "rss")])
            rows.append({"file": path.name, "threads": t, "fastllm": f, "llama.cpp": l, "peak_rss_mib": rss,
                         "rss_bound_mib": bound, "membw": median_bw[t]})
            # --pp 0 or --tg 0 leaves that test out (a decoding-only run).
            prompt = (f"{f[pp]:.1f} / {l[pp]:.1f} | {f[pp] / l[pp]:.2f}" if pp in f else "- | -")
            decode = (f"{f[tg]:.2f} / {l[tg]:.2f} | {f[tg] / l[tg]:.2f} | {f[tg] / ceiling:.0%} / "
                      f"{l[tg] / ceiling:.0%}" if tg in f else "- | - | -")
            lines.append(f"| {path.name} | {t} | {prompt} | {decode} | {rss:.0f} / {bound:.0f} MiB |")
    report["speed"] = rows
    return lines


def load(files, args, env, report):
    exe = build_llama_load(args.llama_cpp, Path(args.home))
    t = max(int(x) for x in args.threads.split(","))
    off = dict(env, FASTLLM_PACK_CACHE="0")
    lines = [f"load: seconds to the logits of a one-token prompt, {t} threads, medians of {args.load_reps} "
             "(file in the page cache)", "",
             "| file | fastllm cached | fastllm checked | llama.cpp mmap | ratio (checked) | fastllm first load "
             "| llama.cpp no mmap | ratio | fastllm, cache off |", "|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for path in files:
        fastllm_load(path, t, env)   # the cache, and the metadata folder, made
        got = {}
        for rep in range(args.load_reps):
            order = ["llama", "cached", "checked", "first", "off"] if rep % 2 == 0 \
                else ["off", "first", "cached", "checked", "llama"]
            for what in order:
                if what == "llama":
                    with llama_env():
                        times = llama_load_times(exe, path, t)
                    for k, v in times.items():
                        got.setdefault(k, []).append(v["first_token_s"])
                else:
                    if what == "cached":
                        time.sleep(2.1)   # the file settles (pack_cache._SETTLED_NS)
                    r = fastllm_load(path, t, off if what == "off" else env, fresh=what == "first")
                    got.setdefault(what, []).append(r["first_token_s"])
            log(f"load rep {rep + 1}/{args.load_reps} {path.name}: "
                + ", ".join(f"{k} {v[-1]:.2f}" for k, v in got.items()))
        med = {k: statistics.median(v) for k, v in got.items()}
        rows.append(dict(file=path.name, **med))
        lines.append(f"| {path.name} | {med['cached']:.2f} | {med['checked']:.2f} | {med['llama.cpp mmap']:.2f} | "
                     f"{med['checked'] / med['llama.cpp mmap']:.2f} | {med['first']:.2f} | "
                     f"{med['llama.cpp no mmap']:.2f} | {med['first'] / med['llama.cpp no mmap']:.2f} | "
                     f"{med['off']:.2f} |")
    report["load"] = rows
    return lines


def _kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/smaps_rollup"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _ask(port: int, timeout: float) -> None:
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=timeout).read()


def share(files, args, env, report):
    path = files[0]
    t = max(int(x) for x in args.threads.split(","))
    fastllm_load(path, t, env)   # the cache made
    ports = [18731, 18732]
    procs = [subprocess.Popen([sys.executable, "-m", "fastllm", "serve", "--model", str(path), "--port", str(p),
                               "--threads", str(t), "--ctx", "512"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for p in ports]
    try:
        deadline = time.time() + 600
        for p in ports:
            while True:
                try:
                    _ask(p, 60)
                    break
                except OSError:
                    if time.time() > deadline or any(x.poll() is not None for x in procs):
                        raise SystemExit("the servers did not start")
                    time.sleep(1)
        pss = [_kib(x.pid, "Pss") / 1024 for x in procs]
        rss = [_kib(x.pid, "Rss") / 1024 for x in procs]
    finally:
        for x in procs:
            x.terminate()
        for x in procs:
            x.wait(timeout=60)
    report["share"] = {"file": path.name, "pss_mib": pss, "rss_mib": rss}
    return [f"share: two `fastllm serve` on {path.name}, one request each: PSS {pss[0]:.0f} + {pss[1]:.0f} = "
            f"{sum(pss):.0f} MiB against one process's RSS {max(rss):.0f} MiB: {sum(pss) / max(rss):.2f}x"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--llama-cpp", type=Path, required=True)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--load-reps", type=int, default=3)
    p.add_argument("--parts", default="speed,load,share")
    p.add_argument("--home", default=None, help="FASTLLM_HOME for fastllm's runs")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--llama-no-amx", action="store_true",
                   help="run llama.cpp without its AMX kernels (benchmarks/no_amx_shim.c), for machines "
                        "that report AMX but fault on it")
    args = p.parse_args(argv)
    args.home = args.home or str(Path(tempfile.gettempdir()) / "fastllm-perf-targets")
    Path(args.home).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FASTLLM_HOME=args.home, FASTLLM_PACK_CACHE="1",
               LD_LIBRARY_PATH=str(args.llama_cpp / "build" / "bin"),
               PYTHONPATH=os.pathsep.join(x for x in (str(HERE.parent / "src"), os.environ.get("PYTHONPATH"))
                                          if x))
    global _PRELOAD
    if args.llama_no_amx:
        _PRELOAD = build_no_amx(Path(args.home))
    log(f"{' '.join(sys.argv)}; fastllm home {args.home}")
    report, out = {"argv": sys.argv}, []
    parts = args.parts.split(",")
    for part in ("speed", "load", "share"):
        if part in parts:
            out += [""] + {"speed": speed, "load": load, "share": share}[part](args.files, args, env, report)
    print("\n".join(out))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker-load":
        worker_load(sys.argv[2], int(sys.argv[3]), "--fresh" in sys.argv[4:])
    else:
        sys.exit(main())
