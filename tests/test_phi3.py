"""Phi-3/3.5-mini and Phi-4-mini: fused q/k/v and gate/up tensors, partial
rotary, LongRoPE and the sliding window, against transformers in float64
(bounds as in test_tiny_models), as HF folders and as the GGUF files
llama.cpp's converter and quantizer wrote (tests/data/phi3-gguf/make.py).
"""
import json
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.generate.session import extend_together
from oracles.hf_reference import compare_greedy, hf_logits, load_hf, within

DATA = Path(__file__).parent / "data" / "phi3-gguf"
KINDS = ("phi3-longrope", "phi3-swa")
ORIGINAL = 32   # phi3-longrope's original_max_position_embeddings


def tokens(n, vocab=256, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def hf_greedy_recomputed(ref, ids, n_new):
    """Greedy decoding as transformers' generate() does it for Phi-3: the
    whole sequence computed with the factors for its length (generate drops
    its cache when the sequence outgrows the original context)."""
    import torch
    ids, margins = list(ids), []
    with torch.no_grad():
        for _ in range(n_new):
            logits = ref(torch.tensor([ids])).logits[0, -1].double()
            top2 = torch.topk(logits, 2)
            ids.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
    return ids[-n_new:], margins


def test_longrope_factors_follow_the_sequence_length(tiny_model_dir):
    """Up to the original context the short factors rotate every position,
    past it the long ones: a session that grows across it runs its tokens
    again, and then holds exactly what one pass over the whole sequence
    computes; rewound below it, the short factors come back."""
    folder = tiny_model_dir("phi3-longrope")
    m = Model.from_pretrained(folder, threads=2)
    ref = load_hf(folder)
    ids = tokens(70)
    full = m.logits(ids)
    short = m.logits(ids[:20])
    assert within(full, hf_logits(ref, ids))[0] and within(short, hf_logits(ref, ids[:20]))[0]
    # The same 20 tokens, rotated with the long factors inside the longer sequence.
    assert np.abs(full[:20] - short).max() > 1e-2
    s = m.new_session()
    assert np.array_equal(s.extend(ids[:20], all_logits=True), short)
    assert np.array_equal(s.extend(ids[20:ORIGINAL]), m.logits(ids[:ORIGINAL])[-1])  # 32 tokens still fit
    assert np.array_equal(s.extend(ids[ORIGINAL:], all_logits=True), full[ORIGINAL:])
    s.rewind(25)
    assert np.array_equal(s.extend(ids[25:27]), m.logits(ids[:27])[-1])
    # A copied prefix keeps the factors it was computed with until a run says otherwise.
    long = m.new_session()
    long.extend(ids[:50])
    s.copy_prefix(long, 40)
    assert np.array_equal(s.extend(ids[40:45]), full[44])
    s.copy_prefix(long, 10)
    assert np.array_equal(s.extend(ids[10:12]), m.logits(ids[:12])[-1])


def test_greedy_across_the_original_context_matches_transformers(tiny_model_dir):
    folder = tiny_model_dir("phi3-longrope")
    prompt = tokens(20, seed=2)
    want, margins = hf_greedy_recomputed(load_hf(folder), prompt, 24)
    got = list(Model.from_pretrained(folder, threads=2).generate_tokens(prompt, 24, stop_token_ids=()))
    ok, compared, diverged = compare_greedy(got, want, margins)
    assert ok, f"token {diverged} differs with margin {margins[diverged]:.3g}"
    assert compared > ORIGINAL - 20, f"only {compared} tokens compared: never past the original context"


@pytest.mark.parametrize("path", ["generic", "avx2", "avx512"])
def test_every_simd_path_matches_transformers(path, tiny_model_dir, simd_path):
    simd_path(path)
    for kind in KINDS:
        folder = tiny_model_dir(kind)
        ours = Model.from_pretrained(folder, threads=2)
        ids = tokens(60, seed=4)
        full = ours.logits(ids)
        ok, err, _ = within(full, hf_logits(load_hf(folder), ids))
        assert ok, f"{path} {kind}: max err {err:.3g}"
        step = Model.from_pretrained(folder, threads=1).new_session()
        for i, t in enumerate(ids[:12]):
            assert np.array_equal(step.extend([t]), ours.logits(ids[:i + 1])[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_same_bits_for_any_threads_split_or_batch(kind, tiny_model_dir):
    folder = tiny_model_dir(kind)
    ids = tokens(50, seed=5)
    want = Model.from_pretrained(folder, threads=1).logits(ids)
    assert np.array_equal(Model.from_pretrained(folder, threads=3).logits(ids), want)
    assert np.array_equal(Model.from_pretrained(folder, threads=2, max_batch=3).logits(ids), want)
    # A batch of a short sequence and one crossing the original context.
    m = Model.from_pretrained(folder, threads=2)
    a, b = m.new_session(), m.new_session()
    a.extend(ids[:5])
    b.extend(ids[:30])
    out = extend_together([a, b], [ids[5:9], ids[30:40]])
    assert np.array_equal(out[0], m.logits(ids[:9])[-1])
    assert np.array_equal(out[1], m.logits(ids[:40])[-1])


# ---------------------------------------------------------------- GGUF


def gguf_config_matches(converted: Path, original: Path):
    got, want = (json.loads((p / "config.json").read_text()) for p in (converted, original))
    params = want["rope_parameters"]
    assert got.get("partial_rotary_factor", 1.0) == params["partial_rotary_factor"]
    assert got.get("sliding_window") == want.get("sliding_window")
    if params["rope_type"] == "longrope":
        assert got["original_max_position_embeddings"] == want["original_max_position_embeddings"]
        assert got["rope_scaling"]["rope_type"] == "longrope"
        for key in ("short_factor", "long_factor"):
            assert np.allclose(got["rope_scaling"][key], params[key], rtol=1e-7)


@pytest.mark.parametrize("name", ["longrope", "swa"])
def test_gguf_from_the_converter_matches_transformers(name, tmp_path):
    """Natively (fused tensors split on load) and converted to a folder."""
    from fastllm.formats.gguf import convert_gguf
    folder = DATA / name
    ref = load_hf(folder)
    gguf = DATA / f"{name}-F32.gguf"
    converted = convert_gguf(gguf, tmp_path / name, dtype="f32", progress=False)
    gguf_config_matches(converted, folder)
    ids = tokens(70, vocab=2000, seed=6)
    want = hf_logits(ref, ids)
    for model in (Model.from_pretrained(gguf, threads=2), Model.from_pretrained(converted, threads=2)):
        ok, err, _ = within(model.logits(ids), want)
        assert ok, f"{name}: max err {err:.3g}"


def test_q4_k_m_gguf_matches_its_dequantized_folder(tmp_path):
    """Quantized fused tensors split on whole blocks: with fp32 activations
    the file computes what transformers computes on the weights fastllm's
    importer dequantizes."""
    from fastllm.formats.gguf import convert_gguf
    gguf = DATA / "wide-Q4_K_M.gguf"
    converted = convert_gguf(gguf, tmp_path / "wide", dtype="f32", progress=False)
    ids = tokens(40, vocab=2000, seed=7)
    want = hf_logits(load_hf(converted), ids)
    ok, err, _ = within(Model.from_pretrained(gguf, threads=2, activations="f32").logits(ids), want)
    assert ok, f"max err {err:.3g}"


@pytest.mark.parametrize("name", ["longrope", "swa"])
def test_exported_gguf_reads_back(name, tmp_path):
    """fastllm's own GGUF of a Phi-3 folder keeps the fused tensors, the
    rope factors, the partial rotary and the window as llama.cpp's
    converter writes them: read back, it computes what transformers does."""
    import shutil
    from fastllm.formats.gguf_writer import export_gguf
    from oracles import spm_vocabs
    folder = tmp_path / name
    shutil.copytree(DATA / name, folder)
    tokenizer = spm_vocabs.hf_folder(DATA.parent / "spm-gguf" / "llama-bpe-bf.model", tmp_path, "llama")
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    gguf = export_gguf(folder, tmp_path / f"{name}.gguf")
    ids = tokens(70, vocab=2000, seed=8)
    ok, err, _ = within(Model.from_pretrained(gguf, threads=2).logits(ids), hf_logits(load_hf(DATA / name), ids))
    assert ok, f"{name}: max err {err:.3g}"


# ---------------------------------------------------------- chat template

# Phi-3-mini-4k-instruct's (as llama.cpp's template tests keep it),
# Phi-3.5-mini-instruct's (llama.cpp's models/templates) and Phi-4-mini-
# instruct's, whose system turn can carry tools.
PHI3_TEMPLATES = {
    "phi3-mini": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}"
                 "{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}"
                 "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\n'}}"
                 "{% endif %}{% endfor %}",
    "phi3.5-mini": "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
                   "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
                   "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
                   "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
    "phi4-mini": "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
                 "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
                 "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] "
                 "+ '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}",
}
PHI3_SPECIALS = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|system|>", "<|user|>", "<|tool|>", "<|/tool|>"]
CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "x"}],
    [{"role": "system", "content": "You call tools.", "tools": '[{"name": "f"}]'}, {"role": "user", "content": "go"}],
]


