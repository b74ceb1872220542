"""Ministral 3 (model_type ministral3, and the text model of the mistral3
multimodal wrapper) as switches of the one layer, against transformers:

* YaRN: the slow frequencies interpolated, the fast ones kept, a ramp
  between, and cos/sin scaled by the attention factor (from mscale and
  mscale_all_dim in the wrapper's checkpoint);
* the query of each position scaled by 1 + beta * log(1 + floor(position /
  original context)) (llama_4_scaling_beta);
* the wrapper's sliding window and its lm_head under language_model.

The tiny checkpoints are oracles/tiny_models.py's; their original context
(24 and 20 positions) is far shorter than the prompts, so both YaRN and the
query scaling's steps are reached. The bounds are oracles/hf_reference.py's.
The GGUF files under tests/data/ministral3-gguf are llama.cpp's converter's
output for like shapes, with transformers' logits (make.py there writes both).
The tests every family passes (logits and greedy decoding against
transformers with each switch turned off, splits, batches and threads, the
converter's files, export) are the "ministral3" row of test_conformance.py;
this file keeps what is Ministral 3's own.
"""
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from fastllm import Model
from fastllm.cli.main import main
from fastllm.spec.config import ModelConfig
from fastllm.spec.errors import ModelFileError
from fastllm.formats.gguf import ConversionError
from fastllm.formats.gguf_writer import export_gguf
from oracles.bpe_gguf_vocabs import trained_family_tokenizer
from oracles.hf_reference import hf_logits, load_hf, random_prompt as prompt, within
from oracles.tiny_chat_models import MINISTRAL3_LIKE_TEMPLATE
from oracles.tiny_models import with_config, with_rope


@pytest.fixture(autouse=True)
def _quiet_wrapper_notice():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*mistral3 checkpoint: running its text model")
        warnings.filterwarnings("ignore", message=".*RoPE scaling factor")
        yield


def test_switches_read_from_config(tiny_model_dir):
    text = Model.from_pretrained(tiny_model_dir("ministral3")).config
    assert (text.rope_scaling["rope_type"], text.rope_scaling["factor"]) == ("yarn", 8.0)
    assert text.rope_scaling["attention_factor"] == 1.0   # mscale == mscale_all_dim
    assert (text.query_scale_beta, text.query_scale_period) == (0.6, 24)
    scales = text.query_position_scales(60)
    assert scales[23] == 1 and scales[24] == np.float32(1 + 0.6 * np.log(2)) and scales[59] == scales[48]
    with pytest.warns(UserWarning, match="mistral3 checkpoint: running its text model"):
        wrapped = Model.from_pretrained(tiny_model_dir("mistral3-wrapper")).config
    assert (wrapped.model_type, wrapped.weight_prefix, wrapped.head_prefix) == (
        "ministral3", "language_model.model.", "language_model.")
    assert wrapped.attention_window(0) == 19 and wrapped.tie_word_embeddings
    assert wrapped.rope_scaling["attention_factor"] == pytest.approx((0.13 * np.log(4) + 1) / (0.07 * np.log(4) + 1))


def test_yarn_frequencies_are_transformers_own():
    """inv_freq and the attention factor of YaRN against transformers'
    _compute_yarn_parameters, over factors, betas, mscales and truncation
    (the ramp's ends move whole frequencies, far beyond the tolerance)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for changes in (dict(), dict(factor=40.0, beta_fast=8.0, beta_slow=2.0), dict(mscale=0.8, mscale_all_dim=1.5),
                    dict(truncate=False), dict(attention_factor=0.9), dict(original_max_position_embeddings=None)):
        params = dict(type="yarn", rope_theta=50000.0, factor=16.0, original_max_position_embeddings=64,
                      llama_4_scaling_beta=0.1)
        params.update(changes)
        params = {k: v for k, v in params.items() if v is not None}
        raw = dict(model_type="ministral3", hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=40,
                   max_position_embeddings=4096, rope_parameters=params)
        ours = ModelConfig.from_dict(raw)
        theirs = AutoConfig.for_model(**raw)
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
        # float32 powers: numpy's and torch's differ in the last bit
        np.testing.assert_allclose(ours.rope_inv_freq(100), inv_freq.numpy(), rtol=1e-6, err_msg=str(changes))
        assert ours.rope_scaling["attention_factor"] == pytest.approx(factor, rel=1e-12), changes


def test_keys_left_out_take_transformers_defaults():
    from transformers import AutoConfig
    ours = ModelConfig.from_dict({"model_type": "ministral3"})
    theirs = AutoConfig.for_model("ministral3")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "sliding_window", "bos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    params = theirs.rope_parameters
    assert (ours.rope_theta, ours.rope_scaling["factor"]) == (params["rope_theta"], params["factor"])
    assert (ours.query_scale_beta, ours.query_scale_period) == (
        params["llama_4_scaling_beta"], params["original_max_position_embeddings"])


def test_a_mistral_text_model_in_the_wrapper_runs_as_mistral():
    """Mistral Small 3.x ships as the mistral3 wrapper around a mistral text model."""
    raw = dict(model_type="mistral3", text_config=dict(
        model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, rope_theta=1e9))
    with pytest.warns(UserWarning, match="vision tower"):
        cfg = ModelConfig.from_dict(raw)
    assert (cfg.model_type, cfg.query_scale_beta, cfg.rope_scaling) == ("mistral", 0.0, None)


def test_the_wrapper_window_matters(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("mistral3-wrapper")
    ids = prompt(256, 60, seed=2)
    got = Model.from_pretrained(folder, threads=2).logits(ids)
    text = json.loads((folder / "config.json").read_text())["text_config"]
    plain = load_hf(with_config(folder, tmp_path / "nowindow", text_config=dict(text, sliding_window=None)))
    assert not within(got, hf_logits(plain, ids))[0]


@pytest.mark.parametrize("changes, message", [
    (dict(beta_fast=-1.0), "rope_scaling 'beta_fast' must be a positive number for yarn scaling"),
    (dict(factor="8"), "rope_scaling 'factor' must be a positive number for yarn scaling"),
    (dict(factor=None), "rope_scaling 'factor' must be a positive number for yarn scaling"),
    (dict(truncate="no"), "rope_scaling 'truncate' must be true or false"),
    (dict(llama_4_scaling_beta="0.1"), "llama_4_scaling_beta must be a number >= 0"),
    (dict(original_max_position_embeddings=0), "original_max_position_embeddings' must be a positive integer"),
])
def test_bad_settings_are_refused(changes, message, tiny_model_dir, tmp_path):
    with pytest.raises(ModelFileError, match=message):
        Model.from_pretrained(with_rope(tiny_model_dir("ministral3"), tmp_path / "bad", **changes))


# ------------------------------------------------------------------ GGUF

DATA = Path(__file__).parent / "data" / "ministral3-gguf"


def test_gguf_switches_are_llama_cpps(fastllm_home):
    """YaRN from rope.scaling.*, the attention factor from
    yarn_log_multiplier alone, the query scaling from
    attention.temperature_scale over the original context."""
    cfg = Model.from_pretrained(DATA / "mistral3-wrapper.gguf").config
    assert cfg.model_type == "ministral3" and cfg.sliding_window is None
    scaling = cfg.rope_scaling
    assert (scaling["rope_type"], scaling["factor"], scaling["original_max_position_embeddings"]) == ("yarn", 4.0, 20)
    assert (scaling["beta_fast"], scaling["beta_slow"], scaling["truncate"]) == (16.0, 1.0, True)
    assert scaling["attention_factor"] == pytest.approx((0.1 * np.log(4) + 1) / (0.07 * np.log(4) + 1))
    assert (cfg.query_scale_beta, cfg.query_scale_period) == (0.4, 20)


MISTRAL3_MD = {"general.architecture": "mistral3", "mistral3.block_count": 1, "mistral3.context_length": 64,
               "mistral3.embedding_length": 8, "mistral3.feed_forward_length": 16,
               "mistral3.attention.head_count": 2, "mistral3.attention.layer_norm_rms_epsilon": 1e-5,
               "mistral3.rope.freq_base": 1e9}


def config_of_metadata(**md):
    from fastllm.formats.gguf_config import model_config
    shapes = {"token_embd.weight": (32, 8), "blk.0.attn_q.weight": (8, 8)}
    return ModelConfig.from_dict(model_config(dict(MISTRAL3_MD, **md), shapes, Path("x.gguf"), "f32"))


def test_a_mistral3_gguf_without_yarn_is_plain_rope():
    """llama.cpp's mistral3 files of Mistral Small 3.x carry no rope
    scaling: transformers' YaRN default for ministral3 must not creep in."""
    cfg = config_of_metadata()
    assert (cfg.rope_scaling, cfg.rope_theta, cfg.query_scale_beta) == (None, 1e9, 0.0)


def test_gguf_yarn_attention_factor_is_llama_cpps():
    """llama.cpp multiplies its derived attention factor by
    rope.scaling.attn_factor, and reads neither yarn_attn_factor nor
    yarn_ext_factor."""
    yarn = {"mistral3.rope.scaling.type": "yarn", "mistral3.rope.scaling.factor": 16.0,
            "mistral3.rope.scaling.original_context_length": 16}
    derived = 0.1 * np.log(16) + 1
    plain = config_of_metadata(**yarn, **{"mistral3.rope.scaling.yarn_attn_factor": 0.5,
                                          "mistral3.rope.scaling.yarn_ext_factor": 0.5})
    assert plain.rope_scaling["attention_factor"] == pytest.approx(derived)
    scaled = config_of_metadata(**yarn, **{"mistral3.rope.scaling.attn_factor": 1.25})
    assert scaled.rope_scaling["attention_factor"] == pytest.approx(derived * 1.25)


@pytest.mark.parametrize("changes", [dict(mscale=1.3, mscale_all_dim=0.7), dict(attention_factor=0.9),
                                     dict(mscale=0.8)])
