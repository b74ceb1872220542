"""fastllm's perplexity and KL divergence beside llama.cpp's llama-perplexity,
on the same GGUF files, the same text, the same ctx and chunks (all of them
unless --chunks says otherwise), with the same KV cache type.

    python benchmarks/perplexity.py --base smollm2-F32.gguf smollm2-Q8_0.gguf smollm2-Q4_K_M.gguf \\
        --llama-perplexity /path/to/llama-perplexity --threads 2

Like for like: both engines keep the KV cache in --kv (f32 by default; f16
gives fastllm kv_dtype="f16"), and llama.cpp runs without flash attention
(-fa off), so both compute attention unfused from the same cache type.

llama.cpp's KL mode takes two runs: the base model saves its log-probs
(--kl-divergence-base FILE), then each quantized model reads them
(--kl-divergence-base FILE --kl-divergence). Each file also runs once in
the saving mode into a file of its own, from which this script reads
llama.cpp's log-probability of every scored token (the file holds them as
16-bit steps of at most 16/65535 nats; a token more than 16 nats below the
top one is stored only as "below", and such tokens are left out of the
pairing). fastllm runs the base and every model on each chunk in one pass.

Prints one table per file: PPL, mean KL divergence from the base and top-1
agreement for both engines, and the paired difference: the mean over the
scored tokens of fastllm's NLL minus llama.cpp's NLL of the same token,
with its standard error. Text variance, which dominates each PPL's own
error, cancels in the pairing, so this says whether the engines differ.
"""
from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fastllm import Model
from fastllm.cli import perplexity

_NUMBER = r"([-\d.]+)"
_KLD_MAGIC = b"_logits_"
_LOG_PROB_RANGE = 16.0   # llama.cpp stores log-probs down to this many nats below the top


def _find(pattern: str, text: str, what: str, log: Path):
    m = re.search(pattern, text)
    if m is None:
        # (its KL summary is left out below 100 scored tokens)
        raise RuntimeError(f"llama-perplexity printed no {what}: see {log}")
    return tuple(float(g) for g in m.groups())


def llama_perplexity(tool, gguf: Path, text_file: Path, kld_file: Path, args, compare: bool, log: Path) -> dict:
    """One llama-perplexity run: with compare False a run that saves its
    log-probs to kld_file, with compare True a run that reads them."""
    cmd = [str(tool), "-m", str(gguf), "-f", str(text_file), "-c", str(args.ctx), "-t", str(args.threads),
           "-ctk", args.kv, "-ctv", args.kv, "-fa", args.llama_flash_attn,
           "--kl-divergence-base", str(kld_file)]
    if args.chunks is not None:
        cmd += ["--chunks", str(args.chunks)]
    if compare:
        cmd.append("--kl-divergence")
    # llama-perplexity now and then exits 0 with its log cut short before
    # the summary; such a run is made once more.
    summary = "Mean PPL(Q)" if compare else "Final estimate"
    for attempt in range(2):
        run = subprocess.run(cmd, capture_output=True, text=True)
        out = run.stdout + run.stderr
        log.write_text(" ".join(cmd) + "\n\n" + out)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}): see {log}")
        if summary in out:
            break
    figures = {"chunks": int(_find(r"over (\d+) chunks, n_ctx", out, "chunk count", log)[0])}
    if not compare:
        figures["ppl"] = _find(rf"Final estimate: PPL = {_NUMBER} \+/- {_NUMBER}", out, "PPL", log)
        return figures
    figures["ppl"] = _find(rf"Mean PPL\(Q\)\s*:\s*{_NUMBER}\s*±\s*{_NUMBER}", out, "PPL(Q)", log)
    figures["kld"] = _find(rf"Mean\s+KLD:\s*{_NUMBER}\s*±\s*{_NUMBER}", out, "mean KLD", log)
    top = _find(rf"Same top p:\s*{_NUMBER}\s*±\s*{_NUMBER} %", out, "top-1 agreement", log)
    figures["same_top"] = (top[0] / 100, top[1] / 100)
    return figures


