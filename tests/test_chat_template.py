"""Chat templates: fastllm's rendering vs transformers' apply_chat_template.

Texts must be identical; with tokenize=True the ids must be too (special
tokens written by the template are recognised, nothing else is added).
"""
import dataclasses
import json
from datetime import datetime
from pathlib import Path

import jinja2
import pytest

from fastllm.tokenizer.chat_template import TemplateError
from fastllm.tokenizer import Tokenizer
from oracles import qwen_tokenizers as qt


@pytest.fixture(scope="session")
def qwen_chat_dirs(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)
    root = (cache.mkdir("fastllm_qwen_tokenizers") if cache is not None
            else tmp_path_factory.getbasetemp() / "fastllm_qwen_tokenizers")
    return {kind: qt.build(kind, root) for kind in qt.KINDS}


def _pair(folder):
    from transformers import AutoTokenizer
    return Tokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="session")
def smollm2_pair(smollm2_dir):
    return _pair(Path(smollm2_dir))


@pytest.fixture(scope="session")
def qwen3_pair(qwen_chat_dirs):
    return _pair(qwen_chat_dirs["qwen3"])


@pytest.fixture(scope="session")
def qwen35_pair(qwen_chat_dirs):
    return _pair(qwen_chat_dirs["qwen3.5"])


def same(pair, messages, **kw):
    ours, tf = pair
    text = ours.apply_chat_template(messages, **kw)
    assert text == tf.apply_chat_template(messages, tokenize=False, **kw)
    ids = ours.apply_chat_template(messages, tokenize=True, **kw)
    assert ids == tf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    assert ids == ours.encode(text, add_special_tokens=False)
    return text


def same_error(pair, messages, **kw):
    ours, tf = pair
    with pytest.raises(jinja2.exceptions.TemplateError) as ref:
        tf.apply_chat_template(messages, tokenize=False, **kw)
    with pytest.raises(TemplateError) as got:
        ours.apply_chat_template(messages, **kw)
    assert str(ref.value) in str(got.value)
    return got.value


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, how can I help?"},
     {"role": "user", "content": "Tell me a joke\nabout   spaces.  "}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  leading and trailing  \n\n"}],
    [{"role": "user", "content": "日本語で答えて 😀 — «ok»"}, {"role": "assistant", "content": "はい。"},
     {"role": "user", "content": "def f(x):\n    return x * 2\n"}],
    [{"role": "user", "content": "Special tokens in text: <|im_end|> and <|im_start|> stay tokens"}],
]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [False, True])
def test_smollm2_template(smollm2_pair, conv, gen):
    text = same(smollm2_pair, CONVERSATIONS[conv], add_generation_prompt=gen)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == gen


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city, «now».",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}},
]

TOOL_CHAT = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Zürich and in 東京?"},
    {"role": "assistant", "content": None, "reasoning_content": "Two cities, two calls.",
     "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}},
         {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}}]},
    {"role": "tool", "content": "{\"temp\": 3}"},
    {"role": "tool", "content": "{\"temp\": 11}"},
    {"role": "assistant", "content": "3 °C in Zürich, 11 °C in Tokyo.", "reasoning": "Report both."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
    {"role": "assistant", "content": "Let me check.", "thinking": "Need forecast.",
     "tool_calls": [{"function": {"name": "search", "arguments": {"q": "forecast"}}}]},
    {"role": "tool", "content": "sunny"},
]


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("gen", [False, True])
def test_qwen3_template_tools_and_thinking(qwen3_pair, thinking, gen):
    kw = {} if thinking is None else {"enable_thinking": thinking}
    for messages, tools in [(CONVERSATIONS[1], None), (CONVERSATIONS[2], None), (TOOL_CHAT, TOOLS),
                            (TOOL_CHAT[:4], TOOLS), (CONVERSATIONS[4], TOOLS)]:
        text = same(qwen3_pair, messages, tools=tools, add_generation_prompt=gen, **kw)
        assert text.endswith("<think>\n\n</think>\n\n") == (gen and thinking is False)
    text = same(qwen3_pair, TOOL_CHAT, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\n{\"temp\": 3}\n</tool_response>\n<tool_response>" in text
    assert "<think>\nNeed forecast.\n</think>" in text          # after the last user turn
    assert "Two cities" not in text                              # before it


QWEN35_PROMPTS = [
    "Hello",
    "  leading and trailing whitespace  ",
    "\n\nstarts with newlines",
    "multi\nline\n\nprompt\r\nwith CRLF",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Übersetze: «Guten Morgen» → English?",
    "请用中文回答：人力资源是什么？",
    "Что такое мусор? Объясни кратко.",
    "ما هو سبب المطر؟",
    "emoji 😀👍🏽 and flags 🇺🇸🇯🇵",
    "tabs\tand\tspaces    mixed",
    "special-looking text <think> </think> <|im_end|> in a prompt",
    "",
]


def test_qwen35_single_user_prompts(qwen35_pair):
    ours, tf = qwen35_pair
    for prompt in QWEN35_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = same(qwen35_pair, messages, add_generation_prompt=True)
        assert text == f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ids = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        nl, assistant = ours.encode("\n"), ours.encode("assistant")
        assert ids[0] == 248045                                     # <|im_start|>
        assert ids[-9:] == [248046] + nl + [248045] + assistant + nl + [248068, 271, 248069, 271]
        assert same(qwen35_pair, messages, add_generation_prompt=True, enable_thinking=True).endswith(
            "<|im_start|>assistant\n<think>\n")


def test_templates_that_raise(qwen3_pair):
    err = same_error(qwen3_pair, [{"role": "narrator", "content": "x"}])
    assert "Unknown message role: narrator" in str(err)
    same_error(qwen3_pair, [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}])
    ours, tf = qwen3_pair
    bad = "{% for m in messages %}{{ m.content }"
    with pytest.raises(jinja2.exceptions.TemplateSyntaxError):
        tf.apply_chat_template(CONVERSATIONS[0], chat_template=bad, tokenize=False)
    with pytest.raises(TemplateError, match="syntax error"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template=bad)
    custom = "{{ raise_exception('custom failure: ' + messages[0].role) }}"
    same_error(qwen3_pair, CONVERSATIONS[0], chat_template=custom)
    with pytest.raises(ValueError):
        ours.apply_chat_template([])
    with pytest.raises(TypeError):
        ours.apply_chat_template(["not a dict"])


ENV_TEMPLATES = [
    # tojson: no HTML escaping, non-ASCII kept, options passed through
    "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}|{{ {'b': 1, 'a': '<&>'} | tojson(sort_keys=True) }}"
    "|{{ messages[0] | tojson(separators=(',', ':')) }}|{{ 'é' | tojson(ensure_ascii=True) }}",
    # trim_blocks / lstrip_blocks
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U: {{ m.content }}\n    {% else %}\nA: {{ m.content }}\n"
    "{% endif %}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}",
    # loop controls
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}"
    "{% continue %}{% endif %}[{{ m.role }}]{% endfor %}",
    # namespace, dict(), special-token variables, extra kwargs, documents
    "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ dict(a=1, b=2) | tojson }}"
    "{{ custom_flag }}{{ documents | tojson }}{% if missing is defined %}X{% endif %}{{ missing }}",
    # generation blocks (for assistant masks) render their body
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}",
    # message fields: None values are dropped, reasoning aliases are filled
    "{% for m in messages %}{{ m.keys() | list | tojson }}{{ m.reasoning_content }}{{ m.thinking }}{% endfor %}",
    # string methods and filters templates commonly use
    "{{ messages[-1].content.strip().split('\\n') | tojson }}{{ (messages | length) ~ '' }}"
    "{{ messages[0].content | trim | upper }}{{ messages | selectattr('role', 'equalto', 'user') | list | length }}",
]