@pytest.fixture(scope="module")
def phi3_tokenizer_dir(tmp_path_factory):
    from transformers import AutoTokenizer
    from oracles import spm_vocabs
    tmp = tmp_path_factory.mktemp("phi3-tok")
    tok = AutoTokenizer.from_pretrained(str(spm_vocabs.hf_folder(DATA.parent / "spm-gguf" / "llama-bpe-bf.model",
                                                                   tmp, "llama")))
    tok.add_special_tokens({"additional_special_tokens": PHI3_SPECIALS})
    out = tmp / "phi3"
    tok.save_pretrained(str(out))
    return out


@pytest.mark.parametrize("name", sorted(PHI3_TEMPLATES))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_templates_render_as_transformers(name, gen, phi3_tokenizer_dir):
    from transformers import AutoTokenizer
    from fastllm.tokenizer import Tokenizer
    ours, tf = Tokenizer.from_pretrained(phi3_tokenizer_dir), AutoTokenizer.from_pretrained(str(phi3_tokenizer_dir))
    for messages in CHATS:
        kw = dict(chat_template=PHI3_TEMPLATES[name], add_generation_prompt=gen)
        text = ours.apply_chat_template(messages, **kw)
        assert text == tf.apply_chat_template(messages, tokenize=False, **kw)
        ids = ours.apply_chat_template(messages, tokenize=True, **kw)
        assert ids == tf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
        assert tf.convert_tokens_to_ids("<|end|>") in ids


