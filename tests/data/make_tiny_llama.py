"""Write tests/data/tiny-llama: a tiny random llama checkpoint with a byte-level
BPE tokenizer, small enough to ship in the sdist (about 170 KB) and used by
the wheel smoke test (tests/data/smoke.py) and tests/test_packaging.py.

Needs numpy only (not fastllm, not transformers); deterministic, so running it
again rewrites the same bytes:

    python tests/data/make_tiny_llama.py [out_dir]

The weights are random: the text it generates is gibberish, but the same
gibberish every time (greedy decoding).
"""
from __future__ import annotations

import json
import struct
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from fastllm.tokenizer import _bytes_to_unicode  # GPT-2's byte -> character table

SEED = 20260101
EOT = "<|endoftext|>"
N_MERGES = 43          # 256 byte tokens + 43 merges + <|endoftext|> = 300
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256 + N_MERGES + 1,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 256 + N_MERGES,
    "eos_token_id": 256 + N_MERGES,
    "torch_dtype": "bfloat16",
}
# Text the merges are learned from (any fixed text would do).
CORPUS = ("hello world. the quick brown fox jumps over the lazy dog. "
          "hello there, the model says hello to the world and the world says hello back. "
          "there is no other text in the test data; this is the tokenizer corpus.")
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def learn_merges(text: str, n: int, chars: list[str]) -> list[tuple[str, str]]:
    """Plain BPE training on the words of text (space folded into the next word)."""
    words = Counter()
    for i, w in enumerate(text.split(" ")):
        w = (" " if i else "") + w
        words[tuple(chars[b] for b in w.encode("utf-8"))] += 1
    merges = []
    for _ in range(n):
        pairs = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        # most frequent pair, ties broken by the pair itself: deterministic
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append((a, b))
        new = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    if len(merges) != n:
        raise SystemExit(f"corpus too small for {n} merges")
    return merges


def tokenizer_json(chars, merges) -> dict:
    vocab = {c: b for b, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    eot_id = len(vocab)
    assert eot_id == CONFIG["eos_token_id"]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": eot_id, "content": EOT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }


def tokenizer_config() -> dict:
    eot_id = CONFIG["eos_token_id"]
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {str(eot_id): {"content": EOT, "lstrip": False, "normalized": False,
                                               "rstrip": False, "single_word": False, "special": True}},
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": EOT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "tokenizer_class": "GPT2Tokenizer",
    }


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even."""
    u = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def weights() -> dict:
    c = CONFIG
    rng = np.random.default_rng(SEED)
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd

    def mat(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(c["vocab_size"], h, gain=2.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(h)
        t[p + "self_attn.q_proj.weight"] = mat(h, h, 2.0)
        t[p + "self_attn.k_proj.weight"] = mat(kv, h, 2.0)
        t[p + "self_attn.v_proj.weight"] = mat(kv, h)
        t[p + "self_attn.o_proj.weight"] = mat(h, h)
        t[p + "post_attention_layernorm.weight"] = norm(h)
        t[p + "mlp.gate_proj.weight"] = mat(inter, h)
        t[p + "mlp.up_proj.weight"] = mat(inter, h)
        t[p + "mlp.down_proj.weight"] = mat(h, inter)
    t["model.norm.weight"] = norm(h)
    return t


def write_safetensors(path: Path, tensors: dict) -> None:
    """All tensors as BF16, names sorted, 8-byte aligned data section."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        data = to_bf16(tensors[name]).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    head = {"__metadata__": {"format": "pt"}, **header}
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for d in blobs:
            f.write(d)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    chars = _bytes_to_unicode()
    merges = learn_merges(CORPUS, N_MERGES, chars)

    def dump(name, obj):
        (out / name).write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    dump("config.json", CONFIG)
    dump("tokenizer.json", tokenizer_json(chars, merges))
    dump("tokenizer_config.json", tokenizer_config())
    write_safetensors(out / "model.safetensors", weights())
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({total / 1024:.0f} KB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "tiny-llama")