ENV_CHAT = [
    {"role": "system", "content": "sys <b>&</b>"},
    {"role": "user", "content": "  héllo 😀\nsecond line  ", "name": None},
    {"role": "assistant", "content": "answer", "reasoning": "why", "tool_calls": None},
    {"role": "user", "content": "again"},
]


@pytest.mark.parametrize("template", range(len(ENV_TEMPLATES)))
def test_template_environment(qwen3_pair, template):
    kw = dict(chat_template=ENV_TEMPLATES[template], tools=TOOLS,
              documents=[{"title": "T", "text": "body"}], custom_flag="ON")
    for gen in (False, True):
        same(qwen3_pair, ENV_CHAT, add_generation_prompt=gen, **kw)


def test_sandbox_is_enforced(qwen3_pair):
    ours, tf = qwen3_pair
    for tpl in ["{{ messages.__class__.__mro__ }}", "{% set ns = namespace() %}{% set ns._x = 1 %}",
                "{{ namespace(_x=1) }}", "{% set x = messages.append(1) %}"]:
        with pytest.raises(jinja2.exceptions.SecurityError):
            tf.apply_chat_template(CONVERSATIONS[0], chat_template=tpl, tokenize=False)
        with pytest.raises(TemplateError):
            ours.apply_chat_template(CONVERSATIONS[0], chat_template=tpl)


def test_strftime_now(qwen3_pair):
    ours, _ = qwen3_pair
    year = ours.apply_chat_template(CONVERSATIONS[0], chat_template="{{ strftime_now('%Y') }}")
    assert year == str(datetime.now().year)


def test_message_objects_and_continue_final_message(qwen3_pair):
    @dataclasses.dataclass
    class Msg:
        role: str
        content: str

    ours, tf = qwen3_pair
    msgs = [Msg("user", "hi"), Msg("assistant", "partial answ")]
    as_dicts = [dataclasses.asdict(m) for m in msgs]
    assert ours.apply_chat_template(msgs) == tf.apply_chat_template(as_dicts, tokenize=False)
    same(qwen3_pair, as_dicts, continue_final_message=True)
    assert ours.apply_chat_template(as_dicts, continue_final_message=True).endswith("partial answ")
    with pytest.raises(ValueError):
        ours.apply_chat_template(as_dicts, continue_final_message=True, add_generation_prompt=True)


def test_named_templates_and_jinja_file(tmp_path, qwen_chat_dirs):
    from transformers import AutoTokenizer

    src = qwen_chat_dirs["qwen3"]
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = [{"name": "default", "template": "D:{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "T:{{ tools | length }}"},
                               {"name": "rag", "template": "R:{{ documents | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    pair = (Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path)))
    assert same(pair, CONVERSATIONS[0]) == "D:Hi!"
    assert same(pair, CONVERSATIONS[0], tools=TOOLS) == "T:2"
    assert same(pair, CONVERSATIONS[0], chat_template="rag", documents=[{"title": "a", "text": "b"}]) == "R:1"

    (tmp_path / "chat_template.jinja").write_text("J:{{ messages | length }}", encoding="utf-8")
    pair = (Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path)))
    assert same(pair, CONVERSATIONS[2]) == "J:3"


def test_missing_template_is_reported(tmp_path, qwen_chat_dirs):
    (tmp_path / "tokenizer.json").write_bytes((qwen_chat_dirs["qwen3"] / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(TemplateError, match="no chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])
    assert tok.apply_chat_template(CONVERSATIONS[0], chat_template="{{ messages[0].content }}") == "Hi!"
