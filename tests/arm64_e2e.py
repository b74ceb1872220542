"""The default model end to end on aarch64, under emulation (tests/arm64_python.sh).

    run PATH_NAME MODEL.gguf OUT.npz [--threads N]
        runs inside qemu-aarch64, with the fastllm package cross-built for
        aarch64: checks that the CPU chose (or FASTLLM_SIMD forced) the path
        named, then saves, for each prompt, the logits at every position and
        the greedy tokens with the logits that chose them, with int8
        activations (what users run; 4 prompts, 32 tokens) and with f32
        activations (1 prompt, 8 tokens).
    compare REFERENCE.npz RUN.npz [RUN.npz ...]
        runs on the host: each run against the portable path's.

Against the portable path:
- f32 activations: a path differs only in summation order, so its logits
  keep the oracle bound (1e-4 absolute + 1e-4 relative) at every position,
  and the greedy tokens are equal wherever the portable path's top-1/top-2
  margin exceeds that bound.
- int8 activations: the int8 kernels give the portable path's bits, but
  the float kernels' rounding moves activations across quantization steps,
  and that noise is as large as int8's own (on x86, avx2 and avx512 against
  generic on these prompts: logits up to 1.3 apart, mean KL 0.0034, top-1
  agreement 0.995 and 1). So the
  bounds are test_quantized_gguf.py's for int8 against f32 with the KL doubled (two
  paths' noise adds): top-1 agreement >= 0.94, mean KL < 0.01, and greedy
  tokens equal wherever the margin is >= 1.
The aarch64 paths share their float kernels and their int8 kernels all give
the portable bits, so every aarch64 run (whatever its int8 kernels and
thread count) must give the first one's logits and tokens bit for bit.
"""
import sys

import numpy as np

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
]
CHAT = [{"role": "user", "content": "What is 2+2? Answer in one sentence."}]
# Prompts and new tokens per activation type. qemu computes every float
# operation in software, so f32 activations (all the matmuls in floats)
# take minutes a prompt: they run one prompt, shorter.
PLAN = {"int8": (4, 32), "f32": (1, 8)}
ACTIVATIONS = tuple(PLAN)
F32_BOUND = (1e-4, 1e-4)          # absolute, relative
INT8_TOP1, INT8_KL, INT8_CLEAR_MARGIN = 0.94, 0.01, 1.0


def run(path_name, model_path, out, threads=1):
    from fastllm import Model
    from fastllm.core import _core
    got = _core.simd_path()
    assert got == path_name, f"the CPU runs the {got} path, not {path_name}"
    saved = {"path": path_name, "int8_path": _core.int8_path(), "threads": threads}
    for act in ACTIVATIONS:
        model = Model.from_pretrained(model_path, n_ctx=512, threads=threads, activations=act)
        tok = model.tokenizer
        prompts = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]
        prompts.append(tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True),
                                  add_special_tokens=False))
        n_prompts, new_tokens = PLAN[act]
        for i, ids in enumerate(prompts[:n_prompts]):
            tokens = list(model.generate_tokens(ids, new_tokens, stop_token_ids=()))
            # The logits at every position, and those that chose each new
            # token: one forward pass over the prompt and all but the last.
            logits = model.logits(ids + tokens[:-1])
            saved[f"{act}/{i}/ids"] = np.array(ids)
            saved[f"{act}/{i}/tokens"] = np.array(tokens)
            saved[f"{act}/{i}/logits"] = logits
            print(f"{path_name} {act} prompt {i}: {tok.decode(tokens)!r}", flush=True)
    np.savez_compressed(out, **saved)


def margins(logits):
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def kl_per_position(logits, ref):
    """KL(softmax(ref) || softmax(logits)) at each position."""
    ref, logits = ref.astype(np.float64), logits.astype(np.float64)
    logp = ref - ref.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    logq = logits - logits.max(1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(1, keepdims=True))
    return (np.exp(logp) * (logp - logq)).sum(1)


