"""The parts of scale.py that run in a process of their own.

    python benchmarks/scale_worker.py {fastllm,transformers} FOLDER DTYPE THREADS PP TG REPS

times one engine on one checkpoint at one thread count, one process per
case, so that no thread pool of an earlier case is around;

    python benchmarks/scale_worker.py checkpoint FOLDER

fills FOLDER, which holds a config.json, with random bf16 weights
(model.safetensors).

The protocol is llama-bench's, so that the three engines are timed alike:
pp N is one forward pass over N random tokens from an empty cache, after
one full warm-up pass; tg N is N single-token steps from an empty cache,
after a one-token warm-up. Every figure is the mean over REPS runs of
tokens / seconds. Prints one JSON object.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import numpy as np


def timed(run, n: int, reps: int) -> dict:
    speeds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        speeds.append(n / (time.perf_counter() - t0))
    return {"tok_s": statistics.mean(speeds),
            "sd": statistics.stdev(speeds) if len(speeds) > 1 else 0.0, "samples": speeds}


def bench_fastllm(folder, dtype, threads, pp, tg, reps):
    import fastllm
    from fastllm import Model
    from fastllm.core import _core, _openmp
    t0 = time.perf_counter()
    # SCALE_KV_DTYPE picks the KV cache (f32, bf16, f16); FASTLLM_SIMD the path.
    model = Model.from_pretrained(folder, n_ctx=max(pp, tg, 1), threads=threads, dtype=dtype,
                                  kv_dtype=os.environ.get("SCALE_KV_DTYPE", "f32"))
    load_s = time.perf_counter() - t0
    # A session, as `fastllm bench` times it: no tokenizer or sampler.
    session = model.new_session()
    tokens = np.random.default_rng(0).integers(0, session.vocab_size, max(pp, tg, 1)).astype(np.int32)

    def prompt(n):
        def run():
            session.reset()
            session.extend(tokens[:n])
        return run

    def generate(n):
        def run():
            session.reset()
            for token in tokens[:n]:
                session.step(token)
        return run

    info = {"version": getattr(fastllm, "__version__", "?"), "simd": _core.simd_path(),
            "openmp_wait": _openmp.wait_policy(), "kv_cache": model.kv_dtype}
    return load_s, info, run_tests(prompt, generate, pp, tg, reps)


def bench_transformers(folder, dtype, threads, pp, tg, reps):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype={"f32": torch.float32, "bf16": torch.bfloat16}[dtype]).eval()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, max(pp, tg, 1))).view(1, -1)

    def prompt(n):
        def run():
            with torch.inference_mode():
                model(input_ids=ids[:, :n], use_cache=False, logits_to_keep=1)
        return run

    def generate(n):
        # Greedy generation of exactly n tokens after a one-token prompt:
        # n forward passes, the first from an empty cache.
        def run():
            with torch.inference_mode():
                model.generate(ids[:, :1], max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
        return run

    info = {"version": transformers.__version__, "torch": torch.__version__,
            "attention": getattr(model.config, "_attn_implementation", "?"),
            "pp": "one forward, use_cache=False, logits_to_keep=1", "tg": "greedy generate"}
    return load_s, info, run_tests(prompt, generate, pp, tg, reps)


def run_tests(prompt, generate, pp, tg, reps):
    results = []
    if pp > 0:
        prompt(pp)()  # warm-up: the full prompt, as llama-bench
        results.append({"test": f"pp{pp}", **timed(prompt(pp), pp, reps)})
    if tg > 0:
        generate(1)()  # warm-up: one token, as llama-bench
        results.append({"test": f"tg{tg}", **timed(generate(tg), tg, reps)})
    return results


def make_checkpoint(folder) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # names and shapes only: no memory, no init
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()
              if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    # Drawing billions of random numbers, or even giving each tensor memory
    # of its own, takes longer than the timing runs. The values do not change
    # the speed as long as they are of a trained model's size (no overflow, no
    # subnormals): one block of N(0, 0.02) numbers, of a prime length so that
    # rows do not repeat in step, is tiled over every matrix; norms are ones
    # and biases zeros, as transformers initializes them.
    block = np.random.default_rng(0).standard_normal(1_000_003, dtype=np.float32) * 0.02
    tiled = np.resize((block.view(np.uint32) >> 16).astype(np.uint16),  # bf16 bits
                      max(math.prod(s) for s in shapes.values()))
    data = {}
    for name, shape in shapes.items():
        if len(shape) > 1:
            data[name] = tiled[:math.prod(shape)]
        elif name.endswith(".bias"):
            data[name] = np.zeros(shape[0], np.uint16)
        else:
            data[name] = np.full(shape[0], 0x3F80, np.uint16)  # 1.0 in bf16
    write_safetensors_bf16(f"{folder}/model.safetensors", data, shapes)
    n = sum(math.prod(s) for s in shapes.values())
    print(f"{folder}: {len(shapes)} tensors, {n / 1e6:.1f} M parameters")


def write_safetensors_bf16(path, data: dict, shapes: dict) -> None:
    """The safetensors layout: header length, JSON header, then the bytes of
    each tensor (here bf16 bits) at the offsets the header gives."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, bits in data.items():
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + bits.nbytes]}
        offset += bits.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for bits in data.values():
            f.write(memoryview(np.ascontiguousarray(bits, "<u2")).cast("B"))


def main(argv):
    engine, folder, dtype = argv[0], argv[1], argv[2]
    threads, pp, tg, reps = (int(x) for x in argv[3:7])
    bench = {"fastllm": bench_fastllm, "transformers": bench_transformers}[engine]
    load_s, info, results = bench(folder, dtype, threads, pp, tg, reps)
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    print(json.dumps({"engine": engine, "dtype": dtype, "threads": threads, "load_s": load_s,
                      "peak_rss_mib": round(peak, 1), "info": info, "results": results}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "checkpoint":
        make_checkpoint(sys.argv[2])
    elif len(sys.argv) == 8 and sys.argv[1] in ("fastllm", "transformers"):
        main(sys.argv[1:])
    else:
        sys.exit(__doc__)
