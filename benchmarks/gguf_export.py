"""GGUF export checked by llama.cpp itself: fastllm's quantized files against
llama-quantize's, and llama-perplexity on both.

    python benchmarks/gguf_export.py --f32 smollm2-F32.gguf --llama-bin DIR \
        [--ref-dir DIR_WITH_smollm2-Q8_0.gguf_ETC] [--text FILE] [--mixes q8_0 q4_k_m]

The F32 GGUF is imported with `fastllm convert` (GGUF -> HF folder), then
exported again with `fastllm convert FOLDER OUT.gguf --dtype MIX`. For each
mix it reports the export time, how many tensors are byte-identical to
llama-quantize's file of the same mix (when --ref-dir has one), and the
perplexity llama-perplexity gives on the text for our file, llama.cpp's
file and the F32 file. Needs a llama.cpp build; not a test.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REF_NAMES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}


def fastllm(*args) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fastllm", "convert", *map(str, args)], check=True)
    return time.perf_counter() - start


def identical_tensors(ours: Path, ref: Path) -> tuple[int, int]:
    import gguf
    a = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    b = {t.name: t for t in gguf.GGUFReader(ref).tensors}
    same = sum(1 for n in a if n in b and a[n].tensor_type == b[n].tensor_type
               and np.array_equal(np.asarray(a[n].data).view(np.uint8), np.asarray(b[n].data).view(np.uint8)))
    return same, len(b)


def perplexity(bin_dir: Path, model: Path, text: Path, ctx: int, threads: int, chunks: int = 8) -> float:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx),
                          "-t", str(threads), "-b", str(ctx), "--chunks", str(chunks)],
                         capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode or not found:
        sys.exit(f"llama-perplexity failed on {model}:\n{(out.stdout + out.stderr)[-2000:]}")
    return float(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--f32", type=Path, required=True, help="an F32 GGUF of a llama/qwen2/qwen3 model")
    p.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-perplexity")
    p.add_argument("--ref-dir", type=Path, default=None, help="llama-quantize's files: smollm2-Q8_0.gguf, ...")
    p.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[1] / "README.md",
                   help="English text for perplexity (default: the README)")
    p.add_argument("--mixes", nargs="+", default=["q8_0", "q4_k_m"])
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fastllm(args.f32, tmp / "hf")
        rows = [("F32 (source)", "-", "-", perplexity(args.llama_bin, args.f32, args.text, args.ctx, args.threads),
                 None)]
        for mix in args.mixes:
            out = tmp / f"{mix}.gguf"
            seconds = fastllm(tmp / "hf", out, "--dtype", mix)
            ours = perplexity(args.llama_bin, out, args.text, args.ctx, args.threads)
            ref = args.ref_dir / f"smollm2-{REF_NAMES.get(mix, mix)}.gguf" if args.ref_dir else None
            if ref is not None and ref.exists():
                same, total = identical_tensors(out, ref)
                theirs = perplexity(args.llama_bin, ref, args.text, args.ctx, args.threads)
                rows.append((f"{mix} fastllm", f"{seconds:.1f} s", f"{same}/{total}", ours, theirs))
            else:
                rows.append((f"{mix} fastllm", f"{seconds:.1f} s", "-", ours, None))
    print(f"\nperplexity on {args.text.name}, context {args.ctx}")
    print(f"{'file':<16} {'export':>8} {'tensors = llama.cpp':>20} {'PPL ours':>10} {'PPL llama.cpp':>14}")
    for name, secs, same, ours, theirs in rows:
        print(f"{name:<16} {secs:>8} {same:>20} {ours:>10.4f} {'-' if theirs is None else f'{theirs:.4f}':>14}")


if __name__ == "__main__":
    main()
