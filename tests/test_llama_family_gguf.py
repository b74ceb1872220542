"""The Llama-family GGUF files people download, end to end: Llama 2,
TinyLlama and Mistral 7B v0.1, v0.2 and v0.3 in miniature.

tests/data/llama-family (made by its make.py) holds, per family, the HF
folder as the family ships it (SentencePiece tokenizer.model,
tokenizer.json in the family's layout, the family's chat template) and the
GGUF llama.cpp's own converter writes of it, F32, plus Q4_K_M and Q8_0
files that llama-quantize made of 256-wide versions.

Oracles: transformers on the HF folder, in float64 (the bounds of
oracles/hf_reference.py, as in test_tiny_models.py); for the quantized
files, transformers on the folder that fastllm's importer dequantizes the
file into, with fastllm's activations in f32; the `sentencepiece` library on
tokenizer.model and HF `tokenizers` on tokenizer.json; transformers'
apply_chat_template on the folder.

Mistral v0.1 slides a window over the keys (here 12 positions). llama.cpp's
converter writes no sliding window into a `llama` file, and llama.cpp's
`llama` architecture never reads one (src/models/llama.cpp), so llama.cpp
runs that GGUF with full attention. fastllm does the same with the file,
while the HF folder slides its window as transformers does.
"""
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.spec.errors import ModelFileError
from fastllm.formats.gguf import ConversionError, convert_gguf
from fastllm.tokenizer import Tokenizer
from oracles import spm_vocabs
from oracles.hf_reference import compare_greedy, hf_greedy, hf_logits, load_hf, within
from oracles.tiny_models import with_config
from oracles.tokenizer_strings import EDGE_CASES

spm = pytest.importorskip("sentencepiece")
tokenizers = pytest.importorskip("tokenizers")

DATA = Path(__file__).resolve().parent / "data" / "llama-family"
FAMILIES = ["llama2", "tinyllama", "mistral-v0.1", "mistral-v0.2", "mistral-v0.3"]
QUANTIZED = ["llama2-256-Q4_K_M", "llama2-256-Q8_0", "mistral-v0.3-256-Q4_K_M"]
# The HF folders' sliding windows; their GGUF files, arch `llama`, carry none.
WINDOW = {"mistral-v0.1": 12}
STRINGS = spm_vocabs.SPM_EDGE_CASES + EDGE_CASES + spm_vocabs.spm_random_strings(300, seed=21)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  Hello! How can I help?  "},
     {"role": "user", "content": "Tell me a story\nabout a llama."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why?"}],
    [{"role": "assistant", "content": "out of turn"}],
]


@pytest.fixture(autouse=True, scope="module")
def fastllm_home(tmp_path_factory):
    """GGUF files are converted into a cache of their own, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTLLM_HOME", str(tmp_path_factory.mktemp("fastllm_home")))
        yield


def gguf_path(name):
    return DATA / f"{name}.gguf"


def prompt(n, seed):
    # Ids past the control pieces: any text the vocabulary can spell.
    return np.random.default_rng(seed).integers(40, 2000, n).tolist()


def reference(family, tmp_path):
    """transformers as llama.cpp runs the GGUF: on the HF folder, without a
    sliding window (the converter writes none for arch llama)."""
    folder = DATA / family
    if family in WINDOW:
        folder = with_config(folder, tmp_path / "no-window", sliding_window=None)
    return load_hf(folder)


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_loads_natively_and_by_conversion(family, tmp_path):
    native = Model.from_pretrained(gguf_path(family), threads=2)
    folder = convert_gguf(gguf_path(family), tmp_path / "converted", dtype="f32", progress=False)
    converted = Model.from_pretrained(folder, threads=2)
    ids = prompt(30, seed=1)
    assert np.array_equal(native.logits(ids), converted.logits(ids))
    assert [native.config.attention_window(i) for i in range(native.config.num_hidden_layers)] == [0, 0]


# --------------------------------------------------------------------------
# Logits and greedy decoding against transformers
# --------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_matches_transformers(family, tmp_path):
    ours = Model.from_pretrained(gguf_path(family), threads=2)
    ref = reference(family, tmp_path)
    ids = prompt(40, seed=2)
    ok, err, ratio = within(ours.logits(ids), hf_logits(ref, ids))
    assert ok, f"{family}: max |err| {err:.3g} exceeds the bound"

    want, margins = hf_greedy(ref, ids[:6], 30)
    got = list(ours.generate_tokens(ids[:6], 30, stop_token_ids=()))
    same, compared, diverged = compare_greedy(got, want, margins)
    assert same, f"{family}: token {diverged} differs with margin {margins[diverged]:.3g}"
    assert compared == 30, f"{family}: only {compared} greedy tokens compared"
    print(f"{family}: err/bound {ratio:.3f}, 30 greedy tokens, smallest margin {min(margins):.3g}")


def test_mistral_v01_gguf_attends_to_everything_as_llama_cpp_does(tmp_path):
    """The window belongs to the HF folder; the GGUF from llama.cpp's
    converter has none, and llama.cpp runs arch llama with full attention."""
    import gguf
    reader = gguf.GGUFReader(str(gguf_path("mistral-v0.1")))
    assert not [k for k in reader.fields if "sliding_window" in k]
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"

    ids = prompt(40, seed=3)
    windowed = hf_logits(load_hf(DATA / "mistral-v0.1"), ids)
    full = hf_logits(reference("mistral-v0.1", tmp_path), ids)
    from_gguf = Model.from_pretrained(gguf_path("mistral-v0.1"), threads=2).logits(ids)
    assert within(from_gguf, full)[0]
    assert not within(from_gguf, windowed)[0], "the window changes nothing over 40 tokens"

    folder = Model.from_pretrained(DATA / "mistral-v0.1", threads=2)
    assert [folder.config.attention_window(i) for i in range(2)] == [12, 12]
    assert within(folder.logits(ids), windowed)[0]


def with_keys(src, dst, **keys):
    """A copy of the GGUF file src at dst with uint32 keys added."""
    import gguf
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in keys.items():
        writer.add_uint32(key, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_sliding_window_key_in_a_llama_file_changes_nothing(tmp_path):
    """Other tools may write llama.attention.sliding_window into a llama
    file. llama.cpp's llama architecture never reads it (llama-perplexity
    gives such a file the PPL of the same file without the key), and
    fastllm attends to everything there as well."""
    path = with_keys(gguf_path("mistral-v0.1"), tmp_path / "with-window.gguf",
                     **{"llama.attention.sliding_window": 12})
    ours = Model.from_pretrained(path, threads=2)
    assert [ours.config.attention_window(i) for i in range(2)] == [0, 0]
    ids = prompt(40, seed=5)
    assert np.array_equal(ours.logits(ids), Model.from_pretrained(gguf_path("mistral-v0.1"), threads=2).logits(ids))


@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_gguf_matches_transformers_on_the_dequantized_folder(name, tmp_path):
    folder = convert_gguf(gguf_path(name), tmp_path / "dequantized", dtype="f32", progress=False)
    ref = load_hf(folder)
    ours = Model.from_pretrained(gguf_path(name), threads=2, activations="f32")
    qtype = name.rsplit("-", 1)[1]
    types = set(ours.weight_types)
    assert types == ({"q8_0"} if qtype == "Q8_0" else {"q4_k", "q6_k"}), types
    ids = prompt(40, seed=4)
    ok, err, ratio = within(ours.logits(ids), hf_logits(ref, ids))
    assert ok, f"{name}: max |err| {err:.3g} exceeds the bound"

    want, margins = hf_greedy(ref, ids[:6], 30)
    got = list(ours.generate_tokens(ids[:6], 30, stop_token_ids=()))
    same, compared, diverged = compare_greedy(got, want, margins)
    assert same, f"{name}: token {diverged} differs with margin {margins[diverged]:.3g}"
    assert compared == 30, f"{name}: only {compared} greedy tokens compared"
    print(f"{name}: {sorted(types)}, err/bound {ratio:.3f}, smallest margin {min(margins):.3g}")


# --------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------

def control_texts(family):
    sp = spm.SentencePieceProcessor(model_file=str(DATA / family / "tokenizer.model"))
    return sp, [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_tokenizer_matches_sentencepiece(family):
    """llama.cpp's SPM tokenizer is sentencepiece's: the GGUF must give the
    ids sentencepiece gives on the family's tokenizer.model. Texts that
    spell a control piece ([INST], <s>) are left out: the GGUF matches
    those as special tokens, sentencepiece spells them out."""
    sp, controls = control_texts(family)
    ours = Model.from_pretrained(gguf_path(family), threads=1).tokenizer
    texts = [t for t in STRINGS if not any(c in t for c in controls)]
    assert len(texts) > 300
    bad = [t for t in texts if ours.encode(t, add_special_tokens=False) != sp.encode(t)]
    assert not bad, bad[:5]
    assert ours.encode("Hello") == [sp.bos_id()] + sp.encode("Hello")
    for t in texts:
        assert ours.decode(sp.encode(t)) == sp.decode(sp.encode(t)), t


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_tokenizer_matches_hf_tokenizers(family):
    ours = Tokenizer.from_pretrained(DATA / family)
    hf = tokenizers.Tokenizer.from_file(str(DATA / family / "tokenizer.json"))
    for add in (False, True):
        want = [e.ids for e in hf.encode_batch(STRINGS, add_special_tokens=add)]
        bad = [t for t, w in zip(STRINGS, want) if ours.encode(t, add_special_tokens=add) != w]
        assert not bad, bad[:5]
    for ids in want:
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), ids


def test_mistral_v03_control_tokens_are_special_in_both():
    _, controls = control_texts("mistral-v0.3")
    assert "[INST]" in controls and "[/INST]" in controls
    text = "[INST] Hi[/INST] Hello</s>[INST] More [/INST]"
    want = tokenizers.Tokenizer.from_file(str(DATA / "mistral-v0.3" / "tokenizer.json")).encode(text).ids
    folder = Tokenizer.from_pretrained(DATA / "mistral-v0.3")
    assert folder.encode(text) == want
    from_gguf = Model.from_pretrained(gguf_path("mistral-v0.3"), threads=1).tokenizer
    inst = from_gguf.encode("[INST]", add_special_tokens=False)
    assert inst == [folder.encode("[INST]", add_special_tokens=False)[0]] and len(inst) == 1


# --------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------

def render(render_fn, messages, add_generation_prompt):
    """The text, or None where the template raises (roles out of turn, a
    system message the template refuses)."""
    try:
        return render_fn(messages, add_generation_prompt=add_generation_prompt)
    except Exception:
        return None


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_templates_render_as_transformers(family):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(DATA / family)
    from_gguf = Model.from_pretrained(gguf_path(family), threads=1).tokenizer
    from_folder = Tokenizer.from_pretrained(DATA / family)
    rendered = 0
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = render(lambda m, **kw: hf.apply_chat_template(m, tokenize=False, **kw), messages, gen)
            for ours in (from_gguf, from_folder):
                assert render(ours.apply_chat_template, messages, gen) == want, (family, messages, gen)
            rendered += want is not None
    assert rendered >= 4


def test_mistral_v03_template_with_tools_renders_as_transformers():
    from transformers import AutoTokenizer
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"id": "abcdefghi", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny."},
                {"role": "user", "content": "And tomorrow?"}]
    want = AutoTokenizer.from_pretrained(DATA / "mistral-v0.3").apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "[AVAILABLE_TOOLS]" in want and "[TOOL_CALLS]" in want and "[TOOL_RESULTS]" in want
    from_gguf = Model.from_pretrained(gguf_path("mistral-v0.3"), threads=1).tokenizer
    for ours in (from_gguf, Tokenizer.from_pretrained(DATA / "mistral-v0.3")):
        assert ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True) == want


# --------------------------------------------------------------------------
# Mixtral: a llama file with expert tensors
# --------------------------------------------------------------------------

def test_mixtral_gguf_runs_as_its_dequantized_folder(tmp_path):
    """The converter's Q8_0 Mixtral, its experts in their own types, with f32
    activations: the logits of the folder the importer dequantizes it into."""
    path = gguf_path("mixtral")
    native = Model.from_pretrained(path, threads=1, activations="f32")
    assert native.config.model_type == "mixtral" and native.config.num_experts == 4
    folder = Model.from_pretrained(convert_gguf(path, tmp_path / "folder", dtype="f32", progress=False), threads=1)
    ids = prompt(30, seed=4)
    ok, err, _ = within(native.logits(ids), folder.logits(ids))
    assert ok, f"max |err| {err:.3g}"


# --------------------------------------------------------------------------
# Export: a Mistral folder is written as llama.cpp's converter writes it
# --------------------------------------------------------------------------

def test_mistral_folder_exports_as_a_llama_file_without_its_window(tmp_path):
    import gguf
    from fastllm.formats.gguf_writer import export_gguf
    with pytest.warns(UserWarning, match=r"sliding window of 12 positions \(2 of 2 layers\) is not written"):
        out = export_gguf(DATA / "mistral-v0.1", tmp_path / "mistral.gguf", mix="f32")
    ours, theirs = gguf.GGUFReader(str(out)), gguf.GGUFReader(str(gguf_path("mistral-v0.1")))
    assert bytes(ours.fields["general.architecture"].parts[-1]).decode() == "llama"
    # The same tensors, Q/K rows interleaved as llama.cpp's RoPE wants them.
    want = {t.name: np.asarray(t.data) for t in theirs.tensors}
    for t in ours.tensors:
        assert np.array_equal(np.asarray(t.data), want.pop(t.name)), t.name
    assert not want
    ids = prompt(40, seed=5)
    assert np.array_equal(Model.from_pretrained(out, threads=2).logits(ids),
                          Model.from_pretrained(gguf_path("mistral-v0.1"), threads=2).logits(ids))