def first_difference(tokens, want_tokens):
    differ = np.nonzero(tokens != want_tokens)[0]
    return int(differ[0]) if len(differ) else len(tokens)


def compare_to_portable(ref, got, act, label):
    """The failures of one run against the portable path's, for one activation type."""
    failures, worst, kls, top1, equal = [], 0.0, [], [], 0
    n_prompts = PLAN[act][0]
    for i in range(n_prompts):
        key = f"{act}/{i}"
        n = len(ref[key + "/ids"])
        want_tokens, tokens = ref[key + "/tokens"], got[key + "/tokens"]
        want, logits = ref[key + "/logits"], got[key + "/logits"]
        k = first_difference(tokens, want_tokens)
        equal += k == len(tokens)
        # Up to the first differing token both ran on the same context.
        want, logits = want[:n + k], logits[:n + k]
        if act == "f32":
            atol, rtol = F32_BOUND
            ratio = np.abs(logits.astype(np.float64) - want) / (atol + rtol * np.abs(want))
            worst = max(worst, float(ratio.max()))
            clear = atol + rtol * np.abs(want[-1]).max()
        else:
            kls.append(kl_per_position(logits, want))
            top1.append(logits.argmax(1) == want.argmax(1))
            clear = INT8_CLEAR_MARGIN
        if k < len(tokens):
            margin = margins(ref[key + "/logits"][n - 1 + k:n + k])[0]
            where = f"greedy token {k}: {tokens[k]}, the portable path's {want_tokens[k]}, margin {margin:.3g}"
            if margin >= clear:
                failures.append(f"{label}, {act} activations, prompt {i}: {where}")
            else:
                print(f"     {act} prompt {i}: parted at a near tie ({where})")
    if act == "f32":
        summary = f"logits at {worst:.2f} of the bound ({F32_BOUND[0]:g} + {F32_BOUND[1]:g}|ref|)"
        if worst > 1:
            failures.append(f"{label}, f32 activations: logits {worst:.2f} times the bound")
    else:
        # Over all positions compared, as test_quantized_gguf.py counts them.
        kl, agree = float(np.concatenate(kls).mean()), float(np.concatenate(top1).mean())
        summary = (f"mean KL {kl:.5f} (bound {INT8_KL}), top-1 agreement {agree:.3f} (bound {INT8_TOP1}) "
                   f"over {sum(map(len, top1))} positions")
        if kl >= INT8_KL or agree < INT8_TOP1:
            failures.append(f"{label}, int8 activations: {summary}")
    print(f"{'FAIL' if failures else 'ok  '} {label}, {act} activations: {summary}; "
          f"greedy text equal on {equal}/{n_prompts} prompts")
    return failures


def compare(reference, runs):
    ref = np.load(reference)
    print(f"reference: the {ref['path']} path, {int(ref['threads'])} thread(s)")
    failures, first = [], None
    for name in runs:
        got = np.load(name)
        label = f"{got['path']} (int8 kernels: {got['int8_path']}, {int(got['threads'])} threads)"
        for act in ACTIVATIONS:
            failures += compare_to_portable(ref, got, act, label)
        if first is None:
            first, first_label = got, label
            continue
        differ = [k for k in first.files if k.count("/") == 2 and not np.array_equal(first[k], got[k])]
        if differ:
            failures.append(f"{label}: not bit for bit the results of {first_label} ({', '.join(differ[:4])})")
        else:
            print(f"ok   {label}: bit for bit the results of {first_label}")
    for f in failures:
        print("FAIL", f)
    return not failures

if __name__ == "__main__":
    if sys.argv[1] == "run":
        threads = int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1
        run(sys.argv[2], sys.argv[3], sys.argv[4], threads)
    elif sys.argv[1] == "compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3:]) else 1)
    else:
        sys.exit(__doc__)
