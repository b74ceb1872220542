"""Qwen3.5 GGUF files (arch qwen35) as llama.cpp's own converter writes them,
run natively and converted to folders, against transformers on the HF
folders they came from.

tests/data/qwen35-gguf holds the files and folders; its make.py says how
llama.cpp made them. The reference runs in float64 (oracles/hf_reference.py
says why), with test_tiny_models.py's bounds: |got - ref| <= 1e-4 +
1e-4*|ref| on logits at every position; greedy tokens identical wherever
the reference's top-1/top-2 margin exceeds 1e-3.
"""
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from fastllm import Model  # noqa: E402
from fastllm.cli.main import main  # noqa: E402
from fastllm.formats.gguf import ConversionError, convert_gguf  # noqa: E402
from fastllm.formats.gguf_tensors import IgnoredTensorsWarning  # noqa: E402
from fastllm.formats.gguf_writer import export_gguf  # noqa: E402
from oracles.hf_reference import compare_greedy, hf_greedy, hf_logits, load_hf, within  # noqa: E402
from oracles.splits import assert_same_bits_for_thread_counts, assert_same_bits_however_split  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "qwen35-gguf"
# checkpoint: what it exercises (make.py has the shapes)
CHECKPOINTS = ["text", "interval", "wrapper"]


@pytest.fixture(autouse=True)
def _home(fastllm_home):
    """Conversions of the files land in the session's own FASTLLM_HOME."""


def sequences(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 300, n).tolist() for n in (1, 9, 40)]


def assert_matches(model, ref, label, seed=0):
    margins = []
    for ids in sequences(seed):
        want = hf_logits(ref, ids)
        ok, err, ratio = within(model.logits(ids), want)
        assert ok, f"{label}: max |err| {err:.3g} exceeds the bound (worst ratio {ratio:.2f})"
        top2 = np.sort(want, axis=1)[:, -2:]
        margins += list(top2[:, 1] - top2[:, 0])
    assert np.median(margins) > 1e-2, f"{label}: logits are flat"