def read_llama_log_probs(path: Path) -> dict:
    """The tokens and per-token NLLs in a file llama-perplexity wrote with
    --kl-divergence-base: "_logits_", n_ctx, n_vocab, n_chunk, the chunks'
    tokens (int32), then for every scored token a row of uint16: two
    float32s (scale, min_log_prob) and each vocabulary entry's log-prob as
    round((log_prob - min_log_prob) / scale), 0 at or below min_log_prob.

    Returns tokens, nll (float64, one per scored token, chunk by chunk) and
    exact (False where the token's log-prob lies below the stored range, so
    that its NLL is known only to exceed the stored figure)."""
    with open(path, "rb") as f:
        if f.read(8) != _KLD_MAGIC:
            raise ValueError(f"{path} is not a llama-perplexity log-probability file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
    offset = 8 + 12
    tokens = np.fromfile(path, dtype=np.int32, count=n_ctx * n_chunk, offset=offset)
    offset += tokens.nbytes
    first = n_ctx // 2
    per_chunk = n_ctx - 1 - first
    width = 2 * ((n_vocab + 1) // 2) + 4
    rows = np.memmap(path, dtype=np.uint16, mode="r", offset=offset, shape=(n_chunk * per_chunk, width))
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)      # (rows, 2): scale, min_log_prob
    scale, min_log_prob = head[:, 0].astype(np.float64), head[:, 1].astype(np.float64)
    targets = tokens.reshape(n_chunk, n_ctx)[:, first + 1:].reshape(-1)
    steps = rows[np.arange(targets.size), 4 + targets].astype(np.float64)
    # The range is cut at 16 nats below the top only where the logits spread
    # further; there a 0 means "somewhere below".
    cut = np.isclose(scale * 65535, _LOG_PROB_RANGE, rtol=1e-5)
    exact = ~(cut & (steps == 0))
    del rows
    return {"ctx": int(n_ctx), "chunks": int(n_chunk), "tokens": tokens,
            "nll": -(scale * steps + min_log_prob), "exact": exact}


def fastllm_per_token(models, base, ids, ctx: int, chunks, bos, progress) -> tuple:
    """perplexity.evaluate_many's pass over the chunks, keeping every scored
    token's figures: (base's NLLs, [each model's per-token dict]). The base
    runs once per chunk and is scored from those same logits."""
    n_chunks = perplexity.chunk_count(len(ids), ctx, chunks)
    if n_chunks == 0:
        raise ValueError(f"the text has {len(ids)} tokens: at least one chunk of ctx={ctx} is needed")
    ids = np.asarray(ids, dtype=np.int64)
    base_session, sessions = base.new_session(), [m.new_session() for m in models]
    first = ctx // 2
    base_nll, kept = [], [{} for _ in models]
    for i in range(n_chunks):
        chunk = ids[i * ctx:(i + 1) * ctx].copy()
        if bos is not None:
            chunk[0] = bos
        targets = chunk[first + 1:]
        base_logits = base_session.logits(chunk)[first:ctx - 1]
        base_nll.append(perplexity._score_chunk(base_logits, targets)["nll"])
        for session, per_token in zip(sessions, kept):
            for k, v in perplexity._score_chunk(session.logits(chunk)[first:ctx - 1], targets, base_logits).items():
                per_token.setdefault(k, []).append(v)
        progress(i + 1, n_chunks, math.exp(float(np.mean(np.concatenate(base_nll)))))
    return (np.concatenate(base_nll), [{k: np.concatenate(v) for k, v in t.items()} for t in kept], n_chunks)


def paired(ours: np.ndarray, theirs: dict, ids: np.ndarray) -> str:
    """fastllm's NLL minus llama.cpp's, per token, as mean ± standard error."""
    n = theirs["tokens"].size
    if not np.array_equal(ids[:n], theirs["tokens"]):
        differ = int(np.count_nonzero(ids[:n] != theirs["tokens"])) if ids.size >= n else n
        return f"not paired: the engines' tokens differ at {differ} of {n} positions"
    exact = theirs["exact"]
    diff = perplexity._mean(ours[exact] - theirs["nll"][exact])
    left_out = exact.size - int(np.count_nonzero(exact))
    return (f"NLL per token, fastllm − llama.cpp: {diff.value:+.6f} ± {diff.error:.6f} over "
            f"{exact.size - left_out} tokens (PPL ratio {math.exp(diff.value):.5f})"
            + (f"; {left_out} tokens below llama.cpp's stored range left out" if left_out else ""))


def table(name: str, ours: perplexity.Perplexity, theirs: dict, pairing: str) -> str:
    def pair(v, digits=4):
        return "—" if v is None else f"{v[0]:.{digits}f} ± {v[1]:.{digits}f}"

    def pct(v):
        return "—" if v is None else f"{100 * v[0]:.2f} ± {100 * v[1]:.2f} %"
    kl = ours.kl
    rows = [("PPL", pair((ours.ppl.value, ours.ppl.error)), pair(theirs.get("ppl"))),
            ("mean KLD", pair(kl and (kl.kld.value, kl.kld.error), 6), pair(theirs.get("kld"), 6)),
            ("same top p", pct(kl and (kl.same_top.value, kl.same_top.error)), pct(theirs.get("same_top")))]
    lines = [f"{name}: {ours.chunks} chunks of {ours.ctx}, {ours.tokens} tokens scored "
             f"(llama.cpp: {theirs['chunks']} chunks)",
             f"  {'':<12}{'fastllm':>24}{'llama.cpp':>24}"]
    lines += [f"  {label:<12}{a:>24}{b:>24}" for label, a, b in rows]
    lines.append(f"  paired: {pairing}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ggufs", nargs="*", type=Path, help="the GGUF files to score against the base")
    p.add_argument("--base", type=Path, required=True, help="the base GGUF (typically the F32 file)")
    p.add_argument("--llama-perplexity", type=Path, required=True, help="llama.cpp's llama-perplexity binary")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text (default: fastllm's bundled corpus)")
    p.add_argument("--ctx", type=int, default=perplexity.DEFAULT_CTX)
    p.add_argument("--chunks", type=int, default=None, help="first N chunks only (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv", choices=("f32", "f16"), default="f32",
                   help="KV cache type of both engines (llama.cpp: -ctk/-ctv, fastllm: kv_dtype)")
    p.add_argument("--llama-flash-attn", choices=("off", "on", "auto"), default="off",
                   help="llama.cpp's flash attention (off: unfused attention, as fastllm computes it)")
    p.add_argument("--activations", choices=("int8", "f32"), default="int8",
                   help="what fastllm multiplies quantized weights by (f32: the exact dequantized weights)")
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the text, logs and llama.cpp's log-probability files")
    p.add_argument("--keep-log-probs", action="store_true",
                   help="keep each file's llama.cpp log-probabilities (~100 KB per scored token)")
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
    theirs[args.base].update(read_llama_log_probs(kld_file))
    for gguf in args.ggufs:
        print(f"llama.cpp: {gguf.name}", file=sys.stderr)
        theirs[gguf] = llama_perplexity(args.llama_perplexity, gguf, text_file, kld_file, args, True,
                                        work / f"{gguf.stem}.log")
        own = work / f"{gguf.stem}.kld"
        llama_perplexity(args.llama_perplexity, gguf, text_file, own, args, False, work / f"{gguf.stem}.own.log")
        theirs[gguf].update(read_llama_log_probs(own))
        if not args.keep_log_probs:
            own.unlink()
    print(f"llama.cpp took {time.perf_counter() - t:.0f} s", file=sys.stderr)

    t = time.perf_counter()
    load = lambda path: Model.from_pretrained(path, n_ctx=args.ctx, threads=args.threads,  # noqa: E731
                                              activations=args.activations, kv_dtype=args.kv)
    base = load(args.base)
    models = [load(g) for g in args.ggufs]
    ids = np.asarray(perplexity.tokenize(base, text), dtype=np.int32)

    def progress(i, n, ppl):
        print(f"fastllm [{i}/{n}] base {ppl:.4f}", file=sys.stderr, flush=True)
    base_nll, per_token, n_chunks = fastllm_per_token(models, base, ids, args.ctx, args.chunks,
                                                      perplexity.chunk_bos(base), progress)
    print(f"fastllm took {time.perf_counter() - t:.0f} s ({len(ids)} tokens in the text)", file=sys.stderr)

    print(f"KV cache {args.kv} in both engines; llama.cpp flash attention {args.llama_flash_attn}; "
          f"fastllm activations {args.activations}")
    print()
    base_ours = perplexity.Perplexity(args.ctx, n_chunks, base_nll.size, perplexity._ppl(base_nll))
    print(table(f"{args.base.name} (base)", base_ours, theirs[args.base], paired(base_nll, theirs[args.base], ids)))
    for gguf, figures in zip(args.ggufs, per_token):
        print()
        ours = perplexity._figures(args.ctx, n_chunks, figures)
        print(table(gguf.name, ours, theirs[gguf], paired(figures["nll"], theirs[gguf], ids)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
