"""The packed-weights cache (fastllm.load.pack_cache): a load from the cache file
holds the very bytes an uncached load packs, for quantized GGUF files,
f32/bf16/quantized-at-load folders and mixtures of experts; a damaged,
truncated, stale or foreign file is noticed and rebuilt; two processes
filling one cache at once both get whole weights; it can be turned off."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.core import _core
from fastllm.load import pack_cache
from fastllm.spec.config import ModelConfig

DATA = Path(__file__).resolve().parent / "data"
QUANTIZED = DATA / "llama-family" / "llama2-256-Q4_K_M.gguf"
MOE = DATA / "moe-gguf" / "wide-Q4_K_M.gguf"
MOE_FOLDER = DATA / "moe-gguf" / "qwen3moe"
IDS = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A FASTLLM_HOME of the test's own, with the cache on."""
    monkeypatch.setenv("FASTLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FASTLLM_PACK_CACHE", "1")
    return tmp_path / "home"


def leaves(tree, path="") -> dict:
    """{where: (kind, dtype, shape, bytes)} of every array and Matrix of a weights tree."""
    out = {}
    if isinstance(tree, _core.Matrix):
        out[path] = ("matrix", tree.dtype, tree.shape, tree.packed, np.asarray(tree.data).tobytes())
    elif isinstance(tree, np.ndarray):
        out[path] = ("array", tree.dtype.str, tree.shape, tree.tobytes())
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(leaves(v, f"{path}/{k}"))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.update(leaves(v, f"{path}/{i}"))
    else:
        out[path] = ("value", tree)
    return out


def packed(source, dtype, use):
    """(weights tree, types, cache file) as Model.from_pretrained gets them."""
    from fastllm.formats.gguf import read_gguf_model
    from fastllm.generate.model import _packed_weights
    source = Path(source)
    if dtype == "gguf":
        header = read_gguf_model(source)
        return _packed_weights(header.config, header, dtype, use)[:3]
    return _packed_weights(ModelConfig.from_file(source / "config.json"), source, dtype, use)[:3]


MTP = DATA / "qwen35-gguf" / "mtp-BF16.gguf"   # a multi-token-prediction block beside the model
CASES = [(QUANTIZED, "gguf"), (MOE, "gguf"), (MTP, "gguf"), ("tiny:llama", "f32"), ("tiny:llama", "bf16"),
         ("tiny:llama", "q4_k_m"), (MOE_FOLDER, "f32"), (MOE_FOLDER, "q8_0")]


@pytest.mark.parametrize("source,dtype", CASES, ids=lambda c: getattr(c, "name", c))
def test_cached_weights_are_the_bytes_an_uncached_load_packs(source, dtype, home, tiny_model_dir):
    if source == "tiny:llama":
        source = tiny_model_dir("llama-gqa")
    plain, types, none = packed(source, dtype, False)
    assert none is None and not home.exists() or not list((home / "packed").glob("*.flmpack"))
    first, types1, written = packed(source, dtype, True)      # packs, writes, maps
    again, types2, hit = packed(source, dtype, True)          # maps
    assert written is not None and hit == written and written.stat().st_mode & 0o222 == 0
    assert types1 == types2 == types
    want = leaves(plain)
    assert leaves(first) == want and leaves(again) == want
    assert ("mtp" in plain) == (source == MTP)
    # mapped from the file, read-only
    mapped = [m for m in _matrices(again)]
    assert mapped and not any(np.asarray(m.data).flags.writeable for m in mapped)


def _matrices(tree):
    if isinstance(tree, _core.Matrix):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _matrices(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _matrices(v)


@pytest.mark.parametrize("source", [QUANTIZED, MTP], ids=lambda p: p.name)
def test_a_model_from_the_cache_gives_the_same_logits(source, home):
    want = Model.from_pretrained(source, threads=2, n_ctx=64, pack_cache=False).logits(IDS)
    first = Model.from_pretrained(source, threads=2, n_ctx=64)
    second = Model.from_pretrained(source, threads=2, n_ctx=64)
    assert first.pack_cache_file is not None and second.pack_cache_file == first.pack_cache_file
    assert np.array_equal(first.logits(IDS), want) and np.array_equal(second.logits(IDS), want)
    assert (second._mtp is not None) == (source == MTP)


def only_file(home) -> Path:
    files = list((home / "packed").glob("*.flmpack"))
    assert len(files) == 1, files
    return files[0]


def rewrite(path: Path, change) -> None:
    data = bytearray(path.read_bytes())
    data = change(data)
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def flip(at):
    """A change that flips one bit of the byte at(data)."""
    def change(data):
        data[at(data)] ^= 0x10
        return data
    return change


def data_offset(data) -> int:
    return int.from_bytes(data[16:24], "little")


def manifest_offset(data) -> int:
    """The manifest follows the data."""
    return data_offset(data) + int.from_bytes(data[24:32], "little")


DAMAGE = {
    "truncated": lambda d: d[:len(d) - 4096],
    "grown": lambda d: d + b"\0" * 64,
    "empty": lambda d: bytearray(),
    "header": flip(lambda d: 20),
    "manifest": flip(lambda d: manifest_offset(d) + 5),
    "data, first byte": flip(data_offset),
    "data, middle": flip(lambda d: (data_offset(d) + len(d)) // 2),
    "data, last byte": flip(lambda d: manifest_offset(d) - 1),
    "manifest, last byte": flip(lambda d: len(d) - 1),
    "magic": flip(lambda d: 0),
    "not a cache": lambda d: bytearray(b"GGUF" + bytes(len(d) - 4)),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_file_is_noticed_and_rebuilt(damage, home, capfd):
    want = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64, pack_cache=False).logits(IDS)
    Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    path = only_file(home)
    rewrite(path, DAMAGE[damage])
    capfd.readouterr()
    model = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    assert "cannot be used" in capfd.readouterr().err
    assert np.array_equal(model.logits(IDS), want)
    assert only_file(home) == path and path.stat().st_mode & 0o222 == 0
    assert Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64).pack_cache_file == path   # whole again


def data_checksums(monkeypatch) -> list:
    """The sizes of the buffers of more than a page that pack_cache checksums from now on."""
    seen, real = [], _core.checksum
    def spy(data, *a, **k):
        if len(data) > 4096:
            seen.append(len(data))
        return real(data, *a, **k)
    monkeypatch.setattr(_core, "checksum", spy)
    return seen


@pytest.mark.skipif(pack_cache._boot() is None, reason="the system does not name its boot")
def test_a_file_checked_whole_is_not_read_again_until_it_changes(home, monkeypatch, capfd):
    monkeypatch.setattr(pack_cache, "_SETTLED_NS", 0)   # no wait for the file's times to settle
    want = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64, pack_cache=False).logits(IDS)
    Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)   # made, then mapped and checked whole
    path = only_file(home)
    assert (path.parent / (path.name + pack_cache.CHECKED)).exists()
    sums = data_checksums(monkeypatch)
    model = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    assert sums == [] and model.pack_cache_file == path and np.array_equal(model.logits(IDS), want)
    time.sleep(0.05)   # past the tick of the clock that stamps the file's times
    st = path.stat()
    rewrite(path, DAMAGE["data, middle"])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))   # its modification time put back
    capfd.readouterr()
    model = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    assert "its data is damaged" in capfd.readouterr().err
    assert np.array_equal(model.logits(IDS), want)


@pytest.mark.parametrize("record", ["not json", "[" * 100000, " " * 5000 + "[]", '{"boot": 1}'])
def test_a_malformed_record_only_means_the_file_is_read_whole(record, home, monkeypatch):
    Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    path = only_file(home)
    (path.parent / (path.name + pack_cache.CHECKED)).write_text(record)
    sums = data_checksums(monkeypatch)
    want = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64, pack_cache=False).logits(IDS)
    assert np.array_equal(Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64).logits(IDS), want)
    assert len(sums) == 1


@pytest.mark.parametrize("settled", [False, True])
def test_a_record_from_another_boot_or_of_a_new_file_is_not_trusted(settled, home, monkeypatch):
    """A file younger than _SETTLED_NS gets no record; one from before
    the machine's last boot is read whole again."""
    if settled:
        monkeypatch.setattr(pack_cache, "_SETTLED_NS", 0)
    monkeypatch.setattr(pack_cache, "_boot", lambda: "the boot before")
    Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    path = only_file(home)
    assert (path.parent / (path.name + pack_cache.CHECKED)).exists() == settled
    monkeypatch.setattr(pack_cache, "_boot", lambda: "this boot")
    sums = data_checksums(monkeypatch)
    Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    assert len(sums) == 1


@pytest.mark.parametrize("field,value", [("format", 999), ("layout", -1), ("simd", "another"),
                                         ("machine", "elsewhere"), ("code", "another build")])
