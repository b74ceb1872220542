#!/usr/bin/env python
"""How fastllm scales with threads and model size, next to llama.cpp and transformers.

Every model is a random-weight checkpoint of a real model's shape (the table
SHAPES below): speed depends on shapes and precision, not on the values, and
no download is needed. Checkpoints (bf16 safetensors, made with transformers
from the config) and llama.cpp's GGUF files (made by its own
convert_hf_to_gguf.py, Q8_0 by llama-quantize) are kept in --cache and reused.

Each case is one engine, model, dtype and thread count, timed in a process
of its own with llama-bench's protocol (scale_worker.py for fastllm and
transformers, llama-bench itself for llama.cpp): pp N is one forward pass
over N tokens from an empty cache after one full warm-up pass, tg N is N
single-token steps after a one-token warm-up, and each figure is the mean
tokens/s over --reps runs. A memory-bandwidth probe (membw.c) runs at each
thread count: token generation reads every weight once per token, so
weight bytes per token x tokens/s over that bandwidth says how close tg is to
its ceiling.

After every case the results so far are written to --out: results.json (all
numbers; a later run into the same folder adds to it), scale.md (the tables)
and scale.png (tokens/s against threads). --time-budget skips cases, the
largest first, whose estimated time no longer fits.

    python benchmarks/scale.py --shapes 135m --threads 1,2 --pp 64 --tg 16 \
        --llama-bench $T/llb/bin/llama-bench --out scale-out
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import membw  # noqa: E402
import plot_png  # noqa: E402

# config.json values of the real models (their HF repositories), the shape
# being all that matters here.
SMOLLM2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
               tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, bos_token_id=1, eos_token_id=2, hidden_act="silu")
QWEN25 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936,
              tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
              rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
              use_sliding_window=False)
SHAPES = {
    "smollm2-135m": dict(SMOLLM2, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "smollm2-360m": dict(SMOLLM2, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5, head_dim=64),
    "smollm2-1.7b": dict(SMOLLM2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=64,
                         rope_theta=130000.0),
    "qwen2.5-0.5b": dict(QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "llama-3.2-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000,
                         eos_token_id=128001, hidden_act="silu", hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}
ENGINES = ("fastllm", "llama.cpp", "transformers")
ENGINE_DTYPES = {"fastllm": ("f32", "bf16"), "llama.cpp": ("f32", "bf16", "q8_0"),
                 "transformers": ("f32", "bf16")}
DTYPES = ("f32", "bf16", "q8_0")
BYTES_PER_WEIGHT = {"f32": 4.0, "bf16": 2.0, "q8_0": 34 / 32}  # Q8_0: 32 int8 + one f16 scale
GGUF_TYPE = {"f32": "f32", "bf16": "bf16", "q8_0": "Q8_0"}

# A-priori speeds for the time estimates, corrected by every measured case:
# prompt FLOP/s per thread, and the share of the measured bandwidth that
# generation reaches. Rough values from a 16-core Xeon with AVX-512 and AMX.
PP_FLOPS_PER_THREAD = {"fastllm": 50e9, "llama.cpp": 60e9, "transformers": 60e9}
TG_BANDWIDTH_SHARE = {"fastllm": 0.6, "llama.cpp": 0.6, "transformers": 0.3}
START_S = {"fastllm": 1.5, "llama.cpp": 0.5, "transformers": 5.0}  # process start and imports


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Shapes


def resolve_shape(name: str) -> str:
    """A shape by its full name or by the size at its end (135m, 1.7b, 1b)."""
    if name in SHAPES:
        return name
    hits = [s for s in SHAPES if s.endswith("-" + name.lower())]
    if len(hits) != 1:
        raise SystemExit(f"unknown or ambiguous shape {name!r} (shapes: {', '.join(SHAPES)})")
    return hits[0]


def q_dim(cfg: dict) -> int:
    heads = cfg["num_attention_heads"]
    return heads * (cfg.get("head_dim") or cfg["hidden_size"] // heads)


def matrix_weights(cfg: dict) -> tuple:
    """(weights a decode step reads: every layer matrix and the lm_head;
    weights a prompt token multiplies: the layer matrices, the lm_head
    running for the last token only)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = q_dim(cfg)
    kv = q // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    layer = h * (q + 2 * kv) + q * h + 3 * h * i
    layers = cfg["num_hidden_layers"] * layer
    return layers + cfg["vocab_size"] * h, layers


def weight_bytes_per_token(shape: str, dtype: str) -> float:
    return matrix_weights(SHAPES[shape])[0] * BYTES_PER_WEIGHT[dtype]


# --------------------------------------------------------------------------
# Checkpoints and GGUF files


def run_logged(cmd: list, logfile: Path, env=None, timeout=None) -> float:
    """Run cmd with its output in logfile; returns seconds, raises with the log's tail."""
    t0 = time.perf_counter()
    with open(logfile, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                            timeout=timeout).returncode
    if rc:
        tail = "".join(Path(logfile).read_text(errors="replace").splitlines(True)[-15:])
        raise RuntimeError(f"{shlex.join(map(str, cmd))} failed ({rc}):\n{tail}")
    return time.perf_counter() - t0


class Artifacts:
    """Checkpoint folders and GGUF files of the shapes, made once in the cache
    (each written under a temporary name and renamed when complete)."""

    def __init__(self, cache: Path, tokenizer: Path, convert, quantize, logs: Path):
        self.cache, self.tokenizer, self.convert, self.quantize = cache, tokenizer, convert, quantize
        self.logs = logs
        self.timings = []

    def folder(self, shape: str) -> Path:
        return self.cache / shape

    def gguf(self, shape: str, dtype: str) -> Path:
        return self.cache / f"{shape}-{GGUF_TYPE[dtype]}.gguf"

    def _timed(self, what: str, seconds: float) -> None:
        self.timings.append({"what": what, "seconds": round(seconds, 1)})
        log(f"  made {what} in {seconds:.1f} s")

    def make_checkpoint(self, shape: str) -> Path:
        out = self.folder(shape)
        if (out / "model.safetensors").exists():
            return out
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if not (self.tokenizer / f).exists():
                raise SystemExit(f"{self.tokenizer / f} is missing: --tokenizer names a folder "
                                 "with a SmolLM2 tokenizer.json and tokenizer_config.json")
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(dict(SHAPES[shape], torch_dtype="bfloat16"),
                                                    indent=1))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(self.tokenizer / f, tmp / f)
        s = run_logged([sys.executable, str(HERE / "scale_worker.py"), "checkpoint", str(tmp)],
                       self.logs / f"make-{shape}.log")
        tmp.rename(out)
        self._timed(f"{shape} checkpoint", s)
        return out

    def make_gguf(self, shape: str, dtype: str) -> Path:
        out = self.gguf(shape, dtype)
        if out.exists():
            return out
        tmp = out.with_name(out.name + ".tmp")
        if dtype == "q8_0":
            # From the bf16 file, as people quantize; the values differ from
            # the others' anyway, and only the speed is compared.
            src = self.make_gguf(shape, "bf16")
            s = run_logged([str(self.quantize), str(src), str(tmp), "Q8_0"],
                           self.logs / f"quantize-{shape}-q8_0.log")
        else:
            folder = self.make_checkpoint(shape)
            s = run_logged([sys.executable, str(self.convert), str(folder), "--outtype", dtype,
                            "--outfile", str(tmp)], self.logs / f"convert-{shape}-{dtype}.log")
        tmp.rename(out)
        self._timed(f"{out.name}", s)
        return out

    def prepare(self, shapes: list, gguf_dtypes: list) -> None:
        """Everything the cases need, made side by side (the converter and
        the checkpoint writer are single-threaded, and file writes overlap):
        each shape's checkpoint, then its GGUF files, Q8_0 last as it is
        made from the bf16 file."""
        def one_shape(shape):
            self.make_checkpoint(shape)
            with ThreadPoolExecutor() as pool:
                list(pool.map(lambda d: self.make_gguf(shape, d),
                              [d for d in gguf_dtypes if d != "q8_0"]))
            if "q8_0" in gguf_dtypes:
                self.make_gguf(shape, "q8_0")

        with ThreadPoolExecutor(max_workers=len(shapes)) as pool:
            list(pool.map(one_shape, shapes))


