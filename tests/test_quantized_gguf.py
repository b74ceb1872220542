"""Quantized GGUF weights run as they are (no dequantization at load).

With fp32 activations the quantized matmuls multiply the exact dequantized
weights: the oracle is transformers running the same GGUF file in float64 (it
dequantizes with the gguf package), and on the default model the float32
model that fastllm converts from the same file, bit for bit. With int8
activations (the default) the results are measured against the float32
model: top-1 agreement and KL divergence.
"""
import json
import warnings

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fastllm import Model
from fastllm.spec.errors import ModelFileError
from fastllm.load.weights import DequantizedTypeWarning
from test_convert import synthetic_vocab, write_gguf

QT = gguf.GGMLQuantizationType
# Types gguf's own quantizer writes (the tiny models' rows are 32-value multiples).
GGUF_QUANTIZED = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.F16]
K_QUANTS = [QT.Q4_K, QT.Q5_K, QT.Q6_K]
F16_SCALES = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q5_0: (0,), QT.Q4_1: (0, 2), QT.Q5_1: (0, 2),
              QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q2_K: (80, 82)}


def random_blocks(rows: int, cols: int, qtype, seed: int, scale: float = 2e-4) -> np.ndarray:
    """Rows of GGML blocks with random quants and small random f16 scales."""
    n, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // n, size), dtype=np.uint8)
    for at in F16_SCALES[qtype]:
        d = (scale * rng.uniform(0.5, 1.5, len(blocks))).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // n * size)


def logits_ref(folder, name, ids):
    """transformers on the same GGUF file (dequantized by the gguf package), in float64."""
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float64).eval()
    # Unpacked into plain float64 weights (transformers keeps blocks packed,
    # computing in float32, only where a GGUF matmul kernel is installed).
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def assert_close(ours, ref, atol=1e-4, rtol=1e-4):
    err = np.abs(ours - ref) / (atol + rtol * np.abs(ref))
    assert err.max() <= 1.0, f"max err/bound {err.max():.3f}"


@pytest.mark.parametrize("qtype", GGUF_QUANTIZED, ids=lambda q: q.name)
def test_float_activations_match_transformers(qtype, tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama-gqa")
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    write_gguf(tmp_path / "m.gguf", folder, synthetic_vocab(vocab_size), qtype=qtype)
    ids = [(i * 37 + 5) % vocab_size for i in range(13)]
    model = Model.from_pretrained(tmp_path / "m.gguf", activations="f32", threads=2)
    assert model.weight_types == {qtype.name.lower(): sum(model.weight_types.values())}
    assert_close(model.logits(ids), logits_ref(tmp_path, "m.gguf", ids))


def k_quant_checkpoint(tmp_path, tiny_model_dir):
    """A tiny llama whose rows are whole 256-value superblocks."""
    from transformers import AutoConfig
    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                  tie_word_embeddings=False, max_position_embeddings=256,
                                  rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path / "hf"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_mixed_types_match_transformers(tiny_model_dir, tmp_path):
    """Every tensor in a type of its own, K-quants included, as in a Q4_K_M file."""
    folder = k_quant_checkpoint(tmp_path, tiny_model_dir)
    types = K_QUANTS + GGUF_QUANTIZED[:-1]
    chosen = {}

    def quantize(name, data):
        qtype = types[len(chosen) % len(types)]
        chosen[name] = qtype
        # A larger scale in the head spreads the logits, so that the bound of
        # 1e-4 is small beside their differences.
        scale = 1e-2 if name == "output.weight" else 2e-4
        return random_blocks(*data.shape, qtype, seed=len(chosen), scale=scale), qtype

    write_gguf(tmp_path / "m.gguf", folder, synthetic_vocab(300), quantize=quantize)
    assert set(chosen.values()) == set(types)
    ids = [(i * 37 + 5) % 300 for i in range(11)]
    ref = logits_ref(tmp_path, "m.gguf", ids)
    assert ref.std(axis=-1).min() > 1.0
    exact = Model.from_pretrained(tmp_path / "m.gguf", activations="f32", threads=2)
    assert set(exact.weight_types) == {t.name.lower() for t in types}
    got = exact.logits(ids)
    assert_close(got, ref)
    # int8 activations: near, and the same whatever the threads and however the prompt is split.
    fast = Model.from_pretrained(tmp_path / "m.gguf", threads=2)
    one = fast.logits(ids)
    assert np.abs(one - ref).max() <= 0.05 * np.abs(ref).max()
    fast.threads = 1
    s = fast.new_session()
    s.prefill(ids[:4])
    s.extend(ids[4:9])
    assert np.array_equal(s.extend(ids[9:]), one[-1])


def test_unsupported_type_is_dequantized_with_a_warning(tmp_path, tiny_model_dir):
    folder = k_quant_checkpoint(tmp_path, tiny_model_dir)
    write_gguf(tmp_path / "m.gguf", folder, synthetic_vocab(300),
               quantize=lambda name, data: (random_blocks(*data.shape, QT.Q2_K, 1, 1e-3), QT.Q2_K))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with pytest.warns(DequantizedTypeWarning, match="Q2_K"):
        model = Model.from_pretrained(tmp_path / "m.gguf", threads=2)
    assert model.weight_types == {"f32": sum(model.weight_types.values())}
    assert_close(model.logits(ids), logits_ref(tmp_path, "m.gguf", ids))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZED, ids=lambda q: q.name)
