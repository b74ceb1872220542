"""transformers as the reference for logits, layer outputs and greedy decoding.

The reference runs in float64: the checkpoint is upcast, so its own rounding
is some 1e-16 and a bound measures fastllm's fp32 error alone. Two fp32
engines compared with each other differ by the sum of both engines'
rounding, and torch's share of it changes with the CPU's kernels (AVX2,
AVX-512, NEON, oneDNN): a 1e-4 bound against an fp32 reference held on one
machine and failed on another. fastllm's own arithmetic is fixed by its SIMD
path (no fast-math, no contraction, a fixed summation order for any thread
count), so its distance from a float64 reference is the same on every CPU
that takes the same path. transformers still rounds a few steps to float32
even in a float64 model (RMSNorm's mean of squares, RoPE's angles); those are
steps fastllm rounds the same way, and they move the logits by ~1e-7.
"""
from __future__ import annotations

import numpy as np


def load_hf(folder, dtype="float64"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    # Multimodal wrappers that AutoModelForCausalLM does not take (mistral3).
    auto = AutoModelForImageTextToText if AutoConfig.from_pretrained(folder).model_type == "mistral3" \
        else AutoModelForCausalLM
    # Mixtures of experts run their experts one by one ("eager"): the
    # grouped kernels take no float64.
    model = auto.from_pretrained(folder, dtype=getattr(torch, dtype), experts_implementation="eager")
    model.eval()
    return model


def hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long))
    return out.logits[0].double().numpy()


def hf_layer_outputs(model, ids) -> np.ndarray:
    """Each decoder layer's output, taken with forward hooks: (n_layers, n, dim)."""
    import torch
    outs = []

    def hook(_module, _inputs, output):
        outs.append((output[0] if isinstance(output, tuple) else output)[0].double().numpy().copy())
    inner = getattr(model.model, "language_model", model.model)  # multimodal wrappers
    handles = [layer.register_forward_hook(hook) for layer in inner.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([list(ids)], dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    return np.stack(outs)


def hf_greedy(model, ids, n_new: int):
    """Greedy continuation of ids for exactly n_new tokens (end-of-sequence
    tokens included, so nothing is masked), with the reference's KV cache,
    and per step the top-1/top-2 logit margin."""
    import torch
    tokens, margins = [], []
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long), use_cache=True)
        for _ in range(n_new):
            logits = out.logits[0, -1].double()
            top2 = torch.topk(logits, 2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            out = model(torch.tensor([[tokens[-1]]], dtype=torch.long),
                        past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


def hf_teacher_forced(model, ids, continuation):
    """What the reference's greedy decoding would pick after ids + each
    prefix of continuation, from one forward pass: (picks, margins, logits
    over the whole sequence). While continuation agrees with the picks it is
    the reference's own greedy sequence, so compare_greedy(continuation,
    picks, margins) judges it exactly as it would judge hf_greedy's output."""
    n = len(ids)
    logits = hf_logits(model, list(ids) + list(continuation))
    steps = logits[n - 1:n - 1 + len(continuation)]
    top2 = np.sort(steps, axis=1)[:, -2:]
    picks = [int(t) for t in steps.argmax(axis=1)]
    return picks, list(top2[:, 1] - top2[:, 0]), logits


def within(got, ref, atol=1e-4, rtol=1e-4):
    """|got - ref| <= atol + rtol*|ref| everywhere; returns (ok, max abs error, worst ratio)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = np.abs(got - ref)
    ratio = err / (atol + rtol * np.abs(ref))
    return bool((ratio <= 1).all()), float(err.max()), float(ratio.max())


def compare_greedy(ours, ref, margins, min_margin=1e-3):
    """Tokens must agree wherever the reference's margin exceeds min_margin.
    Returns (ok, number of tokens compared, index of first divergence or None)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            # After a tie-level divergence the two sequences differ in
            # context, so nothing further can be compared.
            return margins[i] <= min_margin, i, i
    return len(ours) == len(ref), len(ref), None


def random_prompt(vocab: int, n: int, seed: int = 0) -> list:
    """n token ids drawn from the whole vocabulary."""
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def logits_against_transformers(folder, n: int, label: str, seed: int = 1):
    """fastllm's logits (2 threads) for a random prompt of n ids against
    float64 transformers on the same folder, asserted within the bound:
    (model, ids, logits, err/bound)."""
    from fastllm import Model
    ours = Model.from_pretrained(folder, threads=2)
    ids = random_prompt(ours.config.vocab_size, n, seed)
    got = ours.logits(ids)
    ok, err, ratio = within(got, hf_logits(load_hf(folder), ids))
    assert ok, f"{label}: max |err| {err:.3g} exceeds the bound"
    return ours, ids, got, ratio