@pytest.mark.parametrize("dtype", ["gguf", "f32"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_f32_file_matches_transformers_on_its_folder(name, dtype):
    """Natively (every tensor as the file holds it) and converted to a folder."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)   # the wrapper's "vision tower ignored"
        ref = load_hf(DATA / name)
    model = Model.from_pretrained(DATA / f"{name}-F32.gguf", dtype=dtype, threads=2)
    assert model.config.model_type == "qwen3_5_text"
    assert_matches(model, ref, f"{name} {dtype}")


def bf16_reference(folder):
    """transformers on folder with the tensors the converter writes in BF16
    (its matrices) rounded to bf16."""
    import torch
    ref = load_hf(folder)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return ref


def test_bf16_file_matches_a_bf16_rounded_reference():
    model = Model.from_pretrained(DATA / "text-BF16.gguf", threads=2)
    assert set(model.weight_types) == {"bf16"}, model.weight_types
    assert_matches(model, bf16_reference(DATA / "text"), "text BF16", seed=1)


def assert_greedy_matches(model, ref):
    """24 greedy tokens after each of sequences(2)'s longer prompts, as
    transformers picks them (within the top-2 margin)."""
    for ids in sequences(2)[1:]:
        want, margins = hf_greedy(ref, ids, 24)
        got = list(model.generate_tokens(ids, 24, stop_token_ids=()))
        ok, compared, diverged = compare_greedy(got, want, margins)
        assert ok, f"token {diverged} differs with margin {margins[diverged]:.3g}"
        assert compared > 0


def test_greedy_decoding_matches_transformers():
    model = Model.from_pretrained(DATA / "text-F32.gguf", threads=2)
    ref = load_hf(DATA / "text")
    assert_greedy_matches(model, ref)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_quantized_file_matches_transformers_on_its_dequantized_folder(quant, tmp_path):
    """llama-quantize's output, run in its own types with f32 activations,
    against transformers on the folder the importer dequantizes it into.
    Its value heads are ordered differently from HF's (Hv != Hk > 1): Q8_0
    reorders them block by block; Q4_K's 256-wide blocks span two heads, so
    the run loop reads them in llama.cpp's order. Every matrix stays in its
    own type."""
    path = DATA / f"wide-{quant}.gguf"
    folder = convert_gguf(path, tmp_path / "folder", dtype="f32", progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = Model.from_pretrained(path, threads=2, activations="f32")
    assert [str(w.message) for w in caught] == []
    assert "f32" not in model.weight_types, model.weight_types
    assert_matches(model, load_hf(folder), quant, seed=3)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_quantized_files_give_the_same_bits_however_split_or_threaded(quant):
    """Value heads in HF's order (Q8_0) and in llama.cpp's (Q4_K_M)."""
    path = DATA / f"wide-{quant}.gguf"
    assert_same_bits_however_split(path, dict(threads=2))
    assert_same_bits_for_thread_counts(path, 37)


def test_the_mtp_block_is_loaded_and_leaves_the_model_as_it_was():
    """The MTP file is the text checkpoint plus one MTP layer, in BF16: the
    block is loaded (for speculative="mtp"), without a notice, and the
    model's logits are the text checkpoint's."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredTensorsWarning)
        model = Model.from_pretrained(DATA / "mtp-BF16.gguf", threads=2)
    assert model.config.num_hidden_layers == 4 and model.has_mtp
    plain = Model.from_pretrained(DATA / "text-BF16.gguf", threads=2)
    assert not plain.has_mtp
    ids = sequences(4)[2]
    assert np.array_equal(model.logits(ids), plain.logits(ids))


def mtp_checkpoint(tmp_path):
    """The text folder with the MTP tensors make.py adds (the same seeded
    draw), their matrices rounded to bf16 as the converter wrote them."""
    import importlib.util
    import shutil
    import torch
    from safetensors.torch import load_file
    spec = importlib.util.spec_from_file_location("qwen35_make", DATA / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    folder = tmp_path / "mtp"
    shutil.copytree(DATA / "text", folder)
    make.add_mtp_layer(folder, make.SEEDS["text"] + 1000)
    from oracles.mtp_reference import mtp_tensors
    mtp = mtp_tensors(load_file(folder / "model.safetensors"))
    return {k: v.to(torch.bfloat16).to(torch.float64) if v.dim() == 2 else v.double() for k, v in mtp.items()}


def test_the_mtp_block_matches_a_float64_reference(tmp_path):
    """fastllm's MTP block (the file's BF16 weights) against the block put
    together from transformers' Qwen3.5 layer in float64 (oracles/mtp_reference.py),
    on the model's own hidden states: every pair of a 40-token sequence, and
    two chained steps that feed the block its own output, within the
    bound of the model's logits."""
    from fastllm.core import _core
    from oracles.mtp_reference import mtp_reference
    model = Model.from_pretrained(DATA / "mtp-BF16.gguf", threads=2, activations="f32")
    ref = bf16_reference(DATA / "text")
    mtp = mtp_checkpoint(tmp_path)
    ids = sequences(5)[2]
    _, hidden = model.new_session().prefill(ids, hidden=True)
    state = _core.State(model._mtp, 64)
    got, out = state.run(np.asarray(ids[1:], np.int32), 0, True, False, False, True, hidden[:-1])
    want, _ = mtp_reference(ref, mtp, ids)
    ok, err, ratio = within(got, want)
    assert ok, f"MTP logits: max |err| {err:.3g} exceeds the bound (worst ratio {ratio:.2f})"
    top2 = np.sort(want, axis=1)[:, -2:]
    assert np.median(top2[:, 1] - top2[:, 0]) > 1e-2, "flat logits"
    chain = [int(np.argmax(got[-1]))]
    logits, out = state.run(np.asarray(chain, np.int32), len(ids) - 1, False, False, False, True, out[-1:])
    chain.append(int(np.argmax(logits)))
    logits, _ = state.run(np.asarray(chain[1:], np.int32), len(ids), False, False, False, True, out[-1:])
    want, _ = mtp_reference(ref, mtp, ids, extra=chain)
    ok, err, ratio = within(logits[None], want[-1:])
    assert ok, f"chained MTP logits: max |err| {err:.3g} exceeds the bound (worst ratio {ratio:.2f})"


def test_mtp_speculation_gives_the_plain_tokens():
    model = Model.from_pretrained(DATA / "mtp-BF16.gguf", threads=2)
    for seed in range(3):
        ids = sequences(seed)[2]
        plain = list(model.generate_tokens(ids, 30, stop_token_ids=(), speculative=False))
        assert list(model.generate_tokens(ids, 30, stop_token_ids=(), speculative="mtp")) == plain
    with pytest.raises(ValueError, match="no multi-token-prediction block"):
        list(Model.from_pretrained(DATA / "text-BF16.gguf", threads=2).generate_tokens(ids, 3, speculative="mtp"))


def rewrite(src: Path, dst: Path, arch: str = None, drop=(), ints=None, values=None) -> Path:
    """A copy of the GGUF file src, with another architecture name, without
    the metadata keys (after the architecture's name) in drop, with the
    integer keys of ints (likewise) set, and the float32 tensors named in
    values holding those values."""
    import gguf
    reader = gguf.GGUFReader(str(src))
    old = reader.fields["general.architecture"].contents()
    arch = arch or old
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key[len(old) + 1:] in drop:
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key.replace(f"{old}.", f"{arch}.", 1), field.contents(), field.types[0], sub)
    for key, value in (ints or {}).items():
        writer.add_uint32(f"{arch}.{key}", value)
    for t in reader.tensors:
        data = np.asarray((values or {}).get(t.name, t.data), t.data.dtype).reshape(t.data.shape)
        writer.add_tensor(t.name, data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_layer_types_come_from_full_attention_interval_without_a_per_layer_list(tmp_path):
    """The interval checkpoint alternates linear and full attention layers."""
    drop = ("attention.recurrent_layers", "full_attention_interval")
    path = rewrite(DATA / "interval-F32.gguf", tmp_path / "every-2.gguf", drop=drop,
                   ints={"full_attention_interval": 2})
    assert_matches(Model.from_pretrained(path, threads=2), load_hf(DATA / "interval"), "interval 2")
    # Without either key, llama.cpp's default interval of 4 applies: here,
    # tensors of the wrong kind in layers 1 and 2.
    path = rewrite(DATA / "interval-F32.gguf", tmp_path / "default.gguf", drop=drop)
    with pytest.raises(ConversionError, match="tensors do not fit"):
        convert_gguf(path, tmp_path / "default", progress=False)


def test_a_decay_that_is_not_negative_is_refused(tmp_path):
    path = rewrite(DATA / "text-F32.gguf", tmp_path / "bad-a.gguf", values={"blk.2.ssm_a": [-1.0, 0.5, -2.0, -1.0]})
    for dtype in ("gguf", "f32"):
        with pytest.raises(ConversionError, match="blk.2.ssm_a holds values that are not negative"):
            Model.from_pretrained(path, dtype=dtype)


def test_a_qwen35moe_file_without_experts_is_refused_clearly(tmp_path):
    path = rewrite(DATA / "text-F32.gguf", tmp_path / "moe.gguf", arch="qwen35moe")
    with pytest.raises(ConversionError, match="GGUF metadata lacks 'qwen35moe.expert_count'"):
        Model.from_pretrained(path)


def test_convert_round_trip_through_the_cli(tmp_path, capsys):
    """GGUF -> folder -> GGUF with `fastllm convert`: the same tensors, names,
    types and metadata as llama.cpp's file, and the folder runs as it."""
    import gguf
    src = DATA / "text-F32.gguf"
    assert main(["convert", str(src), str(tmp_path / "folder")]) == 0
    assert main(["convert", str(tmp_path / "folder"), str(tmp_path / "back.gguf"), "--dtype", "f32"]) == 0
    assert_same_file(gguf.GGUFReader(str(src)), gguf.GGUFReader(str(tmp_path / "back.gguf")))


def test_writer_writes_what_llama_cpp_converter_writes(tmp_path):
    """The HF folder exported by fastllm against llama.cpp's own conversion of it."""
    import gguf
    for name, mix in [(name, "f32") for name in CHECKPOINTS] + [("text", "bf16")]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            out = export_gguf(DATA / name, tmp_path / f"{name}-{mix}.gguf", mix=mix, progress=False)
        # llama.cpp's converter also marks the non-special added tokens
        # that look special (<|fim_prefix|> ...) as control tokens.
        assert_same_file(gguf.GGUFReader(str(DATA / f"{name}-{mix.upper()}.gguf")), gguf.GGUFReader(str(out)),
                         ignore=("tokenizer.ggml.token_type",))


# Keys that name the file or its maker rather than the model, and
# add_eos_token, false where absent (llama.cpp's converter writes false).
_INCIDENTAL = ("general.name", "general.size_label", "general.type", "general.file_type",
               "general.quantization_version", "general.basename", "general.finetune",
               "tokenizer.ggml.add_eos_token")


def assert_same_file(want, got, ignore=()):
    def fields(r):
        return {k: f.contents() for k, f in r.fields.items()
                if not k.startswith("GGUF.") and k not in _INCIDENTAL + ignore}
    a, b = fields(want), fields(got)
    assert set(a) - set(b) == set(), f"missing keys {sorted(set(a) - set(b))}"
    for key in a:
        if isinstance(a[key], float):
            assert np.float32(a[key]) == np.float32(b[key]), key
        else:
            assert a[key] == b[key], key
    wt = {t.name: t for t in want.tensors}
    gt = {t.name: t for t in got.tensors}
    assert set(wt) == set(gt)
    for name, t in wt.items():
        u = gt[name]
        assert (t.tensor_type, t.shape.tolist()) == (u.tensor_type, u.shape.tolist()), name
        # A_log and the zero-centred norms go through log/exp and -1/+1 in a
        # folder; everything else is carried exactly.
        np.testing.assert_allclose(u.data, t.data, rtol=2e-7, atol=1e-7, err_msg=name)