def test_nan_scale_is_refused(qtype, tmp_path, tiny_model_dir):
    folder = tiny_model_dir("llama-gqa")

    def quantize(name, data):
        if qtype == QT.F16:
            values = data.astype(np.float16)
            if name == "blk.1.ffn_up.weight":
                values[3, 7] = np.nan
            return values.view(np.uint8), qtype
        blocks = random_blocks(*data.shape, qtype, 2)
        if name == "blk.1.ffn_up.weight":
            at = F16_SCALES[qtype][-1]
            blocks[3, at:at + 2] = np.array([np.nan], np.float16).view(np.uint8)
        return blocks, qtype

    write_gguf(tmp_path / "m.gguf", folder, synthetic_vocab(300), quantize=quantize)
    with pytest.raises(ModelFileError, match="blk.1.ffn_up.weight.*NaN"):
        Model.from_pretrained(tmp_path / "m.gguf", threads=2)


@pytest.fixture(scope="module")
def default_models(smollm2_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return (Model.from_pretrained(threads=2), Model.from_pretrained(threads=2, activations="f32"),
                Model.from_pretrained(smollm2_dir, threads=2))


def test_default_model_runs_its_own_q4_1(default_models):
    native, _, reference = default_models
    assert native.dtype == "q4_1" and set(native.weight_types) == {"q4_1", "q8_0"}
    # Quantized in memory: about the file's size, not the 540 MB of float32.
    assert native.weight_bytes < 110 * 2**20 < reference.weight_bytes
    # Named by its file (the server's model id), not by the cache folder of its tokenizer.
    assert native.name == "SmolLM2-135M-Instruct.Q4_1" and reference.name == reference.path.name


def test_default_model_float_activations_are_the_f32_model(default_models):
    """The dequantized weights, exactly: the results of the float32 folder made from the same file."""
    _, exact, reference = default_models
    ids = exact.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it rests. " * 4)
    assert np.array_equal(exact.logits(ids), reference.logits(ids))


def test_default_model_int8_activations_stay_close(default_models):
    native, _, reference = default_models
    text = ("Paris is the capital and most populous city of France. Situated on the Seine River, in the "
            "north of the country, it is at the heart of the Ile-de-France region. The city is a major "
            "centre of finance, diplomacy, commerce, culture, fashion and gastronomy. "
            "The river divides the city into the Right Bank to the north and the Left Bank to the south. "
            "Its bridges, quays and islands have drawn painters and writers for centuries, and its museums "
            "hold collections that visitors cross the world to see. The metro, opened in 1900, carries "
            "millions of passengers every day, and the main railway stations link the city with the rest "
            "of Europe. In the nineteenth century the prefect Haussmann rebuilt much of the centre, laying "
            "out wide boulevards, parks and squares, and building the sewers and aqueducts that still "
            "serve it. Water for the fountains came from springs far outside the walls. Today the region "
            "produces nearly a third of the national economy, and the city hosts the headquarters of many "
            "international organisations. Every summer the streets along the river are closed to cars and "
            "turned into beaches, with sand, deck chairs and music until late in the evening.")
    ids = native.tokenizer.encode(text)
    got, ref = native.logits(ids), reference.logits(ids)
    p = np.exp(ref - ref.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    logq = got - got.max(1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(1, keepdims=True))
    kl = (p * (np.log(p + 1e-30) - logq)).sum(1)
    top1 = (got.argmax(1) == ref.argmax(1)).mean()
    print(f"int8 vs f32 on {len(ids)} tokens: top-1 agreement {top1:.3f}, mean KL {kl.mean():.5f}")
    # Measured on these 244 tokens: top-1 0.963-0.971 (7 to 9 differ) and
    # mean KL 0.0025-0.0027 on the avx512, avx2 and generic paths; the bounds
    # allow about twice the disagreement and twice the divergence.
    assert top1 >= 0.94 and kl.mean() < 0.005
    # The greedy choice is the same wherever the float32 model's has a clear margin.
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= 1.0
    assert clear.sum() >= len(ids) // 3   # 121 of the 244
    assert np.array_equal(got.argmax(1)[clear], ref.argmax(1)[clear])


def test_default_model_batch_and_threads_invariant(default_models):
    native, _, _ = default_models
    ids = native.tokenizer.encode("One two three four five six seven eight nine ten eleven twelve.")
    whole = native.logits(ids)
    native.threads = 1
    try:
        s = native.new_session()
        last = s.prefill(ids[:5])
        for i in range(5, len(ids), 5):
            last = s.extend(ids[i:i + 5])
        assert np.array_equal(last, whole[-1])
    finally:
        native.threads = 2


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
def test_packing_in_chunks_is_packing_whole(qtype):
    from fastllm.core import _core
    blocks = random_blocks(100, 512, qtype, seed=3)    # 100 rows: the last panel is partial
    whole = _core.pack(blocks, dtype=qtype.name.lower(), K=512)
    chunked = _core.pack_in_chunks(lambda first, n: blocks[first:first + n], 100, 512, qtype.name.lower(), 32)
    assert np.array_equal(chunked.data, whole.data)
    with pytest.raises(ValueError, match="multiple of 16"):
        _core.pack_in_chunks(lambda first, n: blocks[first:first + n], 100, 512, qtype.name.lower(), 24)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K],
                         ids=lambda q: q.name)
