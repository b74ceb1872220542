"""GGUF export (fastllm.formats.gguf_writer, `fastllm convert FOLDER OUT.gguf`).

Oracles:
* transformers' own GGUF loader reads an f32 export of tiny llama, qwen2 and
  qwen3 checkpoints back to the checkpoint's weights and logits;
* a quantized export, read back by fastllm's GGUF import, gives the logits
  of the checkpoint whose weights went through quantize -> dequantize under
  the same plan (the GGUF path only adds the Q/K row interleaving, which
  must come out undone);
* the metadata equals what the tiny GGUF files of test_convert (laid out
  as llama.cpp's converter writes them) say.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import gguf
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fastllm import Model
from fastllm.cli.main import main
from fastllm.formats import quants
from fastllm.formats.gguf import ConversionError, convert_gguf
from fastllm.formats.gguf_tensors import gguf_names
from fastllm.formats.gguf_writer import export_gguf, permute
from fastllm.formats.gguf_tensors import unpermute
from fastllm.formats.safetensors import load_file, save_file
from fastllm.spec.config import ModelConfig
from test_convert import synthetic_vocab, write_gguf


def _hf_folder(checkpoint: Path, root: Path) -> Path:
    """A complete HF folder (tokenizer included) with the checkpoint's
    weights: the checkpoint through a llama.cpp-style GGUF and back."""
    raw = json.loads((checkpoint / "config.json").read_text())
    pre = "qwen2" if raw["model_type"].startswith("qwen") else "smollm"
    src = write_gguf(root / "src.gguf", checkpoint, synthetic_vocab(raw["vocab_size"], pre))
    return convert_gguf(src, root / "hf", progress=False), src


@pytest.fixture(scope="module")
def hf_folder(tiny_model_dir, tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            if kind == "llama-wide":
                folder = _wide_llama(tmp_path_factory.mktemp("wide"))
            else:
                folder = tiny_model_dir(kind)
            made[kind] = _hf_folder(folder, tmp_path_factory.mktemp(kind))
        return made[kind]
    return get


def _wide_llama(root: Path) -> Path:
    # Rows of 256 and 512: every K-quant and the _M rules apply without fallbacks.
    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                  max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                  initializer_range=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(root / "ckpt", safe_serialization=True)
    return root / "ckpt"


def _ids(vocab):
    return [(i * 37 + 5) % vocab for i in range(13)]


# (transformers' GGUF loader drops llama's attention biases, llama3's rope_freqs table and a head_dim
# other than hidden/heads (qwen3 here): those are checked against the llama.cpp-style file below
# and read back by fastllm.)
@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha-untied", "qwen2", "qwen2-tied"])
def test_f32_export_loads_in_transformers(kind, hf_folder, tmp_path):
    folder, _ = hf_folder(kind)
    export_gguf(folder, tmp_path / "m.gguf", "f32", progress=False)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    for key, value in ref_sd.items():
        assert torch.equal(value, our_sd[key]), key
    ids = torch.tensor([_ids(ref.config.vocab_size)])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha-untied", "llama-headdim-bias", "llama3-rope",
                                  "llama-linear-rope", "qwen2", "qwen2-tied", "qwen3", "qwen3-untied"])
def test_f32_export_equals_llama_cpp_layout(kind, hf_folder, tmp_path):
    # Metadata and tensors equal those of the llama.cpp-style file the folder came from.
    folder, src = hf_folder(kind)
    out = export_gguf(folder, tmp_path / "m.gguf", "f32", progress=False)
    a, b = gguf.GGUFReader(out), gguf.GGUFReader(src)
    fa, fb = a.fields, b.fields
    for key in fb:
        if key.startswith("GGUF.") or key in ("general.name", "general.file_type"):
            continue
        assert key in fa, key
        assert fa[key].contents() == fb[key].contents(), key
    shapes_a = {t.name: (t.tensor_type, list(t.shape)) for t in a.tensors}
    shapes_b = {t.name: (t.tensor_type, list(t.shape)) for t in b.tensors}
    assert shapes_a == shapes_b
    for ta, tb in zip(sorted(a.tensors, key=lambda t: t.name), sorted(b.tensors, key=lambda t: t.name)):
        if ta.name == "rope_freqs.weight":
            # llama.cpp's converter computes the table in torch; the last bit may differ.
            np.testing.assert_allclose(ta.data, tb.data, rtol=1e-6)
        else:
            assert np.array_equal(np.asarray(ta.data), np.asarray(tb.data)), ta.name


def _through_plan(folder: Path, mix: str, out: Path) -> Path:
    """A copy of folder with each tensor replaced by quantize -> dequantize
    in the type the mix gives it."""
    cfg = ModelConfig.from_file(folder / "config.json")
    names = gguf_names(cfg)
    weights = load_file(folder / "model.safetensors")
    plan = quants.plan({g: weights[hf].shape for g, (hf, _, _) in names.items()}, mix)
    for g, (hf, _, _) in names.items():
        w = weights[hf].astype(np.float32)
        rows = w.reshape(-1, w.shape[-1])
        weights[hf] = quants.dequantize(quants.quantize(rows, plan[g]), plan[g], w.shape[-1]).reshape(w.shape)
    shutil.copytree(folder, out)
    save_file(out / "model.safetensors", weights)
    return out


@pytest.mark.parametrize("kind,mix", [("llama-wide", "q4_k_m"), pytest.param("llama-wide", "q5_k", marks=pytest.mark.slow),
                                      pytest.param("llama-wide", "q6_k", marks=pytest.mark.slow),
                                      ("llama-gqa", "q8_0"), ("qwen2", "q4_0"), ("qwen3", "q5_1"),
                                      ("llama-headdim-bias", "q4_1"), ("qwen3-untied", "f16")])
def test_quantized_export_reads_back(kind, mix, hf_folder, tmp_path, fastllm_home):
    folder, _ = hf_folder(kind)
    out = export_gguf(folder, tmp_path / "m.gguf", mix, progress=False)
    want = _through_plan(folder, mix, tmp_path / "ref")
    # fp32 activations: the exact dequantized weights, as the reference folder holds them, bit for bit.
    ours = Model.from_pretrained(out, threads=2, activations="f32")
    ref = Model.from_pretrained(want, threads=2)
    ids = _ids(ours.config.vocab_size)
    got, expect = ours.logits(ids), ref.logits(ids)
    np.testing.assert_array_equal(got, expect)
    # Quantized at load from the folder, under the same mix: the same weights.
    if mix != "f16":
        at_load = Model.from_pretrained(folder, threads=2, dtype=mix, activations="f32")
        assert at_load.weight_types == ours.weight_types
        np.testing.assert_array_equal(at_load.logits(ids), expect)
    # And the quantization did something, short of noise (random models amplify it).
    exact = Model.from_pretrained(folder, threads=2).logits(ids)
    drift = np.sqrt(np.mean((got - exact) ** 2))
    assert 0 < drift < np.sqrt(np.mean(exact ** 2)), drift

    types = {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(out).tensors}
    cfg = ModelConfig.from_file(folder / "config.json")
    shapes = {g: tuple(t.shape(lc)) for g, (_, t, lc) in gguf_names(cfg).items()}
    assert types == {**quants.plan(shapes, mix), **({"rope_freqs.weight": "f32"} if "rope_freqs.weight" in types
                                                    else {})}
    if kind == "llama-wide" and mix == "q4_k_m":
        assert {types[f"blk.{i}.ffn_down.weight"] for i in range(8)} == {"q4_k", "q6_k"}
        assert types["output.weight"] == "q6_k"


def test_permute_inverts_unpermute():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


def test_cli_converts_both_ways(hf_folder, tmp_path, capsys):
    folder, src = hf_folder("qwen2")
    assert main(["convert", str(folder), str(tmp_path / "m.gguf"), "--dtype", "q8_0"]) == 0
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["general.file_type"].contents() == 7
    assert main(["convert", str(tmp_path / "m.gguf"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").is_file()
    assert main(["convert", str(src), str(tmp_path / "x"), "--dtype", "q4_k_m"]) == 1
    assert "f32 or bf16" in capsys.readouterr().err
    assert main(["convert", str(folder), str(tmp_path / "m.gguf"), "--dtype", "q8_0"]) == 1
    assert "already exists" in capsys.readouterr().err


def test_refusals(hf_folder, tmp_path):
    folder, _ = hf_folder("llama-gqa")
    with pytest.raises(ValueError, match="unknown dtype"):
        export_gguf(folder, tmp_path / "b.gguf", "q3_k_s")
    dynamic = tmp_path / "dynamic"
    shutil.copytree(folder, dynamic)
    raw = json.loads((dynamic / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    (dynamic / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConversionError, match="rope scaling 'dynamic'"):
        export_gguf(dynamic, tmp_path / "c.gguf")
    notok = tmp_path / "notok"
    shutil.copytree(folder, notok)
    (notok / "tokenizer.json").unlink()
    with pytest.raises(ConversionError, match="no tokenizer.json"):
        export_gguf(notok, tmp_path / "d.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial*"))
