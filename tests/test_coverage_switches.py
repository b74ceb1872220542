"""SmolLM3, Granite, OLMo 2, Seed-OSS and InternLM3: switches of the one layer, against transformers.

* smollm3: layers without RoPE (NoPE) among rotated ones;
* granite: embedding, residual and attention multipliers and the logits'
  divisor, each far from 1;
* olmo2: norms of the attention's and the MLP's outputs instead of their
  inputs, and q/k norms over the whole projection;
* seed_oss: the output projection's bias under a key of its own, a head
  size apart from hidden/heads;
* internlm3: its own names of the bias switches (a family that is one
  module of spec/families/, which reads them).

The tiny checkpoints are oracles/tiny_models.py's (test_tiny_models.py
runs them too). Their logits and greedy decoding against transformers, with
each switch turned off, split, batched and threaded, and the GGUF files
under tests/data/coverage-gguf (llama.cpp's converter's output for the same
shapes, make.py there), are the "coverage" row of test_conformance.py; this
file keeps what is the families' own: their config, refusals and template.
"""
import re

import numpy as np
import pytest

from fastllm import Model
from fastllm.cli.main import main
from fastllm.spec.errors import ModelFileError
from fastllm.formats.gguf import ConversionError
from fastllm.formats.gguf_writer import export_gguf
from oracles.bpe_gguf_vocabs import trained_family_tokenizer
from oracles.tiny_models import with_config


def test_switches_read_from_config(tiny_model_dir):
    nope = Model.from_pretrained(tiny_model_dir("smollm3-nope")).config
    assert [nope.layer_rope(i) for i in range(5)] == [True, False, True, True, False]
    default = Model.from_pretrained(tiny_model_dir("smollm3")).config   # every fourth layer
    assert [default.layer_rope(i) for i in range(4)] == [True, True, True, False]
    granite = Model.from_pretrained(tiny_model_dir("granite")).config
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attention_scale,
            granite.logits_scaling) == (12.0, 0.22, 0.0078125, 2.0)
    olmo = Model.from_pretrained(tiny_model_dir("olmo2")).config
    assert (olmo.pre_norms, olmo.post_norms, olmo.qk_norm_whole) == (False, True, True)
    seed = Model.from_pretrained(tiny_model_dir("seed_oss")).config
    assert (seed.attention_bias, seed.o_bias, seed.mlp_bias, seed.head_dim) == (True, False, False, 24)
    seed = Model.from_pretrained(tiny_model_dir("seed_oss-biases")).config
    assert (seed.attention_bias, seed.o_bias, seed.mlp_bias, seed.head_dim) == (False, True, True, 32)


def test_internlm3_reads_its_published_names_of_the_switches(tiny_model_dir, tmp_path):
    """Its published config.json files say qkv_bias and bias; transformers
    saves attention_bias and mlp_bias. Both are the same model."""
    from transformers import AutoConfig
    saved = tiny_model_dir("internlm3")
    published = with_config(saved, tmp_path / "published", attention_bias=None, mlp_bias=None,
                            qkv_bias=True, bias=True)
    assert (AutoConfig.from_pretrained(published).attention_bias, AutoConfig.from_pretrained(published).mlp_bias) \
        == (True, True)
    ids = list(range(3, 40))
    want = Model.from_pretrained(saved, threads=1)
    got = Model.from_pretrained(published, threads=1)
    assert (got.config.attention_bias, got.config.o_bias, got.config.mlp_bias) == (True, True, True)
    assert np.array_equal(got.logits(ids), want.logits(ids))


@pytest.mark.parametrize("kind, shown", [
    ("smollm3-nope", "layers without RoPE +1, 4\n"),
    ("granite", "multipliers +embedding 12.0, residual 0.22, attention 0.0078125, logits / 2.0\n"),
])
def test_info_shows_the_switches(kind, shown, tiny_model_dir, capsys):
    assert main(["info", "--model", str(tiny_model_dir(kind)), "--threads", "1"]) == 0
    assert re.search(shown, capsys.readouterr().out)


