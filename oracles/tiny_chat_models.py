"""Tiny random chat models with a real Qwen vocabulary and chat template:
the tokenizer of oracles.qwen_tokenizers next to a tiny random checkpoint
of the same vocabulary size, for what needs real chat text (templates,
tool calls, reasoning) more than a sensible model. And one with Ministral
3's control tokens and a template built like its, for Mistral's tool calls."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import qwen_tokenizers as qt
from .tiny_models import SHAPES, _make_qwen35

# kind: (tokenizer kind, tiny shape, vocabulary size of the checkpoint)
CHAT_MODELS = {
    "qwen3": ("qwen3", "qwen3", 151936),
    # Qwen2.5 has Qwen3's vocabulary (the same 151,643 ranks and specials).
    "qwen2.5": ("qwen3", "qwen2-tied", 151936),
    "qwen3.5": ("qwen3.5", "qwen3_5-text", 248320),
}


def make_tiny_chat_model(kind: str, folder, tokenizer_cache, seed: int = 0) -> Path:
    """A folder with a tiny random model of kind and its Qwen tokenizer;
    <|im_end|> ends a reply."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok_kind, shape, vocab = CHAT_MODELS[kind]
    tok_dir = qt.build(tok_kind, tokenizer_cache)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    im_end = next(int(i) for i, t in config["added_tokens_decoder"].items() if t["content"] == "<|im_end|>")
    folder = Path(folder)
    spec = dict(SHAPES[shape], vocab_size=vocab)
    if shape.startswith("qwen3_5"):
        model = _make_qwen35(spec, seed=seed, scale=0.12)
    else:
        model_type = spec.pop("model_type")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, initializer_range=0.2, max_position_embeddings=2048, **spec),
            dtype=torch.float32)
    model.config.eos_token_id = im_end
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    return folder


# A template built the way Ministral 3's instruct template is (written for
# this test: the hub is out of reach here): a default system prompt when the
# conversation has none, system content as text or text/thinking chunks,
# [AVAILABLE_TOOLS] with the tools as JSON, [INST] turns, assistant tool
# calls as [TOOL_CALLS]name[ARGS]arguments, tool results, and a refusal of
# any other role. It leans on what a renderer must do as transformers does:
# tojson of nested dicts (non-ASCII kept), string tests, slicing, namespaces
# and raise_exception.
MINISTRAL3_LIKE_TEMPLATE = r"""
{%- set default_system_message = 'You are a helpful assistant.\nThe current date is {today}.' -%}
{{- bos_token -}}
{%- if messages[0]['role'] == 'system' -%}
    {{- '[SYSTEM_PROMPT]' -}}
    {%- if messages[0]['content'] is string -%}
        {{- messages[0]['content'] -}}
    {%- else -%}
        {%- for block in messages[0]['content'] -%}
            {%- if block['type'] == 'text' -%}{{- block['text'] -}}
            {%- elif block['type'] == 'thinking' -%}{{- '[THINK]' + block['thinking'] + '[/THINK]' -}}
            {%- else -%}{{- raise_exception('Only text and thinking chunks are supported in system messages.') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '[/SYSTEM_PROMPT]' -}}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set loop_messages = messages -%}
    {{- '[SYSTEM_PROMPT]' + default_system_message + '[/SYSTEM_PROMPT]' -}}
{%- endif -%}
{%- if tools is defined and tools is not none and tools | length > 0 -%}
    {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}
{%- endif -%}
{%- set ns = namespace(turn=0) -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'user' -%}
        {{- '[INST]' + message['content'] + '[/INST]' -}}
    {%- elif message['role'] == 'assistant' -%}
        {%- if message['content'] is defined and message['content'] -%}{{- message['content'] -}}{%- endif -%}
        {%- for call in message.get('tool_calls', []) -%}
            {%- set args = call['function']['arguments'] -%}
            {{- '[TOOL_CALLS]' + call['function']['name'] + '[ARGS]' -}}
            {{- args if args is string else args | tojson -}}
        {%- endfor -%}
        {{- eos_token -}}
    {%- elif message['role'] == 'tool' -%}
        {{- '[TOOL_RESULTS]' + message['content'] | string + '[/TOOL_RESULTS]' -}}
    {%- else -%}
        {{- raise_exception('Only user, assistant and tool roles are supported, got ' + message['role'] + '.') -}}
    {%- endif -%}
    {%- set ns.turn = ns.turn + 1 -%}
{%- endfor -%}
"""
MISTRAL_CONTROL_TOKENS = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]",
                          "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                          "[THINK]", "[/THINK]"]


def make_tiny_mistral_chat_model(folder, seed: int = 0) -> Path:
    """A folder with a tiny random Mistral model, a small trained tekken-style
    vocabulary whose control tokens ([TOOL_CALLS], [ARGS], ...) are special,
    and MINISTRAL3_LIKE_TEMPLATE; </s> ends a reply."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from .bpe_gguf_vocabs import trained_family_tokenizer
    folder = Path(folder)
    tok = trained_family_tokenizer("tekken", vocab_size=1200)
    tok.add_special_tokens(MISTRAL_CONTROL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = MINISTRAL3_LIKE_TEMPLATE
    fast.save_pretrained(folder)
    eos = tok.token_to_id("</s>")
    torch.manual_seed(seed)
    config = AutoConfig.for_model("mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=tok.get_vocab_size(),
                                  initializer_range=0.2, max_position_embeddings=2048,
                                  bos_token_id=tok.token_to_id("<s>"), eos_token_id=eos)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder
