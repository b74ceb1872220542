"""Tiny random checkpoints of every supported family against transformers.

The reference runs in float64 (oracles/hf_reference.py says why).
Bounds: |got - ref| <= 1e-4 + 1e-4*|ref| on logits at every position; greedy
tokens identical wherever the reference's top-1/top-2 margin exceeds 1e-3;
cached decoding bit-identical to full recompute.
"""
import numpy as np
import pytest

from fastllm import Model
from oracles.hf_reference import compare_greedy, hf_greedy, hf_logits, hf_layer_outputs, load_hf, within
from oracles.tiny_models import SHAPES

# Dynamic NTK scaling depends on how the reference is called; it has its own test.
KINDS = sorted(k for k in SHAPES if k != "llama-dynamic-rope")


def sequences(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in (1, 7, 33, 70)]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, tiny_model_dir):
    folder = tiny_model_dir(kind)
    ours = Model.from_pretrained(folder, threads=2)
    ref = load_hf(folder)
    worst, margins, spread = 0.0, [], []
    for ids in sequences(ours.config.vocab_size):
        want = hf_logits(ref, ids)
        ok, err, ratio = within(ours.logits(ids), want)
        worst = max(worst, ratio)
        assert ok, f"{kind}: max |err| {err:.3g} exceeds the bound (worst ratio {ratio:.2f})"
        top2 = np.sort(want, axis=1)[:, -2:]
        margins += list(top2[:, 1] - top2[:, 0])
        spread += list(want.std(axis=1))
    # Flat logits would let a wrong model pass: insist on real spread.
    assert np.median(spread) > 0.5 and np.median(margins) > 1e-2, "logits are flat"
    print(f"{kind}: worst err/bound {worst:.3f}, median margin {np.median(margins):.3g}")


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2", "qwen3", "qwen3_5-text"])
def test_layer_outputs_match_transformers(kind, tiny_model_dir):
    folder = tiny_model_dir(kind)
    ours = Model.from_pretrained(folder, threads=2)
    ids = sequences(ours.config.vocab_size, seed=1)[2]
    _, layers = ours.new_session().logits(ids, hidden_states=True)
    want = hf_layer_outputs(load_hf(folder), ids)
    # The last layer's output is compared before the final norm, as HF's hook sees it.
    ok, err, _ = within(layers, want)
    assert ok, f"layer outputs differ by up to {err:.3g}"


# LongRoPE changes every position's rotation when the sequence outgrows the
# original context; hf_greedy's cached loop does not (transformers' generate()
# does, by recomputing): test_phi3 compares it so.
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "phi3-longrope"])
def test_greedy_matches_transformers(kind, tiny_model_dir):
    folder = tiny_model_dir(kind)
    ours = Model.from_pretrained(folder, threads=2)
    ref = load_hf(folder)
    smallest = np.inf
    for ids in sequences(ours.config.vocab_size, seed=2)[1:3]:
        want, margins = hf_greedy(ref, ids, 32)
        got = list(ours.generate_tokens(ids, 32, stop_token_ids=()))
        ok, compared, diverged = compare_greedy(got, want, margins)
        assert ok, f"{kind}: token {diverged} differs with margin {margins[diverged]:.3g}"
        smallest = min(smallest, min(margins[:compared or 1]))
    print(f"{kind}: smallest margin compared {smallest:.3g}")


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-headdim-bias", "qwen3", "qwen3_5-text",
                                  "qwen3_5-interval"])
