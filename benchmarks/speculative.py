"""Speculative decoding, side by side with llama.cpp's.

Two measurements:

1. Tokens/s of greedy replies, fastllm plain against fastllm speculating
   (n-gram lookup, a draft model, or the model's MTP block), and llama-server
   plain against its own speculation on the same GGUF files, same chat
   prompts, same threads and draft length, in rotating order over several
   rounds (medians). Workloads: code edits (rename a variable, add type
   hints, rewrite a function of the Python standard library: 100-900-token
   inputs that the reply mostly repeats) and open-ended chat (no
   repetition: the back-off must keep speculation from costing). fastllm's
   replies with and without speculation are checked to be identical.

       python benchmarks/speculative.py --model CODER.gguf --llama-bin LLAMA/build/bin \\
           --threads 2 --rounds 3 [--draft DRAFT.gguf] [--spec ngram]

2. --pass-cost FILE...: what one verification pass of k+1 tokens costs
   against one decode step, per file, after a 256-token prompt (medians of
   --steps alternating measurements).

       python benchmarks/speculative.py --pass-cost 2B-Q4_K_M.gguf --threads 2

llama-server runs one process per configuration (speculation is a server
setting), each with -t/-tb THREADS, --parallel 1, -c 4096 and its defaults
otherwise (f16 KV cache, flash attention auto); fastllm loads with
kv_dtype="f16" to match. Timings are each engine's own: fastllm's
GenerationStats.generate_tps (sampling and drafting included), llama-server's
timings.predicted_per_second.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np


def _source(obj) -> str:
    return inspect.getsource(obj)


def code_prompts() -> list:
    """(name, prompt) of the code-editing workload, from the standard library."""
    import argparse as ap
    import fnmatch
    import shlex
    import string
    import textwrap
    fence = "```python\n{}```"
    return [
        ("rename", "Rename the variable `chunks` to `pieces` everywhere in this method. Reply with the whole "
                   "method and nothing else.\n\n" + fence.format(_source(textwrap.TextWrapper._wrap_chunks))),
        ("type hints", "Add type hints to these functions. Reply with the code only.\n\n"
                       + fence.format(_source(string.Template.substitute) + "\n" + _source(shlex.split))),
        ("rewrite", "Rewrite this function with `pat` renamed to `pattern` and `res` renamed to `result`. "
                    "Reply with the code only.\n\n" + fence.format(_source(fnmatch.translate))),
        ("docstring", "Add a docstring to this method, change nothing else, and reply with the whole method."
                      "\n\n" + fence.format(_source(ap.HelpFormatter._format_usage))),
    ]


CHAT_PROMPTS = [
    ("story", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("explain", "Explain how a refrigerator keeps food cold, for a ten-year-old."),
]


# ------------------------------------------------------------------ llama.cpp

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server with one speculative configuration."""

    def __init__(self, bin_dir: Path, model: Path, threads: int, args: list, label: str):
        self.label, self.port = label, _free_port()
        cmd = [str(bin_dir / "llama-server"), "-m", str(model), "-t", str(threads), "-tb", str(threads),
               "--parallel", "1", "-c", "4096", "--port", str(self.port), "--jinja", "--no-webui"] + args
        env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        end = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"llama-server ({label}) did not start: {self.proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)

    def reply(self, prompt: str, max_tokens: int) -> dict:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "cache_prompt": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=1200) as r:
            out = json.loads(r.read())
        t = out["timings"]
        return {"tps": t["predicted_per_second"], "tokens": t["predicted_n"],
                "drafted": t.get("draft_n", 0), "accepted": t.get("draft_n_accepted", 0),
                "text": out["choices"][0]["message"]["content"]}

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


# -------------------------------------------------------------------- fastllm

class Fastllm:
    def __init__(self, model, spec, label: str):
        self.model, self.spec, self.label = model, spec, label

    def reply(self, prompt: str, max_tokens: int) -> dict:
        m = self.model
        text = m.chat([{"role": "user", "content": prompt}], max_new_tokens=max_tokens, speculative=self.spec)
        s = m.last_stats
        return {"tps": s.generate_tps, "tokens": s.generated_tokens, "drafted": s.drafted_tokens,
                "accepted": s.accepted_tokens, "text": text}


