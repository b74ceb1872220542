"""Gemma 2 and Gemma 3 (text, and the text model of the multimodal wrapper)
as switches of the one layer, against transformers:

* GeLU-tanh MLP, embeddings scaled by sqrt(hidden_size), (1 + w) norms before
  and after each sublayer, query_pre_attn_scalar as the softmax scale;
* attention-score and final-logit soft-caps that the random model exceeds;
* local (sliding-window) layers between global ones, the window shorter
  than the prompts;
* Gemma 3's q/k norms, and the local layers' own RoPE base beside the
  global layers' linearly scaled one.

The tiny checkpoints are oracles/tiny_models.py's (test_tiny_models.py runs
them too); the bounds are those of oracles/hf_reference.py. The GGUF files
under tests/data/gemma-gguf are llama.cpp's converter's output for like
shapes, with transformers' logits on the folder they were made from
(make.py there writes both). The tests every family passes (logits and
greedy decoding against transformers with each switch turned off, splits,
batches and threads, the converter's files, export) are the "gemma" row of
test_conformance.py; this file keeps what is Gemma's own.
"""
import re
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.tokenizer.chat_template import TemplateError, render_chat
from fastllm.cli.main import main
from fastllm.spec.config import ModelConfig
from fastllm.spec.errors import ModelFileError
from fastllm.formats.gguf import ConversionError, convert_gguf
from fastllm.formats.gguf_writer import export_gguf
from oracles.gguf_files import arch_fields_and_tensors
from oracles.hf_reference import hf_logits, load_hf, random_prompt as prompt, within
from oracles.tiny_models import with_config

PATHS = ["generic", "avx2", "avx512"]
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}


def test_switches_read_from_config(tiny_model_dir):
    g2 = Model.from_pretrained(tiny_model_dir("gemma2")).config
    assert (g2.hidden_act, g2.attn_logit_softcapping, g2.final_logit_softcapping) == ("gelu_pytorch_tanh", 3.0, 4.0)
    assert (g2.embedding_multiplier, g2.attention_scale) == (8.0, 20 ** -0.5)
    assert (g2.pre_norms, g2.post_norms, g2.norm_plus_one) == (True, True, True)
    assert [g2.attention_window(i) for i in range(4)] == [5, 0, 5, 0]   # every other layer local
    g3 = Model.from_pretrained(tiny_model_dir("gemma3-text")).config
    assert [g3.attention_window(i) for i in range(5)] == [7, 7, 0, 7, 7]   # sliding_window_pattern 3
    assert [(g3.rope_config(i).rope_theta, g3.rope_config(i).rope_scaling) for i in (0, 2)] == [
        (100.0, None), (10000.0, {"rope_type": "linear", "factor": 4.0})]
    assert g3.qk_norm and g3.final_logit_softcapping is None
    with pytest.warns(UserWarning, match="gemma3 checkpoint: running its text model"):
        wrapped = Model.from_pretrained(tiny_model_dir("gemma3-wrapper")).config
    assert (wrapped.model_type, wrapped.weight_prefix, wrapped.local_rope_theta) == (
        "gemma3_text", "language_model.model.", 1000.0)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_keys_left_out_take_transformers_defaults(model_type):
    """Published Gemma 3 configs (the wrapper's text_config above all) leave
    most sizes to the config class: fastllm fills in what transformers does."""
    from transformers import AutoConfig
    ours = ModelConfig.from_dict({"model_type": model_type})
    theirs = AutoConfig.for_model(model_type)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
                "layer_types", "bos_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.hidden_act == theirs.hidden_activation
    assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5
    params = theirs.rope_parameters
    full = params.get("full_attention", params)
    assert ours.rope_theta == full["rope_theta"]
    if model_type == "gemma3_text":
        assert ours.local_rope_theta == params["sliding_attention"]["rope_theta"]


def test_a_published_gemma3_wrapper_config_reads_as_transformers_reads_it():
    """Gemma 3 4B's config.json as published: a text_config of five keys,
    the rest from Gemma3TextConfig."""
    from transformers import Gemma3Config
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
           "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
           "mm_tokens_per_image": 256, "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    with pytest.warns(UserWarning, match="vision tower"):
        ours = ModelConfig.from_dict(raw)
    theirs = Gemma3Config(**{k: v for k, v in raw.items() if k != "model_type"}).text_config
    assert ([ours.attention_window(i) for i in range(34)]
            == [1024 if t == "sliding_attention" else 0 for t in theirs.layer_types])
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim, ours.vocab_size) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim, theirs.vocab_size)
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours.rope_theta, ours.rope_scaling["factor"], ours.local_rope_theta) == (
        full["rope_theta"], full["factor"], local["rope_theta"])
    assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5
    assert ours.tie_word_embeddings and ours.embedding_multiplier == 2560 ** 0.5