def test_a_cache_from_another_version_or_machine_is_rebuilt(field, value, home, monkeypatch, capfd):
    real = pack_cache.key
    monkeypatch.setattr(pack_cache, "key", lambda s, o: dict(real(s, o), **{field: value}))
    Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    monkeypatch.setattr(pack_cache, "key", real)
    capfd.readouterr()
    model = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    assert "another fastllm build or machine" in capfd.readouterr().err
    assert model.pack_cache_file == only_file(home)


def test_each_simd_path_keeps_a_cache_file_of_its_own(home, simd_path, capfd):
    # A BF16 file run with FASTLLM_SIMD=avx512_bf16, then without, must not
    # make the model's one file anew at every switch.
    best = _core.simd_path()
    if best == "generic":
        pytest.skip("this CPU has no SIMD path but the portable one")
    files = {}
    for path in ("generic", best, "generic", best):
        simd_path(path)
        capfd.readouterr()
        model = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
        assert "cannot be used" not in capfd.readouterr().err
        files.setdefault(path, model.pack_cache_file)
        assert model.pack_cache_file == files[path]
    assert files["generic"] != files[best]
    assert sorted((home / "packed").glob("*.flmpack")) == sorted(files.values())


def test_a_changed_source_replaces_its_cache(home, tmp_path, capfd):
    src = tmp_path / "m.gguf"
    src.write_bytes(QUANTIZED.read_bytes())
    first = Model.from_pretrained(src, threads=2, n_ctx=64)
    want = first.logits(IDS)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))    # touched: rebuilt, same weights
    capfd.readouterr()
    second = Model.from_pretrained(src, threads=2, n_ctx=64)
    assert "made from another file" in capfd.readouterr().err
    assert second.pack_cache_file == first.pack_cache_file == only_file(home)
    assert np.array_equal(second.logits(IDS), want)


def test_cache_files_of_deleted_sources_are_removed(home, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(QUANTIZED.read_bytes())
    b.write_bytes(QUANTIZED.read_bytes())
    of_a = Model.from_pretrained(a, threads=2, n_ctx=64).pack_cache_file
    a.unlink()
    stale = of_a.parent / ("gone" + pack_cache.SUFFIX + pack_cache.CHECKED)
    stale.write_text("[]")   # the record of a cache file someone deleted
    of_b = Model.from_pretrained(b, threads=2, n_ctx=64).pack_cache_file
    assert not of_a.exists() and of_b.exists() and not stale.exists()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_cache_can_be_turned_off(how, home, monkeypatch):
    if how == "environment":
        monkeypatch.setenv("FASTLLM_PACK_CACHE", "0")
        model = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    else:
        model = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64, pack_cache=False)
    assert model.pack_cache_file is None
    assert not (home / "packed").exists() or not list((home / "packed").iterdir())


def test_an_unwritable_cache_folder_only_warns(home):
    home.mkdir()
    (home / "packed").write_text("a file where the folder would be")
    want = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64, pack_cache=False).logits(IDS)
    with pytest.warns(pack_cache.PackCacheWarning, match="could not be cached"):
        model = Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    assert model.pack_cache_file is None and np.array_equal(model.logits(IDS), want)


def test_warnings_of_the_packing_load_come_again_from_the_cache(home, tmp_path, tiny_model_dir):
    """A file whose Q2_K tensors are dequantized at load says so, from the cache as when packed."""
    import gguf
    from fastllm.load.weights import DequantizedTypeWarning
    from test_quantized_gguf import k_quant_checkpoint, random_blocks, synthetic_vocab, write_gguf
    QT = gguf.GGMLQuantizationType
    write_gguf(tmp_path / "m.gguf", k_quant_checkpoint(tmp_path, tiny_model_dir), synthetic_vocab(300),
               quantize=lambda name, data: (random_blocks(*data.shape, QT.Q2_K, 1, 1e-3), QT.Q2_K))
    with pytest.warns(DequantizedTypeWarning, match="Q2_K"):
        Model.from_pretrained(tmp_path / "m.gguf", threads=2, n_ctx=64)
    with pytest.warns(DequantizedTypeWarning, match="Q2_K"):
        assert Model.from_pretrained(tmp_path / "m.gguf", threads=2, n_ctx=64).pack_cache_file is not None


CONCURRENT = r"""
import sys, numpy as np
from fastllm import Model
m = Model.from_pretrained(sys.argv[1], threads=1, n_ctx=64)
np.save(sys.argv[2], m.logits([3, 1, 4, 1, 5, 9, 2, 6]))
print(m.pack_cache_file)
"""