def test_packed_weights_take_no_more_bytes_than_the_file(qtype):
    """Whole panels of every block type take the bytes of GGML's blocks: a
    model's packed weights (its memory, the bytes a token streams) are no
    larger than its file. Q4_K and Q5_K keep the file's 6-bit scales."""
    from fastllm.core import _core
    blocks = random_blocks(32, 512, qtype, seed=1)
    assert _core.pack(blocks, dtype=qtype.name.lower(), K=512).data.nbytes == blocks.nbytes


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K],
                         ids=lambda q: q.name)
def test_finite_finds_a_bad_f16_scale_in_any_block(qtype):
    """_core.finite, the load's check of every weight: a NaN or infinity in
    either f16 field of a block (d; m or dmin), in the first block, at the
    edge of a thread's chunk of 65,536 blocks or in the last, is found at
    any thread count; the quants, integers, are not read as scales; the
    largest finite scale passes."""
    from fastllm.core import _core
    dtype = qtype.name.lower()
    n, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(140_001, n, qtype, seed=5)       # one block a row
    quants = np.ones(size, bool)
    for at in F16_SCALES[qtype]:
        quants[at:at + 2] = False
    blocks[:, quants] = 0xFF     # read as an f16 these would be NaN
    for threads in (1, 3):
        assert _core.finite(blocks, dtype, threads)
    for at in F16_SCALES[qtype]:
        for row in (0, 65_535, 65_536, 140_000):
            for value in (np.inf, -np.inf, np.nan, 65504.0):
                poisoned = blocks.copy()
                poisoned[row, at:at + 2] = np.array([value], np.float16).view(np.uint8)
                for threads in (1, 3):
                    assert _core.finite(poisoned, dtype, threads) == (value == 65504.0), (at, row, value)
    with pytest.raises(ValueError, match="whole"):
        _core.finite(blocks.reshape(-1)[:-1], dtype)
    with pytest.raises(TypeError, match="uint8"):
        _core.finite(blocks.view(np.uint16), dtype)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_finite_finds_a_bad_float_anywhere(dtype):
    from fastllm.core import _core
    rng = np.random.default_rng(7)
    values = rng.standard_normal(200_003).astype(np.float32)
    values[5] = np.finfo(np.float32).max if dtype == "f32" else 65504.0
    as_stored = {"f32": lambda v: v, "bf16": lambda v: (v.view(np.uint32) >> 16).astype(np.uint16),
                 "f16": lambda v: v.astype(np.float16)}[dtype]
    assert _core.finite(as_stored(values), dtype, 2)
    for at in (0, 65_535, 65_536, 200_002):
        for value in (np.inf, -np.inf, np.nan):
            poisoned = values.copy()
            poisoned[at] = value
            for threads in (1, 3):
                assert not _core.finite(as_stored(poisoned), dtype, threads), (at, value)
    with pytest.raises(TypeError):
        _core.finite(values, "bf16")


def test_lm_head_read_in_chunks_gives_the_same_logits(tmp_path, tiny_model_dir, monkeypatch):
    """The LM head is read and packed a chunk of rows at a time (here 16
    rows, a panel, as small as chunks go): same logits; a NaN scale in a
    later chunk is still refused."""
    import fastllm.load.weights
    folder = k_quant_checkpoint(tmp_path, tiny_model_dir)
    write_gguf(tmp_path / "m.gguf", folder, synthetic_vocab(300),
               quantize=lambda name, data: (random_blocks(*data.shape, QT.Q6_K, 4, 1e-2), QT.Q6_K))
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    whole = Model.from_pretrained(tmp_path / "m.gguf", threads=2).logits(ids)
    monkeypatch.setattr(fastllm.load.weights, "_HEAD_CHUNK_BYTES", 1)
    assert np.array_equal(Model.from_pretrained(tmp_path / "m.gguf", threads=2).logits(ids), whole)

    def poisoned(name, data):
        blocks = random_blocks(*data.shape, QT.Q6_K, 4, 1e-2)
        if name == "output.weight":
            blocks[250, 208:210] = np.array([np.inf], np.float16).view(np.uint8)
        return blocks, QT.Q6_K

    write_gguf(tmp_path / "bad.gguf", folder, synthetic_vocab(300), quantize=poisoned)
    with pytest.raises(ModelFileError, match="output.weight.*NaN or infinite"):
        Model.from_pretrained(tmp_path / "bad.gguf", threads=2)