# ------------------------------------------------------------- bad input

PHI3_128K = dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, vocab_size=300, max_position_embeddings=131072,
                 original_max_position_embeddings=4096,
                 rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})


def test_config_of_phi3_128k_style():
    """The old "su" name, the original context at the top level, and the
    attention factor transformers derives from the two lengths."""
    import math
    from fastllm.spec.config import ModelConfig
    cfg = ModelConfig.from_dict(dict(PHI3_128K))
    assert cfg.longrope and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert cfg.fused_qkv and cfg.fused_gate_up
    cos, _ = cfg.rope_tables(3)
    long_cos, _ = cfg.rope_tables_long(3)
    assert cos[0, 0] == long_cos[0, 0] == np.float32(cfg.rope_scaling["attention_factor"])


@pytest.mark.parametrize("change, message", [
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}),
     "'short_factor' has 7 entries"),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [-1.0]}),
     "'long_factor' must be a list of positive numbers"),
    (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8}), "'long_factor'"),
    (dict(original_max_position_embeddings=0), "original_max_position_embeddings"),
    (dict(partial_rotary_factor=0.6), "partial_rotary_factor"),
])
def test_bad_phi3_configs_are_refused(change, message):
    from fastllm.spec.config import ModelConfig
    from fastllm.spec.errors import ModelFileError
    with pytest.raises(ModelFileError, match=message):
        ModelConfig.from_dict(dict(PHI3_128K, **change))


def test_gguf_with_one_rope_factor_table_is_refused(tmp_path):
    """A file with rope_factors_long but no rope_factors_short."""
    import gguf as gg
    from fastllm.formats.gguf import convert_gguf
    from fastllm.formats.gguf_file import ConversionError
    reader = gg.GGUFReader(str(DATA / "longrope-F32.gguf"))
    writer = gg.GGUFWriter(str(tmp_path / "bad.gguf"), "phi3")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        writer.add_key_value(field.name, value, field.types[0],
                             sub_type=field.types[-1] if field.types[0] == gg.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name != "rope_factors_short.weight":
            writer.add_tensor(t.name, np.array(t.data).reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConversionError, match="rope_factors_short"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "out", dtype="f32", progress=False)
