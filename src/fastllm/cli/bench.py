"""`fastllm bench`: llama-bench style throughput of the run loop.

pp N: one forward pass over an N-token prompt from an empty cache.
tg N: N single-token steps from an empty cache, as in generation.
With -d D (llama-bench's --n-depth), both start after D tokens of context
instead ("pp512 @ d8192"), run once beforehand and not timed.
Each figure is tokens per second over several repetitions after one warm-up.
With --prefetch, each test runs under every setting of how far ahead the
kernels ask for the weights they stream, the settings taking turns within
each repetition, so that a shared machine's drift falls on all of them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from .args import whole_number
from ..spec.config import KV_DTYPES
from ..generate.model import DTYPES, Model, physical_cores
from ..core._core import set_stream_prefetch, simd_path, stream_prefetch


def add_bench_parser(sub):
    p = sub.add_parser("bench", help="prompt and generation tokens/s, llama-bench style")
    p.add_argument("--model", "-m", default=None, help="model folder or .gguf (default: SmolLM2)")
    p.add_argument("-p", "--n-prompt", type=whole_number(0), default=512, help="prompt tokens (0 skips pp)")
    p.add_argument("-n", "--n-gen", type=whole_number(0), default=128, help="generated tokens (0 skips tg)")
    p.add_argument("-t", "--threads", type=_thread_counts, default=None,
                   help="comma-separated thread counts (default: physical cores)")
    p.add_argument("-d", "--n-depth", type=_depths, default=[0],
                   help="comma-separated context depths the tests start at (default: 0)")
    p.add_argument("-r", "--repetitions", type=whole_number(1), default=5,
                   help="timed runs per test, after one warm-up run (default: 5)")
    p.add_argument("--dtype", default=None,
                   help="comma-separated weight precisions to test: f32, bf16, gguf (a GGUF file's own types; "
                        "default: gguf for a .gguf file or the default model, f32 for a folder)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f32",
                   help="KV cache precision (default: f32)")
    p.add_argument("--prefetch", type=_prefetch_settings, default=None, metavar="SETTINGS",
                   help="comma-separated BYTES:LEVEL settings of the weight prefetch to compare, as "
                        "FASTLLM_PREFETCH takes them ('default': the one in effect, this CPU's own or "
                        "FASTLLM_PREFETCH's), e.g. default,512:2,2048:1")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    return p


def _prefetch_settings(text) -> list:
    """[(bytes, level) or None for the CPU's own setting], in the order given."""
    settings = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item == "default":
            settings.append(None)
            continue
        parts = item.split(":")
        try:
            ahead, level = int(parts[0]), int(parts[1]) if len(parts) == 2 else 1
        except ValueError:
            ahead = level = None
        if len(parts) > 2 or ahead is None or not (0 <= ahead <= 65536 and ahead % 64 == 0 and level in (1, 2)):
            raise argparse.ArgumentTypeError(
                f"expected BYTES:LEVEL (a multiple of 64 from 0 to 65536, level 1 or 2) or default, got {item!r}")
        settings.append((ahead, level))
    if not settings:
        raise argparse.ArgumentTypeError(f"expected settings such as default,512:2, got {text!r}")
    return list(dict.fromkeys(settings))


def prefetch_name(setting) -> str | None:
    """'1024:2' for (1024, 2); None where the CPU's kernels leave prefetching to the hardware."""
    return None if setting is None else f"{setting[0]}:{setting[1]}"


def _depths(text) -> list:
    depths = [whole_number(0)(x.strip()) for x in text.split(",") if x.strip()]
    if not depths:
        raise argparse.ArgumentTypeError(f"expected depths such as 0,8192, got {text!r}")
    return depths


def _thread_counts(text) -> list:
    counts = [whole_number(1)(x.strip()) for x in text.split(",") if x.strip()]
    if not counts:
        raise argparse.ArgumentTypeError(f"expected thread counts such as 1,2, got {text!r}")
    return counts


def bench_model(model, n_prompt: int, n_gen: int, repetitions: int, depth: int = 0,
                prefetch=(None,)) -> list[dict]:
    """Measure pp and tg on a loaded model at its current thread count,
    after depth tokens of context, under each prefetch setting ((bytes,
    level), or None for the one in effect): one row per test and setting."""
    session = model.new_session()
    rng = np.random.default_rng(0)
    results = []
    context = rng.integers(0, session.vocab_size, depth).astype(np.int32)
    if depth:
        session.prefill(context)
        session.checkpoint()   # recurrent layers start each run from here
    own = stream_prefetch()
    settings = list(dict.fromkeys(own if s is None else s for s in prefetch))
    try:
        for test, n in (("pp", n_prompt), ("tg", n_gen)):
            if n <= 0:
                continue
            if depth + n > session.n_ctx:
                raise ValueError(f"{test}{n} at depth {depth} does not fit the context of {session.n_ctx}")
            tokens = rng.integers(0, session.vocab_size, n).astype(np.int32)
            speeds = [[] for _ in settings]
            for rep in range(repetitions + 1):  # the first run warms caches and pages
                # The settings take turns, in reverse every other repetition.
                for i in (range(len(settings)) if rep % 2 == 0 else reversed(range(len(settings)))):
                    if settings[i] is not None:
                        set_stream_prefetch(*settings[i])
                    session.rewind(depth)
                    t0 = time.perf_counter()
                    if test == "pp":
                        session.extend(tokens)
                    else:
                        for token in tokens:
                            session.step(token)
                    dt = time.perf_counter() - t0
                    if rep:
                        speeds[i].append(n / dt)
            for setting, runs in zip(settings, speeds):
                results.append({
                    "test": f"{test}{n}" + (f" @ d{depth}" if depth else ""), "depth": depth,
                    "threads": model.threads, "dtype": model.dtype, "kv_dtype": model.kv_dtype,
                    "prefetch": prefetch_name(setting),
                    "tokens_per_s_mean": statistics.mean(runs),
                    "tokens_per_s_sd": statistics.stdev(runs) if len(runs) > 1 else 0.0,
                    "tokens_per_s_median": statistics.median(runs),
                    "runs": runs,
                })
    finally:
        if own is not None:
            set_stream_prefetch(*own)
    return results


def run_bench(model_path, n_prompt=512, n_gen=128, threads=None, repetitions=5, dtypes=(None,),
              kv_dtype="f32", depths=(0,), prefetch=(None,)):
    """Yield one result per (dtype, threads, depth, test, prefetch setting),
    loading each dtype once."""
    threads = threads or [physical_cores()]
    for dtype in dtypes:
        ctx = max(depths) + max(n_prompt, n_gen, 1)
        model = Model.from_pretrained(model_path, n_ctx=ctx, threads=threads[0], dtype=dtype,
                                      kv_dtype=kv_dtype)
        for t in threads:
            model.threads = t
            for depth in depths:
                for r in bench_model(model, n_prompt, n_gen, repetitions, depth, prefetch):
                    r["model"] = model.name
                    yield r
        del model


def cmd_bench(args) -> int:
    threads = args.threads or [physical_cores()]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()] if args.dtype else [None]
    for d in dtypes:
        if d is not None and d not in DTYPES:
            raise ValueError(f"unknown dtype {d!r} ({', '.join(DTYPES)})")
    if args.prefetch and stream_prefetch() is None:
        raise ValueError(f"--prefetch: the {simd_path()} kernels of this CPU leave prefetching to the hardware")
    prefetch = args.prefetch or [None]
    column = "prefetch | " if args.prefetch else ""
    rows = []
    if not args.json:
        print(f"SIMD: {simd_path()}\n")   # above the table, which stays plain markdown
        print(f"| model | dtype | threads | {column}test | t/s (mean ± sd) | median |")
        print("|---|---|---|" + ("---|" if column else "") + "---|---|---|")
    for r in run_bench(args.model, args.n_prompt, args.n_gen, threads, args.repetitions, dtypes,
                       args.kv_dtype, args.n_depth, prefetch):
        rows.append(r)
        if not args.json:
            print(f"| {r['model']} | {r['dtype']} | {r['threads']} | "
                  + (f"{r['prefetch']} | " if column else "") + f"{r['test']} | "
                  f"{r['tokens_per_s_mean']:.2f} ± {r['tokens_per_s_sd']:.2f} | "
                  f"{r['tokens_per_s_median']:.2f} |")
            sys.stdout.flush()
    if args.json:
        json.dump({"simd": simd_path(), "results": rows}, sys.stdout, indent=2)
        print()
    return 0