def run_replies(args):
    from fastllm import Model
    from fastllm.generate.speculative import DraftModel, Speculation
    threads = args.threads
    model = Model.from_pretrained(args.model, threads=threads, kv_dtype="f16", n_ctx=4096)
    model.draft_max = args.draft_max
    engines = [Fastllm(model, False, "fastllm plain")]
    if args.draft:
        draft = Model.from_pretrained(args.draft, threads=threads, kv_dtype="f16", n_ctx=4096)
        drafter = DraftModel(draft, model)
        engines.append(Fastllm(model, Speculation(drafter, args.draft_max), "fastllm draft model"))
    for kind in args.spec:
        engines.append(Fastllm(model, kind, f"fastllm {kind}"))
    servers = []
    if args.llama_bin:
        configs = [("llama.cpp plain", [])]
        n = str(args.draft_max)
        if args.draft:
            configs.append(("llama.cpp draft model", ["-md", str(args.draft), "--spec-draft-n-max", n,
                                                     "-td", str(threads), "-tbd", str(threads)]))
        if "ngram" in args.spec:
            configs += [("llama.cpp ngram-simple", ["--spec-type", "ngram-simple",
                                                    "--spec-ngram-simple-size-m", n, "--spec-draft-n-max", n]),
                        ("llama.cpp ngram-map-k", ["--spec-type", "ngram-map-k",
                                                   "--spec-ngram-map-k-size-m", n, "--spec-draft-n-max", n]),
                        ("llama.cpp ngram-mod", ["--spec-type", "ngram-mod", "--spec-draft-n-max", n])]
        if "mtp" in args.spec:
            configs.append(("llama.cpp draft-mtp", ["--spec-type", "draft-mtp", "--spec-draft-n-max", n]))
        for label, extra in configs:
            servers.append(LlamaServer(Path(args.llama_bin), Path(args.model), threads, extra, label))
    engines += servers
    prompts = {"code": code_prompts(), "chat": CHAT_PROMPTS}
    workload = [p for w in args.workload for p in prompts[w]]
    results = {(e.label, name): [] for e in engines for name, _ in workload}
    try:
        for name, prompt in workload:   # warm: prompt caches and first-use costs
            for e in engines:
                e.reply(prompt, 8)
        for r in range(args.rounds):
            for i, (name, prompt) in enumerate(workload):
                order = engines[(r + i) % len(engines):] + engines[:(r + i) % len(engines)]
                for e in order:
                    results[(e.label, name)].append(e.reply(prompt, args.max_tokens))
                texts = {results[(e.label, name)][-1]["text"] for e in engines if isinstance(e, Fastllm)}
                assert len(texts) == 1, f"{name}: fastllm's replies differ with speculation"
    finally:
        for s in servers:
            s.close()
    print(f"\n{args.model}: {threads} threads, greedy, at most {args.max_tokens} tokens a reply, draft max "
          f"{args.draft_max}, {args.rounds} rounds (medians); Python {sys.version.split()[0]}")
    print("| prompt | engine | tokens | tok/s | speed-up over its plain | guesses kept / drafted |")
    print("|---|---|---:|---:|---:|---:|")
    for name, _ in workload:
        base = {}
        for e in engines:
            rs = results[(e.label, name)]
            tps = statistics.median(x["tps"] for x in rs)
            engine = e.label.split()[0]
            base.setdefault(engine, tps)
            drafted, accepted = sum(x["drafted"] for x in rs), sum(x["accepted"] for x in rs)
            kept = f"{accepted / drafted:.2f} of {drafted // len(rs)}" if drafted else "-"
            print(f"| {name} | {e.label} | {statistics.median(x['tokens'] for x in rs):.0f} | {tps:.1f} | "
                  f"{tps / base[engine]:.2f} | {kept} |")


# ------------------------------------------------------------------ pass cost

def run_pass_cost(args):
    from fastllm import Model
    for path in args.pass_cost:
        m = Model.from_pretrained(path, threads=args.threads, n_ctx=1024)
        rng = np.random.default_rng(0)
        prompt = rng.integers(100, min(m.config.vocab_size, 20000), 256).tolist()
        s = m.new_session()
        s.prefill(prompt)
        saved = s.save_recurrent()   # where each measurement starts again
        times = {1: [], **{k + 1: [] for k in args.k}}
        for i in range(args.steps):
            sizes = list(times)
            for n in (sizes if i % 2 == 0 else sizes[::-1]):
                tokens = rng.integers(100, 20000, n).tolist()
                t0 = time.perf_counter()
                if n == 1:
                    s.step(tokens[0])
                else:
                    s.verify(tokens)
                times[n].append(time.perf_counter() - t0)
                if s.can_rewind:
                    s.rewind(len(prompt))
                else:
                    s.restore_recurrent(saved)
        step = statistics.median(times[1])
        print(f"{Path(path).name}: {args.threads} threads, decode step {step * 1e3:.1f} ms; " + ", ".join(
            f"pass of {n} tokens {statistics.median(t) * 1e3:.1f} ms = {statistics.median(t) / step:.2f} steps"
            for n, t in times.items() if n > 1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the target GGUF file")
    p.add_argument("--draft", default=None, help="a draft model's GGUF file (same vocabulary)")
    p.add_argument("--spec", action="append", choices=("ngram", "mtp"), default=None,
                   help="fastllm's (and llama.cpp's) draftless kinds to measure (default: ngram)")
    p.add_argument("--llama-bin", default=None, help="llama.cpp's build/bin (llama-server); none: fastllm only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--draft-max", type=int, default=16)
    p.add_argument("--workload", action="append", choices=("code", "chat"), default=None)
    p.add_argument("--pass-cost", nargs="+", default=None, metavar="FILE")
    p.add_argument("--k", type=int, nargs="+", default=[3, 7, 15], help="guesses per pass for --pass-cost")
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()
    if args.pass_cost:
        run_pass_cost(args)
        return
    if not args.model:
        p.error("--model is needed (or --pass-cost)")
    args.spec = args.spec or (["ngram"] if not args.draft else [])
    args.workload = args.workload or ["code", "chat"]
    run_replies(args)


if __name__ == "__main__":
    main()
