"""The Llama-family files people download, in miniature, for
tests/test_llama_family_gguf.py.

    python make.py /path/to/llama.cpp

For each family of FAMILIES it writes <name>/, an HF folder as the family
ships it (config.json, generation_config.json, model.safetensors in bf16,
tokenizer.model, tokenizer.json, tokenizer_config.json with the family's
chat template, special_tokens_map.json), and <name>.gguf, that folder
converted by llama.cpp's convert_hf_to_gguf.py to F32. For each family of
QUANTIZED (256 wide: K-quant rows are whole 256-value superblocks) it
writes the GGUF files llama-quantize makes of the F32 conversion, which is
not kept (the tests compare against the folder fastllm dequantizes the
file into). mixtral.gguf is a tiny Mixtral as the converter writes it
(experts inside a llama file), for the refusal.

The weights are random (tiny_models' initialisation, saved in bf16 so that
the folder is half the size; the F32 GGUF holds the same values). The
vocabularies are SentencePiece BPE models with byte fallback trained by
oracles.spm_vocabs on the Lee corpus, converted to tokenizer.json by
transformers' converters in the family's layout: the legacy Llama layout
for Llama 2, TinyLlama and Mistral v0.1/v0.2, the Metaspace one for Mistral
v0.3, whose vocabulary starts with control pieces ([INST], [/INST], tool
markers, [control_N]) as the real one does. Every vocabulary has 2,000
pieces rather than 32,000 to keep the files small.
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles import spm_vocabs  # noqa: E402
from oracles.gguf_maker import (CONVERTER, QUANTIZE, add_spm_tokenizer, convert, quantize,  # noqa: E402
                                tiny_checkpoint, update_tokenizer_config)

VOCAB_SIZE = spm_vocabs.DEFAULT_VOCAB_SIZE
V3_CONTROLS = (["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                "[TOOL_RESULTS]", "[/TOOL_RESULTS]"] + [f"[control_{i}]" for i in range(8, 24)])

# meta-llama/Llama-2-7b-chat-hf
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
# TinyLlama/TinyLlama-1.1B-Chat-v1.0 (Zephyr's)
TINYLLAMA_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")
# mistralai/Mistral-7B-Instruct-v0.1 (and v0.2 as first published)
MISTRAL_V1_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
# mistralai/Mistral-7B-Instruct-v0.3: system prompt on the last user turn, tools.
MISTRAL_V3_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

LLAMA = dict(model_type="llama", hidden_size=16, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB_SIZE, rms_norm_eps=1e-5,
             rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)
MISTRAL = dict(LLAMA, model_type="mistral", num_key_value_heads=1, sliding_window=None, rope_theta=1e6)

# name -> (model shape, tokenizer layout, control pieces, chat template, tokenizer_config extras)
FAMILIES = {
    "llama2": (LLAMA, "llama", (), LLAMA2_TEMPLATE, dict(legacy=True)),
    "tinyllama": (dict(LLAMA, num_key_value_heads=1), "llama", (), TINYLLAMA_TEMPLATE,
                  dict(legacy=False, pad_token="</s>")),
    # v0.1 slides a window of 4096; here of 12, far shorter than the prompts.
    "mistral-v0.1": (dict(MISTRAL, sliding_window=12, rope_theta=10000.0), "llama", (), MISTRAL_V1_TEMPLATE,
                     dict(legacy=True)),
    "mistral-v0.2": (MISTRAL, "llama", (), MISTRAL_V1_TEMPLATE, dict(legacy=True)),
    "mistral-v0.3": (MISTRAL, "llama-nonlegacy", tuple(V3_CONTROLS), MISTRAL_V3_TEMPLATE, dict(legacy=False)),
}
WIDE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4)
QUANTIZED = {"llama2": ("Q4_K_M", "Q8_0"), "mistral-v0.3": ("Q4_K_M",)}
MIXTRAL = dict(LLAMA, model_type="mixtral", num_key_value_heads=1, num_hidden_layers=1,
               num_local_experts=4, num_experts_per_tok=2)


def vocabulary(controls, work: Path) -> Path:
    settings = dict(spm_vocabs.VOCABS["llama-bpe-bf"][0])
    if controls:
        settings["control_symbols"] = list(controls)
    return spm_vocabs.train(vocab_size=VOCAB_SIZE, out_dir=work, **settings)


def model_folder(name: str, shape: dict, folder: Path, seed: int) -> None:
    """A random checkpoint of shape, in bf16, as tiny_models makes them."""
    tiny_checkpoint(name, shape, folder, seed=seed, dtype="bf16")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": shape["bos_token_id"], "eos_token_id": shape["eos_token_id"]}, indent=2))


def tokenizer_files(model: Path, flavor: str, template: str, extras: dict, folder: Path, work: Path) -> None:
    add_spm_tokenizer(folder, model, work, flavor)
    update_tokenizer_config(folder, **extras, chat_template=template, add_bos_token=True, add_eos_token=False,
                            tokenizer_class="LlamaTokenizer")


def make_family(name: str, llama_cpp: Path, work: Path, seed: int) -> None:
    shape, flavor, controls, template, extras = FAMILIES[name]
    model = vocabulary(controls, work)
    folder = HERE / name
    shutil.rmtree(folder, ignore_errors=True)
    model_folder(name, shape, folder, seed)
    tokenizer_files(model, flavor, template, extras, folder, work)
    convert(llama_cpp / CONVERTER, folder, HERE / f"{name}.gguf")
    if name in QUANTIZED:
        wide = work / f"{name}-256"
        model_folder(f"{name}-256", dict(shape, **WIDE), wide, seed)
        tokenizer_files(model, flavor, template, extras, wide, work)
        convert(llama_cpp / CONVERTER, wide, work / f"{name}-256-F32.gguf")
        for qtype in QUANTIZED[name]:
            quantize(llama_cpp / QUANTIZE, work / f"{name}-256-F32.gguf", HERE / f"{name}-256-{qtype}.gguf", qtype)


def make_mixtral(llama_cpp: Path, work: Path) -> None:
    folder = work / "mixtral"
    model_folder("mixtral", MIXTRAL, folder, seed=9)
    tokenizer_files(vocabulary((), work), "llama", MISTRAL_V1_TEMPLATE, {}, folder, work)
    convert(llama_cpp / CONVERTER, folder, HERE / "mixtral.gguf", outtype="q8_0")


def convert_vocabularies(work: Path) -> None:
    """Every vocabulary converted to tokenizer.json before any model is
    built: once transformers has built a model, `from transformers import
    convert_slow_tokenizer` (in spm_vocabs) gives its function of that
    name, not the module."""
    for _, flavor, controls, _, _ in FAMILIES.values():
        spm_vocabs.hf_folder(vocabulary(controls, work), work, flavor)


if __name__ == "__main__":
    llama_cpp = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        convert_vocabularies(Path(tmp))
        for seed, family in enumerate(FAMILIES):
            make_family(family, llama_cpp, Path(tmp), seed)
        make_mixtral(llama_cpp, Path(tmp))
