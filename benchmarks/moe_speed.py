#!/usr/bin/env python
"""fastllm against llama-bench on mixture-of-experts checkpoints of real shapes.

    python benchmarks/moe_speed.py WORK --llama-cpp DIR [--models qwen3moe,qwen35moe]
        [--quants q4_k_m,q8_0] [--threads 1,2] [--pp 512] [--tg 128] [--reps 3]
        [--load-reps 3] [--no-speed] [--no-load] [--prepare-only]

makes, once, in WORK, for each model: a random bf16 checkpoint (as
scale_worker.py writes them) with the tokenizer that oracles/qwen_tokenizers.py
rebuilds, its BF16 GGUF by llama.cpp's own converter (DIR/convert_hf_to_gguf.py,
gguf-py from DIR), and from that the Q4_K_M and Q8_0 files by
DIR/build/bin/llama-quantize. The checkpoint's weights and the BF16 file are
deleted once the quantized files exist (together they are 3-4 times their
size); config and tokenizer stay.

- qwen3moe: Qwen3-30B-A3B's layers (hidden 2048, 128 experts, top-8 with
  norm_topk_prob, expert intermediate 768, 32 query and 4 KV heads of 128,
  the Qwen3 vocabulary of 151,936, untied) with 4 of its 48 layers.
- qwen35moe: Qwen3.5-35B-A3B's (hidden 2048, 256 experts, top-8, expert and
  shared-expert intermediate 512, Gated DeltaNet layers of 16 key and 32 value
  heads of 128, gated full attention of 16 query and 2 KV heads of 256, the
  Qwen3.5 vocabulary of 248,320, untied) with 4 of its 40 layers: three
  linear-attention layers and one full-attention layer, as in the model.

Speed: each repetition runs every (model, quant, threads) case once per
engine, each run a process of its own, the engine that goes first
alternating, with llama-bench's protocol on both sides (gguf_speed.py's
functions: scale_worker.py for fastllm on the GGUF file at its own types,
`llama-bench -r 1` for llama.cpp); medians, their ratios, and fastllm's
peak RSS against the file size plus its KV cache plus 100 MiB, the bound
fastllm holds itself to.

Load: the seconds from the start of loading a file, already in the page
cache, to the end of loading, and to the logits of a one-token prompt.
llama.cpp: llama_model_load_from_file, llama_init_from_model and one
llama_decode, the calls llama-cli makes (llama_load.c, built against
DIR/build/bin/libllama.so), with mmap (load mode mmap, where the weights
are mostly read by the first pass) and without (none: the file is read into
allocated memory), --load-reps runs of each at --load-threads. fastllm:
runs of from_pretrained, new_session and one step, its packed-weights cache
made beforehand. The runs go file by file, the engine that goes first
alternating, each file's runs after one untimed load by each engine: the files of several models (GGUF and packed
cache) outgrow the page cache, and taking turns between them times reads
from disk, not a load from the page cache. The total wall and CPU time of
the runs close the report.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import gguf_speed  # noqa: E402
from qwen35_speed import run, tensor_types  # noqa: E402

QWEN3_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", bos_token_id=151643, eos_token_id=151645,
    torch_dtype="bfloat16")
QWEN35_MOE = dict(
    architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", vocab_size=248320,
    hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"], moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, tie_word_embeddings=False,
    max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu", attn_output_gate=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    bos_token_id=None, eos_token_id=248046, torch_dtype="bfloat16")
MODELS = {"qwen3moe": (QWEN3_MOE, "qwen3"), "qwen35moe": (QWEN35_MOE, "qwen3.5")}
QUANTS = {"q4_k_m": "Q4_K_M", "q8_0": "Q8_0"}
RSS_SLACK_MIB = 100


def prepare(work: Path, llama_cpp: Path, model: str, quants: list) -> dict:
    """{quant: GGUF file} of one model, made if missing."""
    files = {q: work / f"{model}-{QUANTS[q]}.gguf" for q in quants}
    if all(f.exists() for f in files.values()):
        return files
    shape, tokenizer = MODELS[model]
    folder, bf16 = work / model, work / f"{model}-BF16.gguf"
    if not bf16.exists() and not (folder / "model.safetensors").exists():
        from oracles import qwen_tokenizers
        tok = qwen_tokenizers.build(tokenizer, work / f"tokenizer-{tokenizer}")
        tmp = work / f"{model}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(shape, indent=1))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tok / f, tmp / f)
        run([sys.executable, HERE / "scale_worker.py", "checkpoint", tmp], work / f"make-{model}.log")
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    if not bf16.exists():
        env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
        # Qwen3.5's converter would look for multi-token-prediction layers; the others refuse the flag.
        no_mtp = ["--no-mtp"] if model == "qwen35moe" else []
        run([sys.executable, llama_cpp / "convert_hf_to_gguf.py", folder, "--outtype", "bf16", *no_mtp,
             "--outfile", str(bf16) + ".tmp"], work / f"convert-{model}.log", env=env)
        os.rename(str(bf16) + ".tmp", bf16)
    (folder / "model.safetensors").unlink(missing_ok=True)
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    env = dict(os.environ, LD_LIBRARY_PATH=str(quantize.parent))
    for q, out in files.items():
        if not out.exists():
            run([quantize, bf16, str(out) + ".tmp", QUANTS[q]], work / f"quantize-{model}-{q}.log", env=env)
            os.rename(str(out) + ".tmp", out)
    if all((work / f"{model}-{Q}.gguf").exists() for Q in QUANTS.values()):
        bf16.unlink()
    return files


def cache_mib(model: str, n_ctx: int) -> float:
    """fastllm's f32 cache at n_ctx: keys and values of the attention layers,
    and the convolution and recurrent states of the linear-attention ones."""
    c = MODELS[model][0]
    kinds = c.get("layer_types", ["full_attention"] * c["num_hidden_layers"])
    full = kinds.count("full_attention") * 2 * c["num_key_value_heads"] * c["head_dim"] * n_ctx
    linear = 0
    if "linear_num_value_heads" in c:
        k = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        v = c["linear_num_value_heads"] * c["linear_value_head_dim"]
        linear = kinds.count("linear_attention") * ((c["linear_conv_kernel_dim"] - 1) * (2 * k + v)
                                                    + c["linear_num_value_heads"] * c["linear_key_head_dim"]
                                                    * c["linear_value_head_dim"])
    return (full + linear) * 4 / 2**20


def build_llama_load(llama_cpp: Path, out: Path) -> Path:
    exe = out / "llama_load"
    src = HERE / "llama_load.c"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        lib = llama_cpp / "build" / "bin"
        subprocess.run(["cc", "-O2", "-I", llama_cpp / "include", "-I", llama_cpp / "ggml" / "include", src,
                        "-L", lib, f"-Wl,-rpath,{lib}", "-lllama", "-lggml", "-lggml-base", "-o", exe], check=True)
    return exe


def load_fastllm(path: str, threads: int) -> None:
    """In a process of its own: the load-time figures of fastllm, one JSON line."""
    import resource

    from fastllm import Model
    t0 = time.perf_counter()
    model = Model.from_pretrained(path, n_ctx=512, threads=threads)
    t1 = time.perf_counter()
    session = model.new_session()
    session.step(0)
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"load_s": t1 - t0, "first_token_s": t2 - t0, "peak_rss_mib": round(peak, 1)}))


def llama_load_times(exe: Path, path: Path, threads: int) -> dict:
    """{"llama.cpp mmap" and "llama.cpp no mmap": {load_s, first_token_s}} of one file, each a process."""
    got = {}
    for mode, name in (("mmap", "llama.cpp mmap"), ("none", "llama.cpp no mmap")):
        r = subprocess.run([str(exe), str(path), mode, str(threads)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"llama_load failed on {path} ({mode}):\n{r.stderr[-2000:]}")
        got[name] = json.loads(r.stdout.strip().splitlines()[-1])
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path)
    p.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, built in build/")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--quants", default=",".join(QUANTS))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--pp", type=int, default=512)
    p.add_argument("--tg", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--load-reps", type=int, default=3, help="repetitions of the load-time runs")
    p.add_argument("--load-threads", type=int, default=2)
    p.add_argument("--no-speed", action="store_true", help="leave out pp and tg")
    p.add_argument("--no-load", action="store_true", help="leave out the load times")
    p.add_argument("--engines", default=",".join(gguf_speed.ENGINES),
                   help="fastllm,llama.cpp; one alone for a check of that side")
    p.add_argument("--prepare-only", action="store_true", help="make the files, list their tensor types, stop")
    args = p.parse_args(argv)
    models, quants = args.models.split(","), args.quants.split(",")
    for m in models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for q in quants:
        if q not in QUANTS:
            p.error(f"unknown quant {q!r}; choose from {', '.join(QUANTS)}")
    threads = [int(t) for t in args.threads.split(",")]
    engine_list = tuple(e for e in gguf_speed.ENGINES if e in args.engines.split(","))
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    files = {(m, q): f for m in models for q, f in prepare(args.work, args.llama_cpp, m, quants).items()}
    if args.prepare_only:
        for path in files.values():
            print(f"{path.name}, {path.stat().st_size / 2**20:.0f} MiB: " + json.dumps(tensor_types(path), indent=1))
        return 0
    bench = args.llama_cpp / "build" / "bin" / "llama-bench"
    os.environ["LD_LIBRARY_PATH"] = str(bench.parent)
    print(f"command: {' '.join(sys.argv)}\nCPU cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}",
          flush=True)
    runs, loads = {}, {}
    for rep in range(0 if args.no_speed else args.reps):
        engines = engine_list if rep % 2 == 0 else engine_list[::-1]
        for (m, q), path in files.items():
            for t in threads:
                for engine in engines:
                    if engine == "fastllm":
                        out = gguf_speed.fastllm_output(path, t, args.pp, args.tg)
                        f = {row["test"]: row["tok_s"] for row in out["results"]}
                        runs.setdefault((m, q, t, "rss"), []).append(out["peak_rss_mib"])
                    else:
                        f = gguf_speed.llama_run(str(bench), path, t, args.pp, args.tg)
                    runs.setdefault((m, q, t, engine), []).append(f)
                print(f"rep {rep + 1}/{args.reps} ({engines[0]} first) {path.name} t={t}, load average "
                      f"{os.getloadavg()[0]:.1f}: " + ", ".join(f"{e} {runs[(m, q, t, e)][-1]}" for e in engines),
                      file=sys.stderr, flush=True)
    if runs:
        pp, tg = f"pp{args.pp}", f"tg{args.tg}"
        print(f"\nmedians of {args.reps} interleaved runs, tokens/s, both engines on the same GGUF file")
        print(f"| file | threads | {pp} fastllm / llama.cpp | ratio | {tg} fastllm / llama.cpp | ratio "
              f"| fastllm peak RSS / bound (file + cache + {RSS_SLACK_MIB} MiB) |")
        print("|---|---|---|---|---|---|---|")
        for (m, q), path in files.items():
            bound = path.stat().st_size / 2**20 + cache_mib(m, max(args.pp, args.tg)) + RSS_SLACK_MIB
            for t in threads:
                med = {e: {k: statistics.median(r[k] for r in runs[(m, q, t, e)]) for k in runs[(m, q, t, e)][0]}
                       for e in engine_list}
                cells = []
                for test in (pp, tg):
                    vals = [med[e][test] for e in gguf_speed.ENGINES if e in med]
                    ratio = f"{vals[0] / vals[1]:.2f}" if len(vals) == 2 else "-"
                    cells += [" / ".join(f"{v:.1f}" for v in vals), ratio]
                rss = f"{max(runs[(m, q, t, 'rss')]):.0f} / {bound:.0f} MiB" if (m, q, t, "rss") in runs else "-"
                print(f"| {path.name} | {t} | " + " | ".join(cells) + f" | {rss} |")
    if not args.no_load and args.load_reps > 0:
        exe = build_llama_load(args.llama_cpp, args.work)

        def fastllm_load(path: Path) -> dict:
            r = subprocess.run([sys.executable, __file__, "load-fastllm", str(path), str(args.load_threads)],
                               capture_output=True, text=True, check=True)
            return json.loads(r.stdout.strip().splitlines()[-1])

        for path in files.values():
            # Untimed: fastllm's cache file made, and each engine's file read
            # into the page cache after the other files pushed it out.
            if "fastllm" in engine_list:
                fastllm_load(path)
            llama_load_times(exe, path, args.load_threads)
            for rep in range(args.load_reps):
                for engine in engine_list if rep % 2 == 0 else engine_list[::-1]:
                    if engine == "fastllm":
                        loads.setdefault((path, "fastllm"), []).append(fastllm_load(path))
                    else:
                        for name, r in llama_load_times(exe, path, args.load_threads).items():
                            loads.setdefault((path, name), []).append(r)
        print(f"\nload, the file in the page cache, medians: seconds to load / to the logits of a one-token "
              f"prompt (load, context, one decode), {args.load_reps} runs of each engine at "
              f"{args.load_threads} threads, file by file")
        names = ["fastllm", "llama.cpp mmap", "llama.cpp no mmap"]
        print("| file | size MiB | " + " | ".join(names) + " | fastllm peak RSS MiB |")
        print("|---|---|---|---|---|---|")
        for path in files.values():
            cells = []
            for e in names:
                rs = loads.get((path, e), [])
                first = [r["first_token_s"] for r in rs if "first_token_s" in r]
                cells.append("-" if not rs else f"{statistics.median(r['load_s'] for r in rs):.2f}"
                             + (f" / {statistics.median(first):.2f}" if first else ""))
            fl = loads.get((path, "fastllm"))
            rss = f"{max(r['peak_rss_mib'] for r in fl):.0f}" if fl else "-"
            print(f"| {path.name} | {path.stat().st_size / 2**20:.0f} | " + " | ".join(cells) + f" | {rss} |")
    import resource
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"\n{time.time() - started:.0f} s in all; the runs' CPU time {cpu.ru_utime + cpu.ru_stime:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "load-fastllm":
        load_fastllm(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