# --------------------------------------------------------------------------
# Memory bandwidth


def measure_bandwidth(threads: list, cache: Path, mib: int) -> dict:
    """GB/s of membw at each thread count; compiled into the cache at first use."""
    exe = membw.build(cache)
    out = {}
    for t in threads:
        out[t] = membw.measure(exe, t, mib)
        log(f"  membw {t} thread{'s' if t > 1 else ''}: {out[t]:.1f} GB/s")
    return out


# --------------------------------------------------------------------------
# Cases


class Case:
    def __init__(self, engine, shape, dtype, threads, pp, tg, flash_attn=None):
        self.engine, self.shape, self.dtype, self.threads = engine, shape, dtype, threads
        self.pp, self.tg, self.flash_attn = pp, tg, flash_attn

    def __str__(self):
        tests = " ".join(f"{k}{n}" for k, n in (("pp", self.pp), ("tg", self.tg)) if n)
        fa = f" fa {self.flash_attn}" if self.flash_attn else ""
        return f"{self.engine} {self.shape} {self.dtype} t={self.threads} {tests}{fa}"

    def estimate(self, bandwidth: dict, reps: int) -> float:
        """Seconds this case should take: start and load, the warm-up and
        timed prompt passes at a FLOP rate, the generation at a share of the
        bandwidth."""
        cfg = SHAPES[self.shape]
        decode_w, prompt_w = matrix_weights(cfg)
        # Matrices, then attention: scores and weighted sum over pp²/2 pairs per layer.
        flops = 2 * prompt_w * self.pp + 2 * cfg["num_hidden_layers"] * q_dim(cfg) * self.pp ** 2
        pp_s = flops / (PP_FLOPS_PER_THREAD[self.engine] * self.threads) * (reps + 1)
        bw = bandwidth.get(self.threads, 8.0 * self.threads) * 1e9
        step_s = decode_w * BYTES_PER_WEIGHT[self.dtype] / (TG_BANDWIDTH_SHARE[self.engine] * bw)
        tg_s = step_s * (self.tg * reps + 1) if self.tg else 0.0
        load_s = START_S[self.engine] + decode_w * BYTES_PER_WEIGHT[self.dtype] / 2e9
        return load_s + pp_s + tg_s


def time_case(case: Case, art: Artifacts, args, timeout: float) -> list:
    """Run one case in a process of its own; one result per test."""
    base = {"engine": case.engine, "shape": case.shape, "dtype": case.dtype,
            "threads": case.threads}
    if case.engine == "llama.cpp":
        return [dict(base, **r) for r in time_llama_bench(case, art, args, timeout)]
    cmd = [sys.executable, str(HERE / "scale_worker.py"), case.engine,
           str(art.folder(case.shape)), case.dtype, str(case.threads), str(case.pp),
           str(case.tg), str(args.reps)]
    env = dict(os.environ)
    if case.engine == "transformers":
        env["OMP_NUM_THREADS"] = str(case.threads)  # torch's pool, sized from the start
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode:
        raise RuntimeError(f"{case.engine} worker failed ({r.returncode}):\n"
                           + "".join(r.stderr.splitlines(True)[-15:]))
    j = json.loads(r.stdout.strip().splitlines()[-1])
    return [dict(base, test=t["test"], tok_s=t["tok_s"], sd=t["sd"], samples=t["samples"],
                 settings=dict(j["info"], load_s=round(j["load_s"], 2)))
            for t in j["results"]]


