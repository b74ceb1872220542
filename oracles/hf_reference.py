"""transformers as the reference for logits, layer outputs and greedy decoding."""
from __future__ import annotations

import numpy as np


def load_hf(folder, dtype="float32"):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.eval()
    return model


def hf_logits(model, ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long))
    return out.logits[0].float().numpy()


def hf_layer_outputs(model, ids) -> np.ndarray:
    """Each decoder layer's output, taken with forward hooks: (n_layers, n, dim)."""
    import torch
    outs = []

    def hook(_module, _inputs, output):
        outs.append((output[0] if isinstance(output, tuple) else output)[0].float().numpy().copy())
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
            logits = out.logits[0, -1].float()
            top2 = torch.topk(logits, 2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            out = model(torch.tensor([[tokens[-1]]], dtype=torch.long),
                        past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


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
