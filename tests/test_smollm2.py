"""Oracles on the real default model, SmolLM2-135M-Instruct, against
transformers loading the same converted folder in float64 (fastllm's fp32
error alone is measured: oracles/hf_reference.py says why).

a. weights as loaded equal the file's once the RoPE permutation is undone
b. one decoder layer, fed the reference's own input, gives its output
c. logits at every position of several prompts
d. greedy generation, 64 tokens on 10+ prompts
e. cached decoding bit-identical to recompute
Bounds: |got - ref| <= 1e-4 + 1e-4*|ref|.
"""
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from fastllm import Model
from fastllm.core import _core
from fastllm.spec.config import ModelConfig
from fastllm.spec.schema import BY_FIELD
from fastllm.load.weights import load_weights, rope_permutation
from oracles.hf_reference import (compare_greedy, hf_greedy, hf_logits, hf_teacher_forced, load_hf,
                                  within)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in 2024, there were 12345 cats",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at 100 degrees Celsius, which is",
    "import numpy as np\n\nx = np.arange(10)\n",
    "Les chats sont",
    "1, 1, 2, 3, 5, 8, 13,",
    "The quick brown fox",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "In machine learning, gradient descent",
]


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return Model.from_pretrained(smollm2_dir, n_ctx=512, threads=2)