# Lines of llama-bench's verbose log, one per tensor or graph input, not kept.
LLAMA_LOG_FLOOD = ("llama_graph_n_input_tensors", "create_tensor")


def time_llama_bench(case: Case, art: Artifacts, args, timeout: float) -> list:
    cmd = [str(args.llama_bench), "-m", str(art.gguf(case.shape, case.dtype)),
           "-t", str(case.threads), "-r", str(args.reps), "-p", str(case.pp),
           "-n", str(case.tg), "-o", "jsonl", "-v"]
    if case.flash_attn:
        cmd += ["-fa", case.flash_attn]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    logfile = art.logs / f"llama-bench-{case.shape}-{case.dtype}-t{case.threads}-p{case.pp}.log"
    kept = [ln for ln in r.stderr.splitlines(True) if not ln.startswith(LLAMA_LOG_FLOOD)]
    logfile.write_text(shlex.join(cmd) + "\n" + "".join(kept))
    if r.returncode:
        raise RuntimeError(f"llama-bench failed ({r.returncode}), log in {logfile}:\n"
                           + "".join(kept[-10:]))
    # What "auto" came to, from the verbose log: "... Flash Attention enabled".
    fa_line = next((ln.rsplit("Flash Attention", 1)[1].strip() for ln in kept
                    if "Flash Attention enabled" in ln or "Flash Attention disabled" in ln), None)
    rows = []
    for line in r.stdout.splitlines():
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        kind, n = ("pp", j["n_prompt"]) if j["n_prompt"] else ("tg", j["n_gen"])
        fa = {-1: "auto", 0: "off", 1: "on"}.get(j["flash_attn"], str(j["flash_attn"]))
        rows.append({"test": f"{kind}{n}", "tok_s": j["avg_ts"], "sd": j["stddev_ts"],
                     "samples": j["samples_ts"], "settings": {
                         "flash_attn": fa + (f" -> {fa_line}" if fa_line else ""),
                         "kv_cache": f"{j['type_k']}/{j['type_v']}",
                         "n_batch": j["n_batch"], "n_ubatch": j["n_ubatch"],
                         "poll": j["poll"], "repack": j.get("repack"),
                         "model_type": j["model_type"]}})
    return rows


def plan(args) -> list:
    """The cases in the order given: shape, dtype, threads, engine; then the
    long prompt, for the first shape and dtype at the most threads."""
    cases = []
    if args.pp or args.tg:
        for shape in args.shapes:
            for dtype in args.dtypes:
                for t in args.threads:
                    for engine in args.engines:
                        if dtype in ENGINE_DTYPES[engine]:
                            cases.append(Case(engine, shape, dtype, t, args.pp, args.tg))
    if args.long_pp:
        for engine in args.engines:
            dtype = next((d for d in args.dtypes if d in ENGINE_DTYPES[engine]), None)
            if dtype:
                cases.append(Case(engine, args.shapes[0], dtype, max(args.threads), args.long_pp,
                                  0, "on" if engine == "llama.cpp" else None))
    return cases


# --------------------------------------------------------------------------
# Reports


