"""Gemma 4's dense text model (gemma4_text, and the text model of the
multimodal gemma4 wrapper) as switches of the one layer, against
transformers:

* per-layer inputs (an embedding of each token per layer, mixed with a
  projection of its embedding, gating a residual add in every layer);
* global layers with wider heads, one KV head and values that are their
  keys (attention_k_eq_v), and RoPE over a quarter of the head
  ("proportional");
* the last layers attending to earlier layers' caches
  (num_kv_shared_layers), with an MLP twice as wide (use_double_wide_mlp);
* value norms, layer scalars, x * w norms, softmax scale 1, a final
  soft-cap the random model reaches, a window shorter than the prompts.

The tiny checkpoints are oracles/tiny_models.py's; the bounds are those of
oracles/hf_reference.py. The GGUF files under tests/data/gemma4-gguf are
llama.cpp's converter's and llama-quantize's output (make.py there).
The tests every family passes (logits and greedy decoding against
transformers with each switch turned off, splits, batches and threads, the
converter's file) are the "gemma4" row of test_conformance.py; this file
keeps what is Gemma 4's own.
"""
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.tokenizer.chat_template import render_chat
from fastllm.spec.config import ModelConfig
from fastllm.spec.errors import ModelFileError
from fastllm.formats.gguf import ConversionError, convert_gguf
from fastllm.formats.gguf_writer import export_gguf
from oracles.hf_reference import hf_logits, load_hf, random_prompt as prompt, within
from oracles.tiny_models import with_config

DATA = Path(__file__).parent / "data" / "gemma4-gguf"


@pytest.fixture(autouse=True)
def _quiet_wrapper():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gemma4 checkpoint: running its text model")
        yield