def test_two_processes_filling_one_cache_both_load_whole_weights(home, tmp_path):
    want = Model.from_pretrained(MOE, threads=2, n_ctx=64, pack_cache=False).logits(IDS)
    env = dict(os.environ, FASTLLM_HOME=str(home), FASTLLM_PACK_CACHE="1")
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(MOE), str(tmp_path / f"{i}.npy")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    files = {out.strip() for out, _ in outs}
    assert files == {str(only_file(home))}
    for i in range(3):
        assert np.array_equal(np.load(tmp_path / f"{i}.npy"), want)
    assert not list((home / "packed").glob(".*.tmp"))


def test_info_shows_the_cache(home, capsys):
    from fastllm.cli.main import main
    assert main(["info", "-m", str(QUANTIZED), "--ctx", "64"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("packed weights cache"))
    assert str(only_file(home)) in line and "MiB" in line
    assert main(["info", "-m", str(QUANTIZED), "--ctx", "64", "--no-cache"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("packed weights cache"))
    assert line.split()[3] == "off" and "1 file" in line


def test_checksum_is_the_same_for_any_thread_count():
    data = np.random.default_rng(0).integers(0, 256, (5 << 20) + 77, dtype=np.uint8)
    sums = {_core.checksum(data, n) for n in (1, 2, 3, 8)}
    assert len(sums) == 1
    data[3 << 20] ^= 1
    assert _core.checksum(data) not in sums
    assert _core.checksum(data[:0]) != _core.checksum(data[:1])


# ------------------------------------------------------------ tokenizers

TEXTS = ["Hello world, héllo 日本 <|im_start|>user\n", "  def f(x):\n\treturn x**2  # ok", "🙂🙃 \u00e9\u0301 ZZZZZZ",
         "<|endoftext|><|im_end|> trailing   "]


def test_a_large_tokenizer_from_its_compact_form_encodes_and_decodes_as_from_json(home, request, monkeypatch):
    """The Qwen3.5 tokenizer (248k tokens, 247k merges, 7 MB of JSON): kept
    compact on its first load, then read from there, with the very same
    vocabulary, merges and results as the JSON gives."""
    from fastllm.tokenizer import Tokenizer
    from oracles import qwen_tokenizers
    folder = qwen_tokenizers.build("qwen3.5", request.config.cache.mkdir("fastllm_qwen_tokenizers"))
    monkeypatch.setenv("FASTLLM_PACK_CACHE", "0")
    plain = Tokenizer.from_pretrained(folder)
    monkeypatch.setenv("FASTLLM_PACK_CACHE", "1")
    first = Tokenizer.from_pretrained(folder)
    compact = Tokenizer.from_pretrained(folder)
    assert [p.name for p in (home / "packed").glob("tokenizer.json-*.flmpack")]
    assert compact.model.merges is None and compact.model.vocab.items() == plain.model.vocab.items()
    for tok in (first, compact):
        for text in TEXTS:
            ids = plain.encode(text)
            assert tok.encode(text) == ids and tok.decode(ids) == plain.decode(ids)
        assert len(tok.model.table) == len(plain.model.table)


def test_a_tokenizer_that_cannot_be_kept_compact_loads_as_before(home, tmp_path):
    """A BPE tokenizer.json with a merge naming an unknown token: read from
    the JSON each time, and its error where it always was (the first
    encode)."""
    from fastllm.tokenizer import Tokenizer, TokenizerError
    vocab = {f"t{i}": i for i in range(60000)} | {"a": 60000, "b": 60001}
    spec = {"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": ["a b"]}}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec) + " " * (1 << 20))
    for _ in range(2):
        tok = Tokenizer.from_file(path)
        with pytest.raises(TokenizerError, match="'ab' is not in the vocabulary"):
            tok.encode("ab")
    assert not list((home / "packed").glob("tokenizer.json-*.flmpack"))


def test_a_load_interrupted_while_it_writes_the_cache_leaves_no_file(home, monkeypatch):
    """Ctrl-C (or a timeout) while the file is checksummed: the interrupt
    comes through as itself, and neither the file nor its temporary stays."""
    real = pack_cache._seal

    def interrupted(arena, path, manifest):
        monkeypatch.setattr(pack_cache._core, "checksum", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        try:
            real(arena, path, manifest)
        finally:
            monkeypatch.undo()
    monkeypatch.setattr(pack_cache, "_seal", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Model.from_pretrained(QUANTIZED, threads=2, n_ctx=64)
    assert not [p for p in (home / "packed").iterdir() if not p.name.endswith(".lock")]