def test_export_carries_transformers_attention_factor(changes, tiny_model_dir, tmp_path, fastllm_home):
    """An attention factor llama.cpp would not derive (mscale apart from 1,
    or given outright) travels as rope.scaling.attn_factor, which llama.cpp
    multiplies in: the file reads back with transformers' factor."""
    folder = with_rope(tiny_model_dir("ministral3"), tmp_path / "x", **changes)
    tok = trained_family_tokenizer("tekken", vocab_size=299)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    out = export_gguf(folder, tmp_path / "x.gguf", "f32")
    want = Model.from_pretrained(folder).config.rope_scaling["attention_factor"]
    got = Model.from_pretrained(out).config.rope_scaling["attention_factor"]
    assert got == pytest.approx(want, rel=1e-6) and abs(want - 1) > 0.01


@pytest.mark.parametrize("changes, message", [
    (dict(truncate=False), "YaRN without truncation"),
    (dict(rope_type="default", type="default"), "a query scaling .* without YaRN"),
])
def test_export_refuses_what_llama_cpp_would_run_otherwise(changes, message, tiny_model_dir, tmp_path):
    folder = with_rope(tiny_model_dir("ministral3"), tmp_path / "x", **changes)
    with pytest.raises(ConversionError, match=message):
        export_gguf(folder, tmp_path / "x.gguf", "f32")


def test_query_scaling_without_yarn_matches_transformers(tiny_model_dir, tmp_path):
    folder = with_rope(tiny_model_dir("ministral3"), tmp_path / "plain", rope_type="default", type="default")
    ours = Model.from_pretrained(folder, threads=2)
    assert ours.config.rope_scaling is None and ours.config.query_scale_beta == 0.6
    ids = prompt(300, 60, seed=3)
    ok, err, _ = within(ours.logits(ids), hf_logits(load_hf(folder), ids))
    assert ok, f"max |err| {err:.3g}"


def test_info_shows_the_switches(tiny_model_dir, capsys):
    assert main(["info", "--model", str(tiny_model_dir("ministral3")), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"query scaling +1 \+ 0\.6 \* log\(1 \+ floor\(position / 24\)\)\n", out)
    assert "'rope_type': 'yarn'" in out


@pytest.mark.parametrize("top", [None, False, True])
def test_a_wrapper_config_reads_as_transformers_reads_it(top):
    """Ministral 3's published layout: the text model's keys in text_config,
    the tying decided by the wrapper's own tie_word_embeddings (true when
    left out), whatever text_config says."""
    from transformers import Mistral3Config
    text = dict(model_type="ministral3", hidden_size=3072, intermediate_size=9216, num_hidden_layers=26,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                vocab_size=131072, tie_word_embeddings=not top,
                rope_parameters=dict(type="yarn", rope_type="yarn", rope_theta=1e6, factor=16.0,
                                     original_max_position_embeddings=16384, beta_fast=32.0, beta_slow=1.0,
                                     mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))
    raw = dict(model_type="mistral3", text_config=text, vision_config={"model_type": "pixtral"},
               **({} if top is None else {"tie_word_embeddings": top}))
    with pytest.warns(UserWarning, match="vision tower"):
        ours = ModelConfig.from_dict(raw)
    theirs = Mistral3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    t = theirs.text_config
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "sliding_window", "vocab_size"):
        assert getattr(ours, key) == getattr(t, key), key
    assert (ours.rope_scaling["factor"], ours.query_scale_beta, ours.query_scale_period) == (
        t.rope_parameters["factor"], t.rope_parameters["llama_4_scaling_beta"],
        t.rope_parameters["original_max_position_embeddings"])


# ------------------------------------------------------------ chat template

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Météo d'une ville",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"role": "assistant", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
MINISTRAL_CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}],
    [{"role": "system", "content": [{"type": "text", "text": "Think first. "},
                                    {"type": "thinking", "thinking": "plan, then answer"}]},
     {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": "Weather in Zürich and Paris?"}, CALL,
     {"role": "tool", "content": "12°C"}, {"role": "tool", "content": 15}],
    [{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": "x"}, {"role": "moderator", "content": "y"}],
]


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
@pytest.mark.parametrize("messages", MINISTRAL_CHATS)
def test_chat_template_renders_as_transformers(messages, tools):
    from tokenizers import Tokenizer, models
    from fastllm.tokenizer.chat_template import TemplateError, render_chat
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token="<s>", eos_token="</s>")
    tok.chat_template = MINISTRAL3_LIKE_TEMPLATE
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    try:
        want = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception as e:   # transformers' TemplateError: ours must refuse alike
        with pytest.raises(TemplateError, match=re.escape(str(e))):
            render_chat(MINISTRAL3_LIKE_TEMPLATE, messages, tools=tools, special_tokens_map=specials)
        return
    got = render_chat(MINISTRAL3_LIKE_TEMPLATE, messages, tools=tools, special_tokens_map=specials)
    assert got == want
    assert got.startswith("<s>[SYSTEM_PROMPT]")
