"""fastllm's perplexity and KL divergence beside llama.cpp's llama-perplexity,
on the same GGUF files, the same text, the same ctx and chunk count.

    python benchmarks/perplexity.py --base smollm2-F32.gguf smollm2-Q8_0.gguf smollm2-Q4_K_M.gguf \\
        --llama-perplexity /path/to/llama-perplexity --chunks 40 --threads 2

llama.cpp's KL mode takes two runs: the base model saves its log-probs
(--kl-divergence-base FILE), then each quantized model reads them
(--kl-divergence-base FILE --kl-divergence). fastllm runs the base and every
model on each chunk in one pass. Prints one table per file: PPL, mean KL
divergence from the base and top-1 agreement, for both engines.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastllm import Model
from fastllm import perplexity

_NUMBER = r"([-\d.]+)"


def _find(pattern: str, text: str, what: str, log: Path):
    m = re.search(pattern, text)
    if m is None:
        # (its KL summary is left out below 100 scored tokens)
        raise RuntimeError(f"llama-perplexity printed no {what}: see {log}")
    return tuple(float(g) for g in m.groups())


def llama_perplexity(tool, gguf: Path, text_file: Path, kld_file: Path, args, compare: bool, log: Path) -> dict:
    """One llama-perplexity run: with compare False the base run that saves
    its log-probs, with compare True a run that reads them."""
    cmd = [str(tool), "-m", str(gguf), "-f", str(text_file), "-c", str(args.ctx), "-t", str(args.threads),
           "--kl-divergence-base", str(kld_file)]
    if args.chunks is not None:
        cmd += ["--chunks", str(args.chunks)]
    if compare:
        cmd.append("--kl-divergence")
    run = subprocess.run(cmd, capture_output=True, text=True)
    out = run.stdout + run.stderr
    log.write_text(out)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}): see {log}")
    figures = {"chunks": int(_find(r"over (\d+) chunks, n_ctx", out, "chunk count", log)[0])}
    if not compare:
        figures["ppl"] = _find(rf"Final estimate: PPL = {_NUMBER} \+/- {_NUMBER}", out, "PPL", log)
        return figures
    figures["ppl"] = _find(rf"Mean PPL\(Q\)\s*:\s*{_NUMBER}\s*±\s*{_NUMBER}", out, "PPL(Q)", log)
    figures["kld"] = _find(rf"Mean\s+KLD:\s*{_NUMBER}\s*±\s*{_NUMBER}", out, "mean KLD", log)
    top = _find(rf"Same top p:\s*{_NUMBER}\s*±\s*{_NUMBER} %", out, "top-1 agreement", log)
    figures["same_top"] = (top[0] / 100, top[1] / 100)
    return figures


def table(name: str, ours: perplexity.Perplexity, theirs: dict) -> str:
    def pair(v, digits=4):
        return "—" if v is None else f"{v[0]:.{digits}f} ± {v[1]:.{digits}f}"

    def pct(v):
        return "—" if v is None else f"{100 * v[0]:.2f} ± {100 * v[1]:.2f} %"
    kl = ours.kl
    rows = [("PPL", pair((ours.ppl.value, ours.ppl.error)), pair(theirs.get("ppl"))),
            ("mean KLD", pair(kl and (kl.kld.value, kl.kld.error), 6), pair(theirs.get("kld"), 6)),
            ("same top p", pct(kl and (kl.same_top.value, kl.same_top.error)), pct(theirs.get("same_top")))]
    lines = [f"{name}: {ours.chunks} chunks of {ours.ctx} (llama.cpp: {theirs['chunks']})",
             f"  {'':<12}{'fastllm':>24}{'llama.cpp':>24}"]
    lines += [f"  {label:<12}{a:>24}{b:>24}" for label, a, b in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ggufs", nargs="+", type=Path, help="the GGUF files to score against the base")
    p.add_argument("--base", type=Path, required=True, help="the base GGUF (typically the F32 file)")
    p.add_argument("--llama-perplexity", type=Path, required=True, help="llama.cpp's llama-perplexity binary")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text (default: fastllm's bundled corpus)")
    p.add_argument("--ctx", type=int, default=perplexity.DEFAULT_CTX)
    p.add_argument("--chunks", type=int, default=None, help="first N chunks only (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--activations", choices=("int8", "f32"), default="int8",
                   help="what fastllm multiplies quantized weights by (f32: the exact dequantized weights)")
    p.add_argument("--work", type=Path, default=None, help="folder for the text, logs and llama.cpp's .kld file")
    args = p.parse_args(argv)

    work = args.work or Path(tempfile.mkdtemp(prefix="fastllm-ppl-"))
    work.mkdir(parents=True, exist_ok=True)
    text = perplexity.corpus_text() if args.text is None else perplexity.read_text(args.text)
    text_file = work / "text.txt"
    text_file.write_text(text, encoding="utf-8")
    kld_file = work / "base.kld"

    t = time.perf_counter()
    print(f"llama.cpp: base {args.base.name}", file=sys.stderr)
    theirs = {args.base: llama_perplexity(args.llama_perplexity, args.base, text_file, kld_file, args, False,
                                          work / f"{args.base.stem}.log")}
    for gguf in args.ggufs:
        print(f"llama.cpp: {gguf.name}", file=sys.stderr)
        theirs[gguf] = llama_perplexity(args.llama_perplexity, gguf, text_file, kld_file, args, True,
                                        work / f"{gguf.stem}.log")
    print(f"llama.cpp took {time.perf_counter() - t:.0f} s", file=sys.stderr)

    t = time.perf_counter()
    load = lambda path: Model.from_pretrained(path, n_ctx=args.ctx, threads=args.threads,  # noqa: E731
                                              activations=args.activations)
    base = load(args.base)
    models = [load(g) for g in args.ggufs]
    ids = perplexity.tokenize(base, text)

    def progress(i, n, ppl):
        print(f"fastllm [{i}/{n}] {ppl:.4f}", file=sys.stderr, flush=True)
    ours = perplexity.evaluate_many(models, ids, args.ctx, base=base, chunks=args.chunks,
                                    bos=perplexity.chunk_bos(base), progress=progress)
    print(f"fastllm took {time.perf_counter() - t:.0f} s ({len(ids)} tokens in the text)", file=sys.stderr)

    base_ours = perplexity.Perplexity(ours[0].ctx, ours[0].chunks, ours[0].tokens, ours[0].kl.ppl_base)
    print(table(f"{args.base.name} (base)", base_ours, theirs[args.base]))
    for gguf, result in zip(args.ggufs, ours):
        print()
        print(table(gguf.name, result, theirs[gguf]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