def test_gemma3_config_of_the_older_layout(tiny_model_dir, tmp_path):
    """rope_theta, rope_scaling, rope_local_base_freq and
    sliding_window_pattern, without rope_parameters or layer_types, as
    Gemma 3 was first published, read as transformers reads them."""
    folder = with_config(tiny_model_dir("gemma3-text"), tmp_path / "old", rope_parameters=None, layer_types=None,
                         rope_theta=10000.0, rope_local_base_freq=100.0,
                         rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=3)
    ids = prompt(320, 30, seed=4)
    ours = Model.from_pretrained(folder, threads=2)
    assert [ours.config.attention_window(i) for i in range(5)] == [7, 7, 0, 7, 7]
    ok, err, _ = within(ours.logits(ids), hf_logits(load_hf(folder), ids))
    assert ok, f"max |err| {err:.3g}"


def test_info_shows_the_switches(tiny_model_dir, capsys):
    assert main(["info", "--model", str(tiny_model_dir("gemma3-text")), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"MLP activation +gelu_pytorch_tanh\n", out)
    assert re.search(r"sliding window +7 positions, in 4 of 5 layers\n", out)
    assert re.search(r"sliding layers' RoPE +rope_theta 100.0, rope_scaling None\n", out)


@pytest.mark.parametrize("path", PATHS[1:])
def test_simd_paths_stay_near_the_portable_one(path, tiny_model_dir, simd_path):
    """The GeLU and soft-cap kernels of each path against the portable
    path's, through a whole model whose caps are reached."""
    folder = tiny_model_dir("gemma2")
    ids = prompt(300, 50, seed=5)
    simd_path("generic")
    portable = Model.from_pretrained(folder, threads=2).logits(ids)
    simd_path(path)
    ok, err, _ = within(Model.from_pretrained(folder, threads=2).logits(ids), portable, atol=1e-5, rtol=1e-5)
    assert ok, f"{path}: {err:.3g} from the portable path"


@pytest.mark.parametrize("kind, changes, message", [
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    ("gemma2", dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping must be a positive number or null"),
    ("gemma2", dict(final_logit_softcapping="30"), "final_logit_softcapping must be a positive number or null"),
    ("gemma2", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar must be a positive number"),
    ("gemma2", dict(use_bidirectional_attention=True), "bidirectional attention is not supported"),
    ("gemma2", dict(layer_types=["full_attention"] * 3), "layer_types must list"),
    ("gemma2", dict(sliding_window=0), "sliding_window must be a positive integer"),
    ("gemma3-text", dict(layer_types=None, sliding_window_pattern=0), "sliding_window_pattern must be"),
    ("gemma3-text", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": -1}}),
     "rope_theta of the sliding_attention layers must be a positive number"),
    ("gemma3-text", dict(rope_parameters={"full_attention": {"rope_type": "longrope", "rope_theta": 1e4}}),
     "longrope scaling of the full_attention layers is not supported"),
    ("gemma3-text", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "rope_theta": 1e4}}),
     "rope_scaling 'factor' must be a positive number"),
])
def test_bad_settings_are_refused(kind, changes, message, tiny_model_dir, tmp_path):
    with pytest.raises(ModelFileError, match=message):
        Model.from_pretrained(with_config(tiny_model_dir(kind), tmp_path / "bad", **changes))


# ------------------------------------------------------------ chat templates

# Templates built the way Gemma 2's and Gemma 3's are (written for this
# test: the hub is out of reach here). Neither has a system role: Gemma 2's
# refuses one, Gemma 3's folds it into the first user turn. The assistant
# is "model"; turns must alternate.
GEMMA2_LIKE_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
GEMMA3_LIKE_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
SYSTEM = {"role": "system", "content": "Answer in French. "}
USER = {"role": "user", "content": "  Hello there\n"}
ANSWER = {"role": "assistant", "content": "Bonjour."}
PARTS = {"role": "user", "content": [{"type": "text", "text": " What is it? "}, {"type": "image"}]}