def machine_info() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "logical_cpus": os.cpu_count(),
            "usable_cpus": len(os.sched_getaffinity(0)), "python": platform.python_version()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.lower().startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["simd_flags"] = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16",
                                                  "avx512_fp16", "amx_bf16", "amx_int8")
                                      if f in flags]
                break
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()
        info["memory_gib"] = round(int(mem[1]) / 2 ** 20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


def fmt(x, digits=1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def most_common(values: list):
    return max(set(values), key=values.count) if values else None


def report(state: dict) -> str:
    """The markdown report of everything in state."""
    res = state["results"]
    bw = {int(t): v for t, v in state["membw_gb_s"].items()}
    get = {(r["engine"], r["shape"], r["dtype"], r["threads"], r["test"]): r["tok_s"] for r in res}
    engines = [e for e in ENGINES if any(r["engine"] == e for r in res)]
    pp = most_common([r["test"] for r in res if r["test"].startswith("pp")])
    tg = most_common([r["test"] for r in res if r["test"].startswith("tg")])
    m = state["machine"]
    lines = ["# fastllm scaling: tokens/s against threads", "",
             f"- machine: {m.get('cpu')}, {m.get('usable_cpus')} usable CPUs, "
             f"{m.get('memory_gib')} GiB, {' '.join(m.get('simd_flags', []))}",
             f"- protocol: llama-bench's; pp N one pass over N random tokens after a full warm-up "
             f"pass, tg N single-token steps from an empty cache after a one-token warm-up; mean "
             f"of the timed runs; one process per case; random-weight checkpoints of real shapes"]
    for cmd in state["commands"]:
        lines.append(f"- run: `{cmd}`")
    lines += ["", "## Tokens per second", ""]
    head = ["model", "dtype", "threads", "GB/s"]
    cols = []
    for test in (pp, tg):
        if not test:
            continue
        for e in engines:
            cols.append((test, e))
        for other in ("llama.cpp", "transformers"):
            if "fastllm" in engines and other in engines:
                cols.append((test, f"fastllm/{other}"))
        if test == tg:
            for e in ("fastllm", "llama.cpp"):
                if e in engines:
                    cols.append((test, f"{e} % of bw"))
    head += [f"{t} {c}" for t, c in cols]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (len(head) - 3)]
    rows = sorted({(r["shape"], r["dtype"], r["threads"]) for r in res if r["test"] in (pp, tg)},
                  key=lambda k: (list(SHAPES).index(k[0]), DTYPES.index(k[1]), k[2]))
    for shape, dtype, t in rows:
        cells = [shape, dtype, str(t), fmt(bw.get(t))]
        for test, col in cols:
            if "/" in col and "%" not in col:
                a, b = (get.get((e, shape, dtype, t, test)) for e in col.split("/"))
                cells.append(f"{a / b:.2f}" if a and b else "—")
            elif col.endswith("% of bw"):
                v = get.get((col.split()[0], shape, dtype, t, test))
                frac = (v * weight_bytes_per_token(shape, dtype) / (bw[t] * 1e9)
                        if v and bw.get(t) else None)
                cells.append(f"{100 * frac:.0f}%" if frac else "—")
            else:
                cells.append(fmt(get.get((col, shape, dtype, t, test))))
        lines.append("| " + " | ".join(cells) + " |")
    other = sorted({(r["shape"], r["dtype"], r["threads"], r["test"]) for r in res
                    if r["test"] not in (pp, tg)})
    if other:
        lines += ["", "## Other prompt and generation lengths", "",
                  "| model | dtype | threads | test | " + " | ".join(engines)
                  + " | fastllm/llama.cpp | llama.cpp flash attention |",
                  "|---|---|---:|---|" + "---:|" * (len(engines) + 1) + "---|"]
        for shape, dtype, t, test in other:
            v = {e: get.get((e, shape, dtype, t, test)) for e in engines}
            fa = next((r["settings"].get("flash_attn") for r in res if r["engine"] == "llama.cpp"
                       and (r["shape"], r["dtype"], r["threads"], r["test"]) ==
                       (shape, dtype, t, test)), None)
            ratio = (f"{v['fastllm'] / v['llama.cpp']:.2f}"
                     if v.get("fastllm") and v.get("llama.cpp") else "—")
            lines.append(f"| {shape} | {dtype} | {t} | {test} | "
                         + " | ".join(fmt(v[e]) for e in engines) + f" | {ratio} | {fa or '—'} |")
    lines += ["", "## Memory bandwidth and weight bytes", "",
              "GB/s: membw.c, OpenMP threads each summing their own first-touched slice of a "
              f"{state['membw_mib']} MiB buffer, best of 5. `% of bw`: tg tokens/s x weight bytes "
              "per token (every layer matrix and the lm_head; KV cache and norms left out) / "
              "GB/s at that thread count; above 100% the weights are read, in part, from the "
              "last-level cache.", ""]
    lines.append("| threads | " + " | ".join(str(t) for t in sorted(bw)) + " |")
    lines.append("|---|" + "---:|" * len(bw))
    lines.append("| GB/s | " + " | ".join(fmt(bw[t]) for t in sorted(bw)) + " |")
    lines.append("")
    for shape in sorted({r["shape"] for r in res}, key=list(SHAPES).index):
        dts = sorted({r["dtype"] for r in res if r["shape"] == shape}, key=DTYPES.index)
        lines.append(f"- {shape}: " + ", ".join(
            f"{d} {weight_bytes_per_token(shape, d) / 1e6:.0f} MB/token" for d in dts))
    lines += ["", "## Engine settings", ""]
    seen = set()
    for r in sorted(res, key=lambda r: ENGINES.index(r["engine"])):
        s = {k: v for k, v in r["settings"].items() if k != "load_s"}
        key = (r["engine"], json.dumps(s, sort_keys=True))
        if key not in seen:
            seen.add(key)
            lines.append(f"- {r['engine']}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    if state["prepare"]:
        lines += ["", "## Preparation", ""]
        lines += [f"- {p['what']}: {p['seconds']} s" for p in state["prepare"]]
    if state["skipped"] or state["failures"] or state.get("notes"):
        lines += ["", "## Not measured", ""]
        lines += [f"- {n}" for n in state.get("notes", [])]
        lines += [f"- skipped {s['case']}: {s['why']}" for s in state["skipped"]]
        lines += [f"- failed {f['case']}: {f['error']}" for f in state["failures"]]
    return "\n".join(lines) + "\n"


def plot(state: dict, path: Path) -> str:
    res = state["results"]
    pp = most_common([r["test"] for r in res if r["test"].startswith("pp")])
    tg = most_common([r["test"] for r in res if r["test"].startswith("tg")])
    models = sorted({(r["shape"], r["dtype"]) for r in res},
                    key=lambda k: (list(SHAPES).index(k[0]), DTYPES.index(k[1])))
    colors = {m: plot_png.PALETTE[i % len(plot_png.PALETTE)] for i, m in enumerate(models)}
    dash = {"fastllm": 0, "llama.cpp": 8, "transformers": 3}  # solid, dashed, dotted
    panels = []
    for test, title in ((pp, "prompt"), (tg, "generation")):
        series = []
        for e in ENGINES:
            for m in models:
                pts = [(r["threads"], r["tok_s"]) for r in res
                       if (r["engine"], r["shape"], r["dtype"], r["test"]) == (e, *m, test)]
                if pts:
                    series.append({"label": f"{e} {m[0]} {m[1]}", "points": pts,
                                   "color": colors[m], "dash": dash[e]})
        panels.append({"title": f"{title} {test or ''} tok/s", "xlabel": "threads",
                       "series": series})
    return plot_png.plot(str(path), panels, "tokens/s against threads (log-log)")


def save(state: dict, out: Path) -> None:
    if state["results"]:
        state["plot_backend"] = plot(state, out / "scale.png")
    (out / "scale.md").write_text(report(state))
    (out / "results.json").write_text(json.dumps(state, indent=1))


# --------------------------------------------------------------------------
# The run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2-135m",
                   help=f"comma-separated, full names or sizes ({', '.join(SHAPES)})")
    p.add_argument("--dtypes", default="f32,bf16", help="comma-separated: f32, bf16, q8_0 "
                   "(q8_0: llama.cpp only)")
    p.add_argument("--threads", default="1,2,4,8,16",
                   help="comma-separated thread counts; those above the usable CPUs are dropped")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of "
                   + ",".join(ENGINES))
    p.add_argument("--pp", type=int, default=512, help="prompt tokens (0: no pp test)")
    p.add_argument("--tg", type=int, default=64, help="generated tokens (0: no tg test)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per test after the warm-up")
    p.add_argument("--long-pp", type=int, default=0, metavar="N",
                   help="also pp N, last, for the first shape and dtype at the most threads "
                        "(llama.cpp with flash attention on)")
    p.add_argument("--out", default="scale-out", help="folder for results.json, scale.md, scale.png")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "fastllm-scale-cache"),
                   help="folder for the checkpoints, GGUF files and the membw binary")
    p.add_argument("--tokenizer", default=".devbench/tok",
                   help="folder with a SmolLM2 tokenizer.json and tokenizer_config.json")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="llama-bench binary "
                   "(without it llama.cpp is left out)")
    p.add_argument("--convert", default=".devbench/llama.cpp/convert_hf_to_gguf.py",
                   metavar="PATH", help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--quantize", default=None, metavar="PATH",
                   help="llama-quantize binary, for q8_0 (default: next to llama-bench)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="skip cases, the largest first, whose estimated time no longer fits")
    p.add_argument("--membw-mib", type=int, default=1024, help="buffer of the bandwidth probe")
    p.add_argument("--prepare-only", action="store_true",
                   help="make the checkpoints and GGUF files, then stop")
    args = p.parse_args(argv)

    def split(text):
        return [x.strip() for x in text.split(",") if x.strip()]

    args.shapes = [resolve_shape(s) for s in split(args.shapes)]
    args.dtypes, args.engines = split(args.dtypes), split(args.engines)
    for kind, given, allowed in (("dtype", args.dtypes, DTYPES), ("engine", args.engines, ENGINES)):
        bad = [x for x in given if x not in allowed]
        if bad or not given:
            p.error(f"unknown {kind} {bad} (choose from {', '.join(allowed)})")
    cpus = len(os.sched_getaffinity(0))
    threads = [int(t) for t in split(args.threads)]
    args.threads = [t for t in threads if 1 <= t <= cpus]
    args.threads_dropped = [t for t in threads if t not in args.threads]
    if not args.threads:
        p.error(f"no thread count within 1..{cpus}")
    if args.reps < 1 or min(args.pp, args.tg, args.long_pp) < 0:
        p.error("--reps must be positive, --pp/--tg/--long-pp not negative")
    if args.llama_bench:
        args.llama_bench = Path(args.llama_bench).resolve()
        if args.quantize is None:
            args.quantize = args.llama_bench.with_name("llama-quantize")
    return args


def skip(state: dict, cases: list, why: str) -> None:
    for c in cases:
        state["skipped"].append({"case": str(c), "why": why})
        log(f"skip {c}: {why}")


def run_cases(pending: list, deadline: float, args, art: Artifacts, state: dict, out: Path) -> None:
    """Time the cases in order, saving after each; before each, while the
    estimates of those left exceed the time left, skip the largest."""
    bandwidth = {int(t): v for t, v in state["membw_gb_s"].items()}
    # An engine's estimates are scaled by the geometric mean of measured /
    # estimated time of its cases so far (kept with the results, so that a
    # later run into the same folder starts with them).
    ratios = state.setdefault("estimate_ratios", {})

    def est(c):
        r = ratios.get(c.engine)
        return c.estimate(bandwidth, args.reps) * (
            math.exp(statistics.mean(math.log(x) for x in r)) if r else 1.0)

    while pending:
        left = deadline - time.monotonic()
        while pending and sum(est(c) for c in pending) > left:
            drop = max(pending, key=est)
            pending.remove(drop)
            skip(state, [drop], f"estimated {est(drop):.0f} s, and the cases left needed more "
                                f"than the {max(left, 0):.0f} s left")
        if not pending:
            break
        case = pending.pop(0)
        log(f"{case} (estimate {est(case):.0f} s) ...")
        t0 = time.monotonic()
        try:
            rows = time_case(case, art, args, timeout=None if math.isinf(left) else left)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            state["failures"].append({"case": str(case), "error": str(e).strip()})
            log(f"  failed: {e}")
            save(state, out)
            continue
        took = time.monotonic() - t0
        ratios.setdefault(case.engine, []).append(took / case.estimate(bandwidth, args.reps))
        for kind in ("skipped", "failures"):  # measured now, after an earlier run missed it
            state[kind] = [s for s in state[kind] if s["case"] != str(case)]
        keys = {result_key(r) for r in rows}
        state["results"] = [r for r in state["results"] if result_key(r) not in keys] + rows
        log(f"  {took:.1f} s: " + ", ".join(f"{r['test']} {r['tok_s']:.1f} tok/s" for r in rows))
        save(state, out)


def result_key(r: dict) -> tuple:
    return r["engine"], r["shape"], r["dtype"], r["threads"], r["test"]


def main(argv=None) -> int:
    t_start = time.monotonic()
    args = parse_args(argv)
    out, cache = Path(args.out), Path(args.cache)
    logs = out / "logs"
    for d in (out, cache, logs):
        d.mkdir(parents=True, exist_ok=True)
    state = {"machine": machine_info(), "commands": [], "membw_gb_s": {},
             "membw_mib": args.membw_mib, "prepare": [], "results": [], "skipped": [],
             "failures": []}
    if (out / "results.json").exists():  # a run before this one into the same folder
        state.update(json.loads((out / "results.json").read_text()))
    state["commands"].append(shlex.join([sys.executable] + sys.argv))
    notes = [f"threads {args.threads_dropped} dropped: more than the usable CPUs"] \
        if args.threads_dropped and not args.prepare_only else []
    if "llama.cpp" in args.engines and not (args.llama_bench and args.llama_bench.exists()) \
            and not args.prepare_only:
        notes.append(f"llama.cpp left out: no llama-bench at {args.llama_bench}")
        args.engines.remove("llama.cpp")
    have_quantize = bool(args.quantize) and Path(args.quantize).exists()
    if "q8_0" in args.dtypes and "llama.cpp" in args.engines and not have_quantize \
            and not args.prepare_only:
        raise SystemExit(f"q8_0 needs llama-quantize, not found at {args.quantize}")
    for n in notes:
        log(n)
        if n not in state.setdefault("notes", []):
            state["notes"].append(n)

    deadline = t_start + args.time_budget if args.time_budget is not None else math.inf
    pending = [] if args.prepare_only else plan(args)
    if time.monotonic() >= deadline:  # nothing to make files for
        skip(state, pending, "no time left in the budget")
        save(state, out)
        return 0
    art = Artifacts(cache, Path(args.tokenizer), Path(args.convert), args.quantize, logs)
    ggufs = []
    if "llama.cpp" in args.engines or args.prepare_only:
        # Q8_0 needs llama-quantize, which --prepare-only may run without.
        ggufs = [d for d in args.dtypes if d != "q8_0" or have_quantize]
    art.prepare(args.shapes, ggufs)
    state["prepare"] += art.timings
    if args.prepare_only:
        save(state, out)
        return 0

    missing = [t for t in args.threads if str(t) not in state["membw_gb_s"]]
    if missing and pending:
        log("memory bandwidth ...")
        for t, v in measure_bandwidth(missing, cache, args.membw_mib).items():
            state["membw_gb_s"][str(t)] = v
    save(state, out)
    run_cases(pending, deadline, args, art, state, out)
    save(state, out)
    print(report(state))
    log(f"wrote {out / 'results.json'}, {out / 'scale.md'}, {out / 'scale.png'} "
        f"({state.get('plot_backend', 'no plot')}) in {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
