"""Does memory stay flat over a long session? Resident memory (RSS) is read
while the default model generates many times, and while a model is loaded
and dropped many times; a leak shows as steady growth after the first
rounds have filled the allocator's pools.

    python benchmarks/soak.py [--calls 1000] [--loads 100] [--model PATH]

Prints RSS every tenth of the way and the growth between the first and the
last tenth; exits 1 when either grows by more than --limit MiB (default 16).
"""
import argparse
import gc
import sys
import time

from fastllm import Model


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def watch(name, rounds, step):
    """Run step(i) rounds times; RSS at each tenth; growth from the first tenth."""
    marks = []
    t0 = time.perf_counter()
    for i in range(rounds):
        step(i)
        if (i + 1) % max(rounds // 10, 1) == 0:
            gc.collect()
            marks.append(rss_mib())
            print(f"{name}: {i + 1:5d} rounds, RSS {marks[-1]:7.1f} MiB", flush=True)
    growth = marks[-1] - marks[0]
    print(f"{name}: {rounds} rounds in {time.perf_counter() - t0:.0f} s, "
          f"RSS {marks[0]:.1f} -> {marks[-1]:.1f} MiB ({growth:+.1f} MiB after the first tenth)")
    return growth


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000, help="generate calls on one model")
    ap.add_argument("--loads", type=int, default=100, help="load/drop cycles")
    ap.add_argument("--model", default=None, help="model folder or GGUF (default: the default model)")
    ap.add_argument("--limit", type=float, default=16.0, help="allowed growth in MiB")
    args = ap.parse_args()

    model = Model.from_pretrained(args.model, n_ctx=256)
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time",
               "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"]
    grew = watch("generate", args.calls,
                 lambda i: model.generate(prompts[i % len(prompts)], max_new_tokens=8,
                                          temperature=0.7, seed=i))
    folder = model.path
    del model
    gc.collect()
    grew_load = watch("load/drop", args.loads, lambda i: Model.from_pretrained(folder, n_ctx=256))
    ok = grew <= args.limit and grew_load <= args.limit
    print("flat" if ok else f"grew past {args.limit} MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