def test_each_layer_has_its_own_sizes(tiny_model_dir):
    cfg = Model.from_pretrained(tiny_model_dir("gemma4-text")).config
    views = cfg.layer_configs()
    assert [v.head_dim for v in views] == [16, 16, 32] * 2
    assert [v.num_key_value_heads for v in views] == [2, 2, 1] * 2
    assert [v.rope_dim for v in views] == [16, 16, 32] * 2   # proportional: the whole head, part of it still
    assert [cfg.kv_layer(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert [v.own_kv for v in views] == [True] * 4 + [False] * 2
    assert [v.values_are_keys for v in views] == [False, False, True] * 2
    assert [v.intermediate_size for v in views] == [96] * 4 + [192] * 2
    assert [cfg.attention_window(i) for i in range(6)] == [7, 7, 0] * 2
    assert (cfg.attention_scale, cfg.norm_plus_one, cfg.final_logit_softcapping) == (1.0, False, 4.0)
    assert cfg.hidden_size_per_layer_input == 16
    inv = views[2].rope_inv_freq(8)
    assert np.count_nonzero(inv) == 4 and inv[0] == 1.0   # a quarter of the 16 pairs rotate
    with pytest.warns(UserWarning, match="gemma4 checkpoint: running its text model"):
        wrapped = ModelConfig.from_file(tiny_model_dir("gemma4-wrapper") / "config.json")
    assert (wrapped.model_type, wrapped.weight_prefix) == ("gemma4_text", "model.language_model.")


def test_keys_left_out_take_transformers_defaults():
    """A config.json of few keys, as published ones are, sized as
    transformers sizes it (global_head_dim and the last layer made global)."""
    from transformers import Gemma4TextConfig
    raw = {"model_type": "gemma4_text", "num_hidden_layers": 8, "num_kv_shared_layers": 2,
           "use_double_wide_mlp": True}
    ours = ModelConfig.from_dict(raw)
    theirs = Gemma4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    theirs.allow_global_per_layer_attribute_access = True   # the sliding layers' sizes
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
                "final_logit_softcapping", "hidden_size_per_layer_input", "layer_types"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert theirs.layer_types[-1] == "full_attention"
    for i in range(8):
        layer = theirs.per_layer_config[i]
        assert (ours.layer_config(i).head_dim, ours.layer_config(i).num_key_value_heads) == (
            layer.head_dim, layer.num_key_value_heads), i
    assert [ours.kv_layer(i) != i for i in range(8)] == [m == "reuse" for m in theirs.kv_sharing_modes]
    full = theirs.rope_parameters["full_attention"]
    assert (ours.rope_theta, ours.rope_scaling) == (full["rope_theta"], {
        k: v for k, v in full.items() if k != "rope_theta"})


def test_the_mixture_of_experts_block_is_refused(tiny_model_dir, tmp_path):
    folder = with_config(tiny_model_dir("gemma4-text"), tmp_path / "moe", enable_moe_block=True, num_experts=4,
                         top_k_experts=2, moe_intermediate_size=32)
    with pytest.raises(ModelFileError, match="enable_moe_block is true: Gemma 4's mixture-of-experts block "
                                             "is not supported yet") as e:
        Model.from_pretrained(folder)
    assert str(folder / "config.json") in str(e.value)


@pytest.mark.parametrize("changes, message", [
    (dict(per_layer_config={"2": {"intermediate_size": 8}}), r"\['intermediate_size'\] are not supported"),
    (dict(per_layer_config={"9": {"head_dim": 32}}), "'9' is not a layer index"),
    (dict(per_layer_config={"2": {"num_key_value_heads": 3}}), "must be a multiple of layer 2's"),
    # a head width of hundreds of millions would size the RoPE tables in gigabytes before any weight is read
    (dict(per_layer_config={"2": {"head_dim": 310000002}}), "head_dim of layer 2 must be .* at most 8192"),
    (dict(num_kv_shared_layers=6), "leaves no layer with a cache of its own"),
    (dict(num_kv_shared_layers=5), "needs an earlier layer of its type"),
    (dict(vocab_size_per_layer_input=100), "vocab_size_per_layer_input must equal vocab_size"),
    (dict(use_bidirectional_attention="all"), "bidirectional attention is not supported"),
    (dict(attention_bias=True), "biases are not supported for gemma4_text"),
])
def test_bad_settings_are_refused(changes, message, tiny_model_dir, tmp_path):
    with pytest.raises(ModelFileError, match=message):
        Model.from_pretrained(with_config(tiny_model_dir("gemma4-text"), tmp_path / "bad", **changes))


# ------------------------------------------------------------------ GGUF


def test_gguf_switches_are_the_folders(fastllm_home):
    cfg = Model.from_pretrained(DATA / "gemma4.gguf").config
    views = cfg.layer_configs()
    assert [(v.head_dim, v.num_key_value_heads, v.intermediate_size) for v in views] == (
        [(16, 2, 96), (32, 1, 96)] * 2 + [(16, 2, 192), (32, 1, 192)])
    assert [cfg.kv_layer(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]   # as llama.cpp shares them
    assert (cfg.attention_k_eq_v, cfg.hidden_size_per_layer_input, cfg.final_logit_softcapping) == (True, 16, 4.0)
    assert views[1].rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25}


def test_q4_k_m_gguf_matches_its_dequantized_folder(tmp_path):
    """llama-quantize's Q4_K_M (Q6_K per-layer embeddings whose blocks span
    several layers' slices, Q4_K and Q5_0 matrices): with fp32 activations
    the file computes what transformers computes on the weights fastllm's
    importer dequantizes."""
    path = DATA / "gemma4-256-Q4_K_M.gguf"
    converted = convert_gguf(path, tmp_path / "wide", dtype="f32", progress=False)
    ids = prompt(2000, 40, seed=7)
    want = hf_logits(load_hf(converted), ids)
    ours = Model.from_pretrained(path, threads=2, activations="f32")
    assert {"q4_k", "q6_k"} <= set(ours.weight_types)
    ok, err, _ = within(ours.logits(ids), want)
    assert ok, f"max err {err:.3g}"


def test_gguf_tokenizer_is_the_converted_folders(tmp_path, fastllm_home):
    """The 'gemma4' BPE vocabulary of the file tokenizes as transformers'
    tokenizer of the folder fastllm converts it to."""
    from transformers import AutoTokenizer
    folder = convert_gguf(DATA / "gemma4.gguf", tmp_path / "g4", progress=False)
    theirs = AutoTokenizer.from_pretrained(folder)
    ours = Model.from_pretrained(DATA / "gemma4.gguf").tokenizer
    for text in ["Hello  world\n\nthe quick brown fox", " ünïcödé 123\n\n\n x", "a\nb \n  c"]:
        assert ours.encode(text) == theirs.encode(text), text


@pytest.mark.parametrize("changes, message", [
    ({"attention.sliding_window_pattern": [True, False, False, True, True, False]},
     "llama.cpp would run them with other layers' caches than transformers"),
    ({"feed_forward_length": [96, 96, 128, 96, 192, 192]}, "differ otherwise than between sliding and global"),
    ({"rope.dimension_count_swa": 8}, "partial RoPE other than the global layers' proportional one"),
])
def test_gguf_metadata_llama_cpp_would_run_otherwise_is_refused(changes, message):
    from fastllm.formats.gguf_config import model_config
    from fastllm.formats.gguf_tensors import read_contents, tensor_shapes
    contents = read_contents(DATA / "gemma4.gguf")
    md = dict(contents.metadata, **{f"gemma4.{k}": v for k, v in changes.items()})
    freqs = np.array([1.0] * 4 + [1e30] * 12, np.float32)
    model_config(contents.metadata, tensor_shapes(contents.tensors), DATA / "gemma4.gguf", "f32", freqs)
    with pytest.raises(ConversionError, match=message):
        model_config(md, tensor_shapes(contents.tensors), DATA / "gemma4.gguf", "f32", freqs)


def test_fastllm_does_not_write_gemma4_gguf(tiny_model_dir, tmp_path):
    with pytest.raises(ConversionError, match="cannot be written to GGUF by fastllm yet"):
        export_gguf(tiny_model_dir("gemma4-text"), tmp_path / "x.gguf", "f32")


# ------------------------------------------------------------ chat template

SYSTEM = {"role": "system", "content": "Answer in French. "}
USER = {"role": "user", "content": "  Hello there\n"}
ANSWER = {"role": "assistant", "content": "Bonjour."}
CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {
    "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
RESULT = {"role": "tool", "name": "get_weather", "content": "sunny"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def gemma4_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    folder = convert_gguf(DATA / "gemma4.gguf", tmp_path_factory.mktemp("g4") / "g4", progress=False)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return AutoTokenizer.from_pretrained(folder), config["chat_template"]


@pytest.mark.parametrize("messages, extra", [
    ([USER], {}), ([SYSTEM, USER, ANSWER, USER], {}), ([USER, ANSWER], {}),
    ([SYSTEM, USER], {"tools": TOOLS}), ([USER, CALL, RESULT], {"tools": TOOLS}),
    ([USER], {"enable_thinking": True}), ([SYSTEM, USER], {"enable_thinking": True}),
])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_renders_as_transformers(messages, extra, add_generation_prompt, gemma4_tokenizer):
    """Gemma 4's template as llama.cpp ships it (system role, tools and
    their calls, the thinking switch), from the file's metadata."""
    tok, template = gemma4_tokenizer
    assert "<|turn>" in template
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    got = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens_map={"bos_token": tok.bos_token, "eos_token": tok.eos_token}, **extra)
    assert got == want