def _transformers_render(template, messages, add_generation_prompt):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token="<bos>")
    tok.chat_template = template
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("template", [GEMMA2_LIKE_TEMPLATE, GEMMA3_LIKE_TEMPLATE])
@pytest.mark.parametrize("messages", [[USER], [USER, ANSWER, USER], [SYSTEM, USER, ANSWER], [SYSTEM, PARTS],
                                      [USER, USER]])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_templates_render_as_transformers(template, messages, add_generation_prompt):
    try:
        want = _transformers_render(template, messages, add_generation_prompt)
    except Exception as e:   # transformers' TemplateError: ours must refuse alike
        with pytest.raises(TemplateError, match=re.escape(str(e))):
            render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                        special_tokens_map={"bos_token": "<bos>"})
        return
    got = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens_map={"bos_token": "<bos>"})
    assert got == want
    if template is GEMMA3_LIKE_TEMPLATE and messages[0] is SYSTEM:
        assert got.startswith("<bos><start_of_turn>user\nAnswer in French. \n\n")


# ------------------------------------------------------------------ GGUF

DATA = Path(__file__).parent / "data" / "gemma-gguf"


def reference(kind):
    data = np.load(DATA / f"{kind}.npz")
    return data["ids"].tolist(), data["logits"]


def test_gguf_switches_are_llama_cpps(fastllm_home):
    """What llama.cpp assumes where the file is silent: Gemma 2 every other
    layer local, Gemma 3 every sixth global, the local layers' RoPE base
    from rope.freq_base_swa, the attention scaled by 1/sqrt(head_dim)."""
    g2 = Model.from_pretrained(DATA / "gemma2.gguf").config
    assert (g2.attention_window(0), g2.attention_window(1), g2.attention_scale) == (5, 0, 24 ** -0.5)
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.hidden_act) == (3.0, 4.0, "gelu_pytorch_tanh")
    g3 = Model.from_pretrained(DATA / "gemma3.gguf").config
    assert [g3.attention_window(i) for i in range(6)] == [7] * 5 + [0]
    assert (g3.local_rope_theta, g3.rope_theta, g3.rope_scaling) == (100.0, 10000.0, {"rope_type": "linear",
                                                                                      "factor": 4.0})
    assert g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None


@pytest.mark.parametrize("kind, changes, message", [
    ("gemma2", dict(query_pre_attn_scalar=20), "an attention scale of 0.223607"),
    ("gemma3-text", dict(attn_logit_softcapping=30.0), "attn_logit_softcapping cannot be written"),
    ("gemma3-text", dict(rope_parameters=dict(GEMMA3_ROPE, sliding_attention={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 100.0})), "rope scaling of the sliding layers"),
])
def test_export_refuses_what_llama_cpp_would_run_otherwise(kind, changes, message, tiny_model_dir, tmp_path):
    folder = with_config(tiny_model_dir(kind), tmp_path / "x", query_pre_attn_scalar=24 if kind == "gemma2"
                         else 32)
    folder = with_config(folder, tmp_path / "y", **changes)
    with pytest.raises(ConversionError, match=message):
        export_gguf(folder, tmp_path / "x.gguf", "f32")


def test_export_writes_a_window_pattern_llama_cpp_would_not_assume(tmp_path, fastllm_home):
    """Gemma 3 with every third layer global (llama.cpp assumes every
    sixth): the pattern is written, and the file runs as the folder does."""
    folder = convert_gguf(DATA / "gemma3.gguf", tmp_path / "g3", progress=False)
    pattern = [True, True, False] * 2
    folder = with_config(folder, tmp_path / "every-third",
                         layer_types=["sliding_attention" if s else "full_attention" for s in pattern])
    out = export_gguf(folder, tmp_path / "g3.gguf", "f32")
    md, _ = arch_fields_and_tensors(out)
    assert md["gemma3.attention.sliding_window_pattern"] == pattern
    ids, _ = reference("gemma3")
    ours = Model.from_pretrained(out, threads=2)
    assert [bool(ours.config.attention_window(i)) for i in range(6)] == pattern
    ok, err, _ = within(ours.logits(ids), Model.from_pretrained(folder, threads=2).logits(ids),
                        atol=1e-6, rtol=1e-6)
    assert ok, f"max |err| {err:.3g}"
