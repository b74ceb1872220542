"""Sliding-window attention (Mistral, Qwen2/Qwen3's use_sliding_window)
against transformers, and its results however a prompt is split or batched.

Windows are far shorter than the prompts (5, 6, 17 and 19 positions against
40 and 45 tokens), so most queries see only part of what came before. The
bounds are those of test_tiny_models.py (oracles/hf_reference.py). The
tests every family passes (logits and greedy decoding against transformers,
and without the window, past it; splits and batches) are the
"sliding-window" row of test_conformance.py; this file keeps what is the
windows' own.
"""
import re

import numpy as np
import pytest

from fastllm import Model
from fastllm.cli.main import main
from fastllm.spec.errors import ModelFileError
from oracles.hf_reference import hf_logits, load_hf, random_prompt as prompt, within
from oracles.tiny_models import with_config
from fastllm import generate_tokens_batch

KINDS = ["mistral-swa", "mistral-headdim", "qwen2-swa", "qwen3-swa"]
WINDOWS = {"mistral-swa": [5, 5], "mistral-headdim": [19, 19], "qwen2-swa": [0, 6, 6], "qwen3-swa": [0, 17]}


def edited(folder, tmp_path, **changes):
    """A copy of a checkpoint whose config.json has changes (None deletes a key)."""
    return with_config(folder, tmp_path / f"edited-{len(list(tmp_path.iterdir()))}", **changes)


@pytest.mark.parametrize("kind", KINDS)
def test_layers_slide_as_transformers_says(kind, tiny_model_dir, capsys):
    config = Model.from_pretrained(tiny_model_dir(kind)).config
    windows = WINDOWS[kind]
    assert [config.attention_window(i) for i in range(config.num_hidden_layers)] == windows
    assert main(["info", "--model", str(tiny_model_dir(kind)), "--threads", "1"]) == 0
    sliding = sum(w > 0 for w in windows)
    shown = f"sliding window +{max(windows)} positions, in {sliding} of {len(windows)} layers\n"
    assert re.search(shown, capsys.readouterr().out)


@pytest.mark.parametrize("path", ["generic", "avx2", "avx512"])
def test_long_prompts_in_rings_and_key_blocks_match_transformers(path, tiny_model_dir, simd_path):
    """600 tokens through Qwen2's whole-context layer (its keys in three
    blocks of the online softmax) and its sliding layers held in rings (a
    window of 6 and passes of 16: 256 slots): within the bound of float64
    transformers at every position, and the same bits as caches that hold
    every position, run token by token, or beside another sequence."""
    from fastllm.generate.session import extend_together
    simd_path(path)
    folder = tiny_model_dir("qwen2-swa")
    ringed = Model.from_pretrained(folder, threads=2, n_ctx=640, max_batch=16)
    ids = prompt(ringed.config.vocab_size, 600, seed=7)
    got = ringed.logits(ids)
    ok, err, ratio = within(got, hf_logits(load_hf(folder), ids))
    assert ok, f"{path}: max |err| {err:.3g} exceeds the bound"
    whole = Model.from_pretrained(folder, threads=2, n_ctx=640, max_batch=640)
    layer = whole.new_session()._state.kv_bytes(600) // 3   # 608 positions of keys and values
    assert ringed.new_session()._state.kv_bytes(600) == layer + 2 * layer * 256 // 608
    assert np.array_equal(whole.logits(ids), got)
    step = Model.from_pretrained(folder, threads=1, n_ctx=640, max_batch=1).new_session()
    step.prefill(ids[:500])
    for i in range(500, 600):
        assert np.array_equal(step.step(ids[i]), got[i]), f"token by token: position {i}"
    a, b = ringed.new_session(), ringed.new_session()
    a.prefill(ids[:590])
    b.prefill(ids[:300])
    together = extend_together([a, b], [ids[590:591], ids[300:309]])
    assert np.array_equal(together[0], got[590]) and np.array_equal(together[1], got[308])