@pytest.fixture(scope="module")
def ref(smollm2_dir):
    return load_hf(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tok(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def unpack(packed, shape):
    """Undo the panel packing (16 rows side by side for each k), read from
    the layout's definition rather than from fastllm's code."""
    n, k = shape
    panels = -(-n // 16)
    assert packed.dtype == "f32" and packed.shape == shape
    values = packed.data.view(np.float32)
    return values.reshape(panels, k, 16).transpose(0, 2, 1).reshape(panels * 16, k)[:n]


@pytest.mark.slow
def test_a_weights_equal_the_file(smollm2_dir):
    from safetensors.numpy import load_file
    cfg = ModelConfig.from_file(smollm2_dir / "config.json")
    loaded = load_weights(cfg, smollm2_dir)
    tensors = load_file(str(smollm2_dir / "model.safetensors"))
    inverse = np.argsort(rope_permutation(cfg.head_dim, cfg.rope_dim))
    heads = {"wq": cfg.num_attention_heads, "wk": cfg.num_key_value_heads}
    for i, layer in enumerate(loaded["layers"]):
        for key, arr in layer.items():
            if key == "kind":
                continue
            want = tensors[f"model.layers.{i}.{BY_FIELD[key].hf}"]
            if want.ndim == 2:
                arr = unpack(arr, want.shape)
            if key in heads:
                arr = arr.reshape(heads[key], cfg.head_dim, -1)[:, inverse].reshape(arr.shape)
            assert np.array_equal(arr, want), f"layer {i} {key}"
    embedding = tensors["model.embed_tokens.weight"]
    assert loaded["embed"] is None  # tied: one packed copy serves as head and embedding
    assert np.array_equal(unpack(loaded["lm_head"], embedding.shape), embedding)
    assert np.array_equal(loaded["norm"], tensors["model.norm.weight"])


@pytest.mark.parametrize("layer", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(14, marks=pytest.mark.slow), 29])
def test_b_one_decoder_layer(layer, smollm2_dir, ref, hf_tok):
    """The layer's input is taken from the reference with a hook and fed to a
    one-layer engine as its 'embedding table', so the layer is judged alone."""
    import torch
    ids = hf_tok(PROMPTS[2] + " " + PROMPTS[8])["input_ids"]
    seen = {}

    def hook(_m, args, kwargs, output):
        seen["in"] = (args[0] if args else kwargs["hidden_states"])[0].numpy().copy()
        seen["out"] = (output[0] if isinstance(output, tuple) else output)[0].numpy().copy()
    h = ref.model.layers[layer].register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            ref(torch.tensor([ids]))
    finally:
        h.remove()
    cfg = ModelConfig.from_file(smollm2_dir / "config.json")
    weights = load_weights(cfg, smollm2_dir)
    n = len(ids)
    table = np.ascontiguousarray(seen["in"], np.float32)
    one_layer = dataclasses.replace(cfg, num_hidden_layers=1, vocab_size=n, tie_word_embeddings=False)
    engine = _core.State(_core.Weights(one_layer, dict(weights, layers=[weights["layers"][layer]], embed=table,
                                                        lm_head=_core.pack(table)), n, 2))
    _, trace = engine.run(np.arange(n, dtype=np.int32), 0, True, True)
    ok, err, ratio = within(trace[0], seen["out"])
    assert ok, f"layer {layer}: max |err| {err:.3g}, worst err/bound {ratio:.2f}"


@pytest.fixture(scope="module")
def ref_logits(ref, hf_tok):
    return [(p, ids, hf_logits(ref, ids))
            for p in PROMPTS[:6] for ids in [hf_tok(p)["input_ids"]]]


@pytest.mark.parametrize("path", [pytest.param("generic", marks=pytest.mark.slow),
                                  pytest.param("avx2", marks=pytest.mark.slow), "avx512"])
def test_c_logits_every_position(path, ours, ref_logits, simd_path):
    """Each SIMD path that this CPU can run: another CPU may pick another."""
    simd_path(path)
    worst = 0.0
    for prompt, ids, want in ref_logits:
        ok, err, ratio = within(ours.logits(ids), want)
        worst = max(worst, ratio)
        assert ok, f"{path} {prompt!r}: max |err| {err:.3g} (err/bound {ratio:.2f})"
    print(f"{path}: worst err/bound over all positions: {worst:.3f}")


@pytest.mark.slow
def test_d_greedy_generation(ours, ref, hf_tok):
    smallest, drift, compared = np.inf, 0.0, 0
    for prompt in PROMPTS:
        ids = hf_tok(prompt)["input_ids"]
        got = list(ours.generate_tokens(ids, 64, stop_token_ids=()))
        # One reference pass over our sequence gives the reference's greedy
        # choice at every step (hf_teacher_forced says why that is exact).
        want, margins, ref_logits = hf_teacher_forced(ref, ids, got)
        ok, n, diverged = compare_greedy(got, want, margins)
        assert ok, f"{prompt!r}: token {diverged} differs where the margin is {margins[diverged]:.3g}"
        compared += n
        smallest = min(smallest, min(margins[:n]))
        # Drift: logits along the whole generated sequence.
        drift = max(drift, float(np.abs(ours.logits(ids + got) - ref_logits).max()))
    assert compared >= 10 * 64 * 0.9
    print(f"greedy: {compared} tokens compared, smallest margin {smallest:.3g}, largest drift {drift:.3g}")


@pytest.mark.slow
def test_e_cache_is_bit_identical_to_recompute(ours, hf_tok):
    ids = hf_tok(PROMPTS[3] + PROMPTS[5])["input_ids"]
    full = ours.logits(ids)
    session = ours.new_session()
    for i, t in enumerate(ids):
        assert np.array_equal(session.step(t), full[i]), f"position {i}"
    one = Model.from_pretrained(ours.path, n_ctx=512, threads=1)
    assert np.array_equal(one.logits(ids), full), "1 and 2 threads differ"


def test_peak_memory_of_fp32_generation(smollm2_dir):
    """Peak RSS <= fp32 weights + KV cache + 150 MB (weights are mapped, not copied)."""
    # A forked child starts with its parent's high-water mark (this test
    # process holds two models): reset it, then read the peak from /proc.
    code = f"""
import json, sys
open("/proc/self/clear_refs", "w").write("5")
from fastllm import Model
m = Model.from_pretrained({str(smollm2_dir)!r}, n_ctx=2048, threads=2)
m.generate("Tell me a story about a robot.", max_new_tokens=32)
kv = 2 * m.config.num_hidden_layers * m.n_ctx * m.config.num_key_value_heads * m.config.head_dim * 4
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({{"rss": int(hwm) * 1024,
                  "weights": m.config.n_params() * 4, "kv": kv}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    budget = r["weights"] + r["kv"] + 150 * 2**20
    print(f"peak RSS {r['rss'] / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")
    assert r["rss"] <= budget


@pytest.mark.slow
@pytest.mark.parametrize("path", ["avx512_bf16", "amx_bf16"])
def test_bf16_dot_product_path_within_its_stated_tolerance(path, smollm2_dir, hf_tok, simd_path):
    """FASTLLM_SIMD=avx512_bf16 (AVX512_BF16 dot products) and amx_bf16 (AMX
    tiles) multiply bf16 weights by bf16-rounded activations, as llama.cpp's
    BF16 path does: 8 significant bits per matmul input. Stated tolerance
    against a reference with bf16 weights: |err| <= 0.5 + 0.02*|ref| on the
    logits, and greedy tokens identical wherever the reference's margin
    exceeds 0.5. The exact paths keep the 1e-4 bound (test_tiny_models)."""
    import torch
    simd_path(path)
    ours = Model.from_pretrained(smollm2_dir, n_ctx=512, threads=2, dtype="bf16")
    ref = load_hf(smollm2_dir)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    worst = 0.0
    for prompt in PROMPTS[:5]:
        ids = hf_tok(prompt)["input_ids"]
        want_logits = hf_logits(ref, ids)
        ok, err, ratio = within(ours.logits(ids), want_logits, atol=0.5, rtol=0.02)
        worst = max(worst, err)
        assert ok, f"{prompt!r}: max |err| {err:.3g}"
        want, margins = hf_greedy(ref, ids, 32)
        got = list(ours.generate_tokens(ids, 32, stop_token_ids=()))
        ok, n, diverged = compare_greedy(got, want, margins, min_margin=0.5)
        assert ok, f"{prompt!r}: token {diverged} differs where the margin is {margins[diverged]:.3g}"
    print(f"{path}: largest logit error {worst:.3g}")