def test_cached_decoding_is_bit_identical_to_recompute(kind, tiny_model_dir):
    folder = tiny_model_dir(kind)
    ids = sequences(300, seed=3)[3][:50]
    ids = [i % 200 for i in ids]  # every tiny vocabulary has at least 200 tokens
    full = Model.from_pretrained(folder, threads=2).logits(ids)
    # Token by token through the cache, and in uneven chunks with a tiny batch.
    step = Model.from_pretrained(folder, threads=1, max_batch=1).new_session()
    for i, t in enumerate(ids):
        assert np.array_equal(step.step(t), full[i]), f"position {i} differs from the full pass"
    chunked = Model.from_pretrained(folder, threads=2, max_batch=3)
    assert np.array_equal(chunked.logits(ids), full)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_do_not_change_results(threads, tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    ids = list(range(5, 60))
    ref = Model.from_pretrained(folder, threads=1).logits(ids)
    assert np.array_equal(Model.from_pretrained(folder, threads=threads).logits(ids), ref)


@pytest.mark.parametrize("path", ["generic", "avx2", "avx512"])
def test_every_simd_path_matches_transformers(path, tiny_model_dir, simd_path):
    simd_path(path)
    for kind in ("llama-headdim-bias", "qwen3_5-text"):
        folder = tiny_model_dir(kind)
        ours = Model.from_pretrained(folder, threads=2)
        ids = sequences(ours.config.vocab_size, seed=4)[3][:60]
        ok, err, _ = within(ours.logits(ids), hf_logits(load_hf(folder), ids))
        assert ok, f"{path} {kind}: max err {err:.3g}"
        # One token at a time must equal the batched pass on every path.
        step = Model.from_pretrained(folder, threads=1).new_session()
        full = ours.logits(ids)
        for i, t in enumerate(ids[:12]):
            assert np.array_equal(step.extend([t]), full[i])


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "qwen3_5-text"])
def test_bf16_weights_match_a_bf16_weight_reference(kind, tiny_model_dir):
    """bf16 weights are widened to fp32 exactly, so against a reference whose
    weights were rounded to bf16 (computing in fp32) the fp32 bound holds."""
    import torch
    folder = tiny_model_dir(kind)
    ours = Model.from_pretrained(folder, threads=2, dtype="bf16")
    ref = load_hf(folder)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:  # matrices and embeddings: the tensors fastllm stores in bf16
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    for ids in sequences(ours.config.vocab_size, seed=5)[1:]:
        ok, err, _ = within(ours.logits(ids), hf_logits(ref, ids))
        assert ok, f"bf16 {kind}: max err {err:.3g}"


def test_bf16_checkpoint_loads_in_both_dtypes(tiny_model_dir):
    folder = tiny_model_dir("qwen2", dtype="bf16")
    ids = list(range(1, 40))
    want = hf_logits(load_hf(folder), ids)  # bf16 weights upcast exactly
    for dtype in ("f32", "bf16"):
        ok, err, _ = within(Model.from_pretrained(folder, dtype=dtype).logits(ids), want)
        assert ok, f"{dtype}: max err {err:.3g}"


def test_qwen3_5_prompt_in_chunks_equals_token_by_token(tiny_model_dir):
    """The recurrent state carries across calls: a prompt split into uneven
    calls gives exactly the logits of one call, and a fresh start (pos 0)
    forgets the previous sequence."""
    folder = tiny_model_dir("qwen3_5-wrapper")
    ids = np.array(sequences(256, seed=6)[3][:45])
    m = Model.from_pretrained(folder, threads=2)
    full = m.logits(ids)
    session = m.new_session()
    assert not session.can_rewind
    session.extend(ids[:5])  # an unrelated sequence first
    session.reset()
    parts = [session.extend(ids[a:b], all_logits=True) for a, b in ((0, 7), (7, 8), (8, 30), (30, 45))]
    assert np.array_equal(np.concatenate(parts), full)
    assert session.tokens == tuple(ids.tolist())
    with pytest.raises(ValueError, match="reset"):
        session.rewind(3)


def test_qwen3_5_wrapper_says_it_ignores_the_vision_tower(tiny_model_dir):
    with pytest.warns(UserWarning, match="vision"):
        Model.from_pretrained(tiny_model_dir("qwen3_5-wrapper"))


def test_dynamic_rope_matches_token_by_token_decoding(tiny_model_dir):
    """Past max_position_embeddings (48) the reference recomputes the
    frequencies for each new length; decoding one token at a time from a
    one-token prompt, every position is rotated as fastllm rotates it."""
    folder = tiny_model_dir("llama-dynamic-rope")
    ours = Model.from_pretrained(folder, threads=2, n_ctx=128)
    want, margins = hf_greedy(load_hf(folder), [5], 100)
    got = list(ours.generate_tokens([5], 100, stop_token_ids=()))
    ok, compared, diverged = compare_greedy(got, want, margins)
    assert ok, f"token {diverged} differs with margin {margins[diverged]:.3g}"
    assert compared > 60, f"only {compared} tokens compared: the test never left the original context"


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "qwen3_5-text"])
def test_bench_command_runs_for_every_family(kind, tiny_model_dir):
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "fastllm", "bench", "--model", str(tiny_model_dir(kind)),
                          "-p", "16", "-n", "4", "-r", "2", "-t", "1,2", "--dtype", "f32,bf16", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["results"]
    assert {(r["dtype"], r["threads"], r["test"]) for r in rows} == {
        (d, t, test) for d in ("f32", "bf16") for t in (1, 2) for test in ("pp16", "tg4")}
    assert all(r["tokens_per_s_median"] > 0 and len(r["runs"]) == 2 for r in rows)