@pytest.mark.parametrize("kind", ["mistral-swa", "qwen2-swa"])
def test_batched_generation_equals_each_prompt_alone(kind, tiny_model_dir):
    """The server's continuous batching (BatchEngine): prompts of different
    lengths, some longer than the window, decoded together."""
    model = Model.from_pretrained(tiny_model_dir(kind), threads=2)
    prompts = [prompt(model.config.vocab_size, n, seed=n) for n in (3, 17, 40)]
    together = generate_tokens_batch(model, prompts, 24, stop_token_ids=())
    for p, got in zip(prompts, together):
        assert got == list(model.generate_tokens(p, 24, stop_token_ids=()))


def test_max_window_layers_sets_the_sliding_layers_without_layer_types(tiny_model_dir, tmp_path):
    """Configs written before transformers saved layer_types (Qwen2.5's own)
    say it with max_window_layers: the layers from there on slide."""
    folder = tiny_model_dir("qwen2-swa")
    ids = prompt(300, 40, seed=4)
    want = Model.from_pretrained(folder).logits(ids)
    bare = edited(folder, tmp_path, layer_types=None)
    model = Model.from_pretrained(bare)
    assert [model.config.attention_window(i) for i in range(3)] == [0, 6, 6]
    assert np.array_equal(model.logits(ids), want)
    # The default of transformers' Qwen2Config: 28, past these three layers.
    config = Model.from_pretrained(edited(bare, tmp_path, max_window_layers=None)).config
    assert [config.attention_window(i) for i in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("changes", [
    dict(use_sliding_window=False, layer_types=["full_attention"] * 3),   # as transformers saves it
    dict(use_sliding_window=False, layer_types=None),    # Qwen2.5's own configs: a window, switched off
    dict(use_sliding_window=None, layer_types=None),
])
def test_qwen_windows_need_use_sliding_window(changes, tiny_model_dir, tmp_path):
    config = Model.from_pretrained(edited(tiny_model_dir("qwen2-swa"), tmp_path, **changes)).config
    assert [config.attention_window(i) for i in range(3)] == [0, 0, 0]


def test_mistral_without_a_window_attends_to_everything(tiny_model_dir, tmp_path):
    """Mistral 7B v0.2 and later: sliding_window null."""
    folder = edited(tiny_model_dir("mistral-swa"), tmp_path, sliding_window=None)
    ours = Model.from_pretrained(folder, threads=2)
    assert [ours.config.attention_window(i) for i in range(2)] == [0, 0]
    ids = prompt(300, 40, seed=5)
    ok, err, _ = within(ours.logits(ids), hf_logits(load_hf(folder), ids))
    assert ok, f"max err {err:.3g}"


@pytest.mark.parametrize("kind, changes, message", [
    ("mistral-swa", dict(sliding_window=0), "sliding_window must be a positive integer or null"),
    ("mistral-swa", dict(sliding_window="4096"), "sliding_window must be a positive integer"),
    ("qwen2-swa", dict(sliding_window=-3), "sliding_window must be a positive integer"),
    ("qwen2-swa", dict(use_sliding_window="yes"), "use_sliding_window must be true or false"),
    ("qwen2-swa", dict(layer_types=["sliding_attention"] * 2), "layer_types must list"),
    ("qwen2-swa", dict(layer_types=["full_attention", "local", "full_attention"]), "layer_types must list"),
    ("qwen3-swa", dict(use_sliding_window=False), "no sliding_window is in use"),
    ("qwen2-swa", dict(layer_types=None, max_window_layers=-1), "max_window_layers must be"),
    ("qwen2-swa", dict(layer_types=None, max_window_layers=1.5), "max_window_layers must be"),
])
def test_bad_window_settings_are_refused(kind, changes, message, tiny_model_dir, tmp_path):
    with pytest.raises(ModelFileError, match=message):
        Model.from_pretrained(edited(tiny_model_dir(kind), tmp_path, **changes))


def test_qwen2_moe_is_refused_clearly(tiny_model_dir, tmp_path):
    folder = edited(tiny_model_dir("mistral-swa"), tmp_path, model_type="qwen2_moe",
                    architectures=["Qwen2MoeForCausalLM"], num_experts=8, num_experts_per_tok=2)
    with pytest.raises(ModelFileError, match="Qwen2-MoE .* is not supported"):
        Model.from_pretrained(folder)