@pytest.mark.parametrize("kind, changes, message", [
    ("smollm3", dict(no_rope_layers=[1, 0, 1]), "no_rope_layers must list 1"),
    ("smollm3", dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers must list 1"),
    ("smollm3", dict(no_rope_layers=None, no_rope_layer_interval=0), "no_rope_layer_interval must be"),
    ("smollm3", dict(use_sliding_window=True, sliding_window=8), "sliding windows are not supported"),
    ("granite", dict(residual_multiplier=0), "residual_multiplier must be a positive number"),
    ("granite", dict(logits_scaling="8"), "logits_scaling must be a positive number"),
    ("granite", dict(attention_multiplier=float("inf")), "attention_multiplier must be"),
    ("internlm3", dict(mlp_bias=False), "must be equal for internlm3"),
    ("internlm3", dict(attention_bias=None, mlp_bias=None, qkv_bias=True, bias="yes"), "mlp_bias must be true or"),
])
def test_bad_switch_settings_are_refused(kind, changes, message, tiny_model_dir, tmp_path):
    with pytest.raises(ModelFileError, match=message):
        Model.from_pretrained(with_config(tiny_model_dir(kind), tmp_path / "bad", **changes))


# ------------------------------------------------------------------ GGUF


def test_export_refuses_nope_layers_llama_cpp_cannot_say(tiny_model_dir, tmp_path):
    with pytest.raises(ConversionError, match="llama.cpp skips RoPE in every 4th layer"):
        export_gguf(tiny_model_dir("smollm3-nope"), tmp_path / "x.gguf", "f32")


def test_internlm3_exports_as_the_llama_gguf_llama_cpp_writes(tiny_model_dir, tmp_path):
    folder = with_config(tiny_model_dir("internlm3"), tmp_path / "internlm3")
    trained_family_tokenizer("gpt-2", 280).save(str(folder / "tokenizer.json"))
    out = export_gguf(folder, tmp_path / "internlm3.gguf", "f32")
    loaded = Model.from_pretrained(out, threads=1)
    assert loaded.config.model_type == "llama"
    ids = list(range(3, 40))
    assert np.array_equal(loaded.logits(ids), Model.from_pretrained(folder, threads=1).logits(ids))


def test_export_refuses_biases_llama_cpp_cannot_load(tiny_model_dir, tmp_path):
    with pytest.raises(ConversionError, match="seed_oss has no bias of the output projection"):
        export_gguf(tiny_model_dir("seed_oss-biases"), tmp_path / "x.gguf", "f32")


# ------------------------------------------------------------ chat template

# A template built the way SmolLM3-3B's is (written for this test: the hub
# is out of reach here): a system header whose reasoning mode comes from
# enable_thinking (true when not passed) unless the system message says
# /think or /no_think, today's date from strftime_now, tools gathered in a
# namespace, {% generation %} around assistant turns, and an empty think
# block before answers in /no_think mode.
SMOLLM3_LIKE_TEMPLATE = """\
{%- if enable_thinking is not defined -%}{%- set enable_thinking = true -%}{%- endif -%}
{%- set mode = "/think" if enable_thinking else "/no_think" -%}
{{- "<|im_start|>system\\n" -}}
{%- if messages[0].role == "system" -%}
  {%- set system_message = messages[0].content -%}
  {%- if "/no_think" in system_message -%}{%- set mode = "/no_think" -%}
  {%- elif "/think" in system_message -%}{%- set mode = "/think" -%}{%- endif -%}
  {%- set custom = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}
{%- endif -%}
{{- "Today Date: " ~ strftime_now("%d %B %Y") ~ "\\nReasoning Mode: " + mode + "\\n\\n" -}}
{%- if custom -%}{{- custom + "\\n\\n" -}}
{%- elif mode == "/think" -%}{{- "Think step by step.\\n\\n" -}}
{%- else -%}{{- "Answer directly.\\n\\n" -}}{%- endif -%}
{%- if xml_tools -%}
  {%- set ns = namespace(text="<tools>\\n") -%}
  {%- for tool in xml_tools[:] -%}{%- set ns.text = ns.text ~ (tool | string) ~ "\\n" -%}{%- endfor -%}
  {{- ns.text + "</tools>\\n" -}}
{%- endif -%}
{{- "<|im_end|>\\n" -}}
{%- for message in messages -%}
  {%- set content = message.content if message.content is string else "" -%}
  {%- if message.role == "user" or message.role == "tool" -%}
    {{ "<|im_start|>user\\n" + content + "<|im_end|>\\n" }}
  {%- elif message.role == "assistant" -%}
    {% generation %}
    {%- set empty = "" if mode == "/think" else "<think>\\n\\n</think>\\n" -%}
    {{ "<|im_start|>assistant\\n" + empty + content.lstrip("\\n") + "<|im_end|>\\n" }}
    {% endgeneration %}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{ "<|im_start|>assistant\\n" + ("" if mode == "/think" else "<think>\\n\\n</think>\\n") }}
{%- endif -%}
"""

USER = {"role": "user", "content": "Hi /think there"}
ANSWER = {"role": "assistant", "content": "\n\nHello."}


@pytest.mark.parametrize("messages, kwargs", [
    ([USER], {}),
    ([USER], {"enable_thinking": False}),
    ([{"role": "system", "content": "Be brief. /no_think"}, USER, ANSWER, USER], {}),
    ([{"role": "system", "content": "Be brief /think  "}, USER, ANSWER], {"enable_thinking": False}),
    ([USER, ANSWER, {"role": "tool", "content": "42"}, {"role": "assistant", "content": None}],
     {"xml_tools": [{"name": "f", "parameters": {}}]}),
])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_reasoning_switch_renders_as_transformers(messages, kwargs, add_generation_prompt):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from fastllm.tokenizer.chat_template import render_chat
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    tok.chat_template = SMOLLM3_LIKE_TEMPLATE
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   **kwargs)
    got = render_chat(SMOLLM3_LIKE_TEMPLATE, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    assert got == want
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    no_think = "/no_think" in system or (kwargs.get("enable_thinking") is False and "/think" not in system)
    assert ("Reasoning Mode: /no_think" in got) == no_think
