"""Bad model files get a clear ModelFileError naming the file, never a hang,
a crash or a silently wrong model."""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest

from fastllm.load import hub
from fastllm.spec.errors import ModelFileError
from fastllm.spec.files import check_regular, open_regular, read_at, read_bounded
from fastllm.formats.gguf import convert_gguf
from fastllm.formats.gguf_file import read_gguf, read_string_arrays
from fastllm.formats.safetensors import Checkpoint, SafetensorsFile, json_depth, load_file, save_file

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def test_read_bounded_reads_a_regular_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"{}")
    assert read_bounded(p, 2, "config.json") == b"{}"


def test_read_bounded_refuses_a_file_past_the_limit(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"{ }")
    with pytest.raises(ModelFileError, match=r"config.json.*3 bytes.*more than the 2"):
        read_bounded(p, 2, "config.json")


@needs_fifo
@pytest.mark.parametrize("offset, length", [(0, 5), (3, 40 << 20), (1 << 20, 9 << 20), (7, (48 << 20) - 7),
                                            ((48 << 20) - 100, 100), (0, 48 << 20), (5, 48 << 20),
                                            ((40 << 20) + 1, 16 << 20), (48 << 20, 10)])
def test_read_at_reads_what_a_plain_read_does_and_stops_at_the_end(tmp_path, offset, length):
    """read_at, which splits big reads among threads in pieces of 8 MiB:
    the same bytes as seek and read, and where the file ends first, its
    bytes up to the end and their count."""
    data = np.random.default_rng(1).integers(0, 256, 48 << 20, dtype=np.uint8)
    p = tmp_path / "model.gguf"
    data.tofile(p)
    out = np.full(length, 7, np.uint8)
    with open_regular(p, "GGUF file") as f:
        got = read_at(f, out, offset)
    want = data[offset:offset + length]
    assert got == len(want)
    assert np.array_equal(out[:got], want) and np.all(out[got:] == 7)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    p = tmp_path / "model.safetensors"
    os.mkfifo(p)
    with pytest.raises(ModelFileError, match="FIFO"):
        read_bounded(p, 100, "model.safetensors")
    with pytest.raises(ModelFileError, match="FIFO"):
        check_regular(p, "model.safetensors")


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_a_device_is_refused():
    with pytest.raises(ModelFileError, match="character device"):
        read_bounded("/dev/zero", 100, "config.json")


def test_a_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelFileError, match=r"nope: config.json not found"):
        read_bounded(tmp_path / "nope", 100, "config.json")


# ---------------------------------------------------------------- safetensors


def _write_st(path, header, data=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _entry(shape, begin, end, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_overlapping_tensors_are_refused(tmp_path):
    p = _write_st(tmp_path / "x.safetensors",
                  {"q": _entry([2], 0, 8), "k": _entry([2], 4, 12)}, bytes(12))
    with pytest.raises(ModelFileError, match=r"'q' and 'k' overlap"):
        SafetensorsFile(p)


@pytest.mark.parametrize("dim", [2.9, True, "2", None, -0.0])
def test_a_dimension_that_is_not_an_integer_is_refused(tmp_path, dim):
    p = _write_st(tmp_path / "x.safetensors", {"w": _entry([dim, 1], 0, 8)}, bytes(8))
    with pytest.raises(ModelFileError, match=r"'w': shape is not a list of integers"):
        SafetensorsFile(p)


@pytest.mark.parametrize("offsets", [[0, 8.0], [0], [0, 8, 8], [True, 8], "0,8"])
def test_offsets_that_are_not_two_integers_are_refused(tmp_path, offsets):
    p = _write_st(tmp_path / "x.safetensors",
                  {"w": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}, bytes(8))
    with pytest.raises(ModelFileError, match="data_offsets is not a list of two integers"):
        SafetensorsFile(p)


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, None, "F8"])
def test_a_dtype_that_is_not_a_known_name_is_refused(tmp_path, dtype):
    p = _write_st(tmp_path / "x.safetensors", {"w": _entry([2], 0, 8, dtype=dtype)}, bytes(8))
    with pytest.raises(ModelFileError, match=r"'w': unsupported dtype"):
        SafetensorsFile(p)


def test_a_shape_whose_size_wraps_64_bits_is_refused(tmp_path):
    # 2**32 * 2**32 * 4 bytes is 0 modulo 2**64: an int64 product called it empty.
    p = _write_st(tmp_path / "x.safetensors", {"w": _entry([2**32, 2**32], 0, 0)})
    with pytest.raises(ModelFileError, match=r"'w': data_offsets \[0, 0\] do not hold"):
        SafetensorsFile(p)


def test_a_deeply_nested_header_is_refused_before_parsing(tmp_path):
    p = _write_st(tmp_path / "x.safetensors", b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ModelFileError, match="nested 100000 levels deep"):
        SafetensorsFile(p)


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth(b'{"a": {"shape": [1, 2]}}') == 3
    assert json_depth(b'{"[[[": "]\\"[[[{{"}') == 1
    assert json_depth(b'{"a\\\\": [[1]]}') == 3
    assert json_depth(b"") == 0


def test_a_header_longer_than_the_file_is_refused(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(ModelFileError, match="does not fit in a file of 10 bytes"):
        SafetensorsFile(p)


def test_metadata_that_is_not_an_object_is_refused(tmp_path):
    p = _write_st(tmp_path / "x.safetensors", {"__metadata__": [1]})
    with pytest.raises(ModelFileError, match="__metadata__ is not a JSON object"):
        SafetensorsFile(p)


def test_read_gives_a_copy_and_notices_a_truncated_file(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file(p, {"a": np.arange(4, dtype=np.float32), "b": np.arange(6, dtype=np.int64)})
    f = SafetensorsFile(p)
    a = f.read("a")
    assert a.flags.writeable and a.flags.owndata
    assert np.array_equal(a, np.arange(4))
    with open(p, "r+b") as fh:
        fh.truncate(os.path.getsize(p) - 8)
    with pytest.raises(ModelFileError, match=r"'b': the file ends before the tensor does"):
        f.read("b")
    assert np.array_equal(a, np.arange(4))


# ------------------------------------------------------------ sharded index

def _sharded(tmp_path, weight_map):
    save_file(tmp_path / "a.safetensors", {"w": np.zeros(2, np.float32)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize("weight_map, problem", [
    (["a.safetensors"], "weight_map is a list, not an object"),
    ("a.safetensors", "weight_map is a str, not an object"),
    ({"w": 3}, r"weight_map\['w'\]: shard 3 is not a plain file name"),
    ({"w": "../a.safetensors"}, "is not a plain file name"),
    ({"w": ""}, "is not a plain file name"),
])
def test_a_malformed_weight_map_is_refused(tmp_path, weight_map, problem):
    folder = _sharded(tmp_path, weight_map)
    with pytest.raises(ModelFileError, match=problem) as e:
        Checkpoint(folder)
    assert "model.safetensors.index.json" in str(e.value)


def test_a_well_formed_index_loads(tmp_path):
    ck = Checkpoint(_sharded(tmp_path, {"w": "a.safetensors"}))
    assert np.array_equal(ck.file_of("w").read("w"), np.zeros(2))


# ----------------------------------------------------- non-regular files

def _finishes(fn, seconds=20):
    """What fn() returned or raised within seconds, run in a thread so that
    a hang fails the test instead of stopping the run."""
    outcome = []

    def run():
        try:
            outcome.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


@needs_fifo
def test_a_fifo_named_model_safetensors_is_refused(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors")
    err = _finishes(lambda: Checkpoint(tmp_path))
    assert isinstance(err, ModelFileError) and "FIFO" in str(err)


@needs_fifo
def test_a_fifo_named_as_the_index_is_refused(tmp_path):
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    err = _finishes(lambda: Checkpoint(tmp_path))
    assert isinstance(err, ModelFileError) and "FIFO" in str(err)


# ------------------------------------------------ weights C reads, NaN weights

def _copy_model(tiny_model_dir, kind, tmp_path, dtype="float32"):
    dst = tmp_path / kind
    shutil.copytree(tiny_model_dir(kind, dtype), dst)
    return dst


_TRUNCATE_THEN_RUN = """
import os, sys
import numpy as np
from fastllm import Model
folder = sys.argv[1]
m = Model.from_pretrained(folder, dtype=sys.argv[2])
before = m.logits([1, 2, 3])
path = os.path.join(folder, "model.safetensors")
with open(path, "r+b") as f:
    f.truncate(0)
after = m.logits([1, 2, 3])
assert np.array_equal(before, after), "logits changed after the file was truncated"
with open(path, "wb") as f:
    f.write(b"\\xff" * 4096)
assert np.array_equal(before, m.logits([1, 2, 3]))
print("ok")
"""


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_truncating_the_checkpoint_of_a_loaded_model_is_harmless(tiny_model_dir, tmp_path, dtype):
    # Untied head and separate embedding, norms, biases: every kind of
    # tensor the C loop reads. Run apart, so a SIGBUS fails the test only.
    folder = _copy_model(tiny_model_dir, "llama-headdim-bias", tmp_path)
    r = subprocess.run([sys.executable, "-c", _TRUNCATE_THEN_RUN, str(folder), dtype],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def _poison(folder, name, value, bf16=False):
    path = folder / "model.safetensors"
    tensors = {k: np.array(v) for k, v in load_file(path).items()}
    flat = tensors[name].reshape(-1)
    flat[flat.size // 2] = value
    save_file(path, tensors, bf16=bf16)


@pytest.mark.parametrize("name, value", [
    ("model.norm.weight", np.nan),
    ("model.layers.1.self_attn.k_proj.bias", -np.inf),
    ("lm_head.weight", np.inf),
    ("model.embed_tokens.weight", np.nan),
])
def test_nan_or_inf_weights_are_refused_at_load(tiny_model_dir, tmp_path, name, value):
    from fastllm import Model
    folder = _copy_model(tiny_model_dir, "llama-headdim-bias", tmp_path)
    _poison(folder, name, value)
    with pytest.raises(ModelFileError, match=rf"{name}.*NaN or infinite") as e:
        Model.from_pretrained(folder)
    assert "model.safetensors" in str(e.value)


def test_nan_in_a_bf16_checkpoint_is_refused(tiny_model_dir, tmp_path):
    from fastllm import Model
    folder = _copy_model(tiny_model_dir, "llama-gqa", tmp_path)
    _poison(folder, "model.layers.0.mlp.up_proj.weight", np.nan, bf16=True)
    for dtype in ("f32", "bf16"):
        with pytest.raises(ModelFileError, match="up_proj.weight.*NaN or infinite"):
            Model.from_pretrained(folder, dtype=dtype)


def test_a_float32_weight_too_large_for_bf16_is_refused_in_bf16_only(tiny_model_dir, tmp_path):
    from fastllm import Model
    folder = _copy_model(tiny_model_dir, "llama-gqa", tmp_path)
    _poison(folder, "model.layers.0.mlp.up_proj.weight", np.float32(3.4e38))
    Model.from_pretrained(folder, dtype="f32")
    with pytest.raises(ModelFileError, match="after conversion to the compute dtype"):
        Model.from_pretrained(folder, dtype="bf16")


# ---------------------------------------------------------------------- GGUF

SEEDS = os.path.join(os.path.dirname(__file__), "fuzz", "corpus")


def _gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _gguf(kvs=b"", n_kv=0, infos=b"", n_tensors=0, version=3, data=b""):
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs + infos
    return head + bytes(-len(head) % 32) + data


def _tensor_info(name, dims, ttype=0, offset=0):
    return _gstr(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
        struct.pack("<IQ", ttype, offset)


def _refused(tmp_path, data, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    gguf = pytest.importorskip("gguf")
    err = _finishes(lambda: read_gguf(p, gguf), seconds=20)
    assert isinstance(err, ModelFileError), repr(err)
    assert str(p) in str(err)
    assert re.search(match, str(err)), str(err)
    out = tmp_path / "out"
    with pytest.raises(ModelFileError, match=match):
        convert_gguf(p, out, progress=False)
    assert not out.exists()


def test_a_50_byte_gguf_claiming_2_to_the_40_array_elements_fails_at_once(tmp_path):
    kv = _gstr("a") + struct.pack("<IIQ", 9, 0, 2**40)
    data = _gguf(kv, n_kv=1)[:50]
    assert len(data) == 50
    _refused(tmp_path, data, r"metadata 'a' claims 1099511627776 uint8 elements")


@pytest.mark.parametrize("what, data, match", [
    ("key count", lambda: _gguf(n_kv=2**62), r"2\*\*62|4611686018427387904 metadata keys"),
    ("tensor count", lambda: _gguf(n_tensors=2**40), "1099511627776 tensors cannot fit"),
    ("string length", lambda: _gguf(_gstr("k") + struct.pack("<IQ", 8, 2**63), n_kv=1),
     r"metadata 'k' needs 9223372036854775808 bytes"),
    ("key length", lambda: _gguf(struct.pack("<Q", 2**50) + b"xx", n_kv=1),
     "the name of metadata key 0 needs"),
    ("nested array", lambda: _gguf(_gstr("k") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 0, 0), n_kv=1),
     "array of arrays"),
    ("value type", lambda: _gguf(_gstr("k") + struct.pack("<I", 77), n_kv=1), "unknown value type 77"),
    ("utf-8", lambda: _gguf(_gstr(b"k\xff") + struct.pack("<IB", 0, 1), n_kv=1), "not valid UTF-8"),
    ("duplicate key", lambda: _gguf((_gstr("k") + struct.pack("<IB", 0, 1)) * 2, n_kv=2), "'k' appears twice"),
    ("version", lambda: _gguf(version=1), "version 1 is not supported"),
    ("byte order", lambda: _gguf(version=3 << 24), "big-endian"),
    ("dims", lambda: _gguf(infos=_tensor_info("t", [1] * 5), n_tensors=1), "'t' has 5 dimensions"),
    ("tensor type", lambda: _gguf(infos=_tensor_info("t", [4], ttype=99), n_tensors=1), "unknown tensor type 99"),
    ("past the end", lambda: _gguf(infos=_tensor_info("t", [2**31, 2**31]), n_tensors=1, data=bytes(64)),
     r"'t': 18446744073709551616 bytes at data offset 0 run past the end"),
    ("offset past the end", lambda: _gguf(infos=_tensor_info("t", [4], offset=2**63), n_tensors=1, data=bytes(64)),
     "run past the end"),
    ("misaligned", lambda: _gguf(infos=_tensor_info("t", [4], offset=4), n_tensors=1, data=bytes(64)),
     "not a multiple of the alignment 32"),
    ("overlap", lambda: _gguf(infos=_tensor_info("a", [16]) + _tensor_info("b", [16], offset=32),
                              n_tensors=2, data=bytes(128)), "'a' and 'b' overlap"),
    ("duplicate tensor", lambda: _gguf(infos=_tensor_info("a", [4]) + _tensor_info("a", [4], offset=32),
                                       n_tensors=2, data=bytes(64)), "'a' appears twice"),
    ("block rows", lambda: _gguf(infos=_tensor_info("q", [33], ttype=8), n_tensors=1, data=bytes(64)),
     "rows of 33 values are not whole Q8_0 blocks of 32"),
])
def test_malformed_gguf_containers_are_refused(tmp_path, what, data, match):
    _refused(tmp_path, data(), match)


def test_the_gguf_reader_reads_what_the_writer_wrote():
    gguf = pytest.importorskip("gguf")
    path = os.path.join(SEEDS, "gguf", "tiny-q8_0")
    ours = read_gguf(path, gguf)
    theirs = gguf.GGUFReader(path)
    assert {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")} == ours.metadata
    assert [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.n_bytes, t.data_offset)
            for t in theirs.tensors] == [(t.name, t.tensor_type, t.dims, t.n_bytes, t.offset) for t in ours.tensors]


def test_string_arrays_decoded_later_are_those_a_full_walk_gives():
    gguf = pytest.importorskip("gguf")
    path = hub.default_gguf_path()
    bare = read_gguf(path, gguf, string_arrays=False)
    assert bare.metadata["tokenizer.ggml.tokens"] is None and bare.string_spans
    assert read_string_arrays(path, bare).metadata == read_gguf(path, gguf).metadata


def test_skipping_strings_stops_at_the_first_one_the_buffer_does_not_hold_whole():
    from fastllm.core._core import skip_strings
    buf = bytearray(_gstr("ab") + _gstr("") + _gstr("xyz"))
    assert skip_strings(buf, 0, 3) == (len(buf), 3)
    assert skip_strings(buf, 0, 2) == (10 + 8, 2)
    assert skip_strings(buf[:-1], 0, 3) == (18, 2)                 # the last one cut short
    assert skip_strings(buf[:21], 0, 3) == (18, 2)                 # its length cut short
    huge = bytearray(struct.pack("<Q", 2**64 - 1) + b"abc")
    assert skip_strings(huge, 0, 1) == (0, 0)                      # no wrap-around past the end
    assert skip_strings(buf, 10, 5) == (len(buf), 2)


def test_a_gguf_file_that_changed_since_its_header_was_walked_is_refused_by_name(tmp_path):
    """The vocabulary is decoded after the header's walk, from where that
    walk found it: a file cut short meanwhile, or whose strings are no
    longer UTF-8, is a GGUFError naming it, not a crash or a wrong vocabulary."""
    gguf = pytest.importorskip("gguf")
    p = tmp_path / "m.gguf"
    shutil.copy(hub.default_gguf_path(), p)
    bare = read_gguf(p, gguf, string_arrays=False)
    offset, _ = bare.string_spans["tokenizer.ggml.tokens"]
    with open(p, "r+b") as f:      # the first token's bytes: not UTF-8
        f.seek(offset + 8)
        f.write(b"\xff")
    with pytest.raises(ModelFileError, match=r"'tokenizer.ggml.tokens'\[0\] is not valid UTF-8") as e:
        read_string_arrays(p, bare)
    assert str(p) in str(e.value)
    os.truncate(p, offset + 1000)
    with pytest.raises(ModelFileError, match="got shorter since its header was read") as e:
        read_string_arrays(p, bare)
    assert str(p) in str(e.value)


def test_a_gguf_load_walks_the_header_once_and_builds_the_config_once(tmp_path, monkeypatch):
    """On a first load (the tokenizer is built into the cache) and on later
    ones alike: one walk of the header, one config build."""
    from fastllm import Model
    from fastllm.formats import gguf_tensors
    from fastllm.spec.config import ModelConfig
    _home(monkeypatch, tmp_path / "home")
    walks, builds = [], []
    build = ModelConfig.from_dict.__func__
    monkeypatch.setattr(gguf_tensors, "read_gguf", lambda *a, **k: walks.append(a[0]) or read_gguf(*a, **k))
    monkeypatch.setattr(ModelConfig, "from_dict", classmethod(
        lambda cls, *a, **k: builds.append(1) or build(cls, *a, **k)))
    for first in (True, False):
        walks.clear(), builds.clear()
        model = Model.from_pretrained(hub.default_gguf_path(), threads=1)
        assert (len(walks), len(builds)) == (1, 1), first
        assert model.tokenizer.decode(model.tokenizer.encode("Hello, world")) == "Hello, world"


@pytest.mark.parametrize("key, value, match", [
    ("llama.block_count", "2", "'llama.block_count' should be int, not '2'"),
    ("general.architecture", ["llama"], "'general.architecture' should be str"),
    ("tokenizer.ggml.tokens", [1, 2], "'tokenizer.ggml.tokens' should be str list"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), "should be number"),
    ("tokenizer.ggml.bos_token_id", "14", "should be int"),
])
def test_gguf_metadata_of_the_wrong_type_is_refused(tmp_path, key, value, match):
    dst = _rewrite_gguf(os.path.join(SEEDS, "gguf", "tiny-f32"), tmp_path / "x.gguf", {key: value})
    with pytest.raises(ModelFileError, match=match):
        convert_gguf(dst, tmp_path / "out", progress=False)


@needs_fifo
def test_a_fifo_named_as_a_gguf_is_refused(tmp_path):
    os.mkfifo(tmp_path / "x.gguf")
    err = _finishes(lambda: convert_gguf(tmp_path / "x.gguf", tmp_path / "out", progress=False))
    assert isinstance(err, ModelFileError) and "FIFO" in str(err)


# ------------------------------------------------------- the conversion cache


@pytest.fixture
def tiny_gguf_file(tmp_path):
    p = tmp_path / "tiny.gguf"
    shutil.copy(os.path.join(SEEDS, "gguf", "tiny-f32"), p)
    return p


def _home(monkeypatch, path):
    monkeypatch.setenv("FASTLLM_HOME", str(path))
    return path


def test_fastllm_home_that_is_a_file_is_named(tmp_path, monkeypatch, tiny_gguf_file):
    home = _home(monkeypatch, tmp_path / "home")
    home.write_text("not a folder")
    with pytest.raises(hub.CacheError, match=rf"FASTLLM_HOME \({home}\).*set FASTLLM_HOME to a writable folder"):
        hub.resolve_model(tiny_gguf_file)


def test_fastllm_home_in_a_symlink_loop_is_named(tmp_path, monkeypatch, tiny_gguf_file):
    home = _home(monkeypatch, tmp_path / "loop")
    os.symlink(home, home)
    with pytest.raises(hub.CacheError, match=r"FASTLLM_HOME .*loop.*writable"):
        hub.resolve_model(tiny_gguf_file)


def test_a_read_only_fastllm_home_is_named(tmp_path, monkeypatch, tiny_gguf_file):
    home = _home(monkeypatch, tmp_path / "home")
    home.mkdir()
    from fastllm.formats import gguf as gguf_format

    def refuse(out_dir):
        raise PermissionError(13, "Permission denied", str(out_dir.parent))
    monkeypatch.setattr(gguf_format, "_make_partial_dir", refuse)
    with pytest.raises(hub.CacheError, match=rf"FASTLLM_HOME \({home}\): {home}: Permission denied"):
        hub.resolve_model(tiny_gguf_file)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_fastllm_home_is_named_for_real(tmp_path, monkeypatch, tiny_gguf_file):
    home = _home(monkeypatch, tmp_path / "home")
    home.mkdir()
    home.chmod(0o555)
    try:
        with pytest.raises(hub.CacheError, match="Permission denied"):
            hub.resolve_model(tiny_gguf_file)
    finally:
        home.chmod(0o755)


def test_a_read_only_home_with_a_finished_cache_still_works(tmp_path, monkeypatch, tiny_gguf_file):
    _home(monkeypatch, tmp_path / "home")
    first = hub.resolve_model(tiny_gguf_file)
    from fastllm.formats import gguf as gguf_format
    monkeypatch.setattr(gguf_format, "convert_gguf", None)   # any conversion would fail
    monkeypatch.setattr(hub, "convert_gguf", None)
    assert hub.resolve_model(tiny_gguf_file) == first


@pytest.mark.parametrize("damage", ["truncate", "grow", "no stamp"])
def test_a_damaged_cache_entry_is_rebuilt_once(tmp_path, monkeypatch, capfd, tiny_gguf_file, damage):
    from fastllm import Model
    _home(monkeypatch, tmp_path / "home")
    first = hub.resolve_model(tiny_gguf_file)
    st = first / "model.safetensors"
    good = st.read_bytes()
    if damage == "truncate":
        st.write_bytes(good[: len(good) // 2])
    elif damage == "grow":
        st.write_bytes(good + b"junk")
    else:
        (first / "fastllm_source.json").unlink()
    capfd.readouterr()
    assert hub.resolve_model(tiny_gguf_file) == first
    err = capfd.readouterr().err
    assert f"the cached {first} cannot be used" in err and "converting again" in err
    assert st.read_bytes() == good
    Model.from_pretrained(tiny_gguf_file).logits([1, 2])
    mtime = st.stat().st_mtime_ns
    assert hub.resolve_model(tiny_gguf_file) == first
    assert st.stat().st_mtime_ns == mtime and "converting" not in capfd.readouterr().err


@needs_fifo
def test_a_fifo_given_as_the_model_is_refused(tmp_path, monkeypatch):
    _home(monkeypatch, tmp_path / "home")
    os.mkfifo(tmp_path / "x.gguf")
    err = _finishes(lambda: hub.resolve_model(tmp_path / "x.gguf"))
    assert isinstance(err, ModelFileError) and "FIFO" in str(err)


@needs_fifo
def test_a_fifo_as_the_cache_stamp_is_rebuilt_not_waited_on(tmp_path, monkeypatch, tiny_gguf_file):
    _home(monkeypatch, tmp_path / "home")
    first = hub.resolve_model(tiny_gguf_file)
    (first / "fastllm_source.json").unlink()
    os.mkfifo(first / "fastllm_source.json")
    assert not isinstance(_finishes(lambda: hub.resolve_model(tiny_gguf_file)), BaseException)
    assert (first / "fastllm_source.json").is_file()


def _rewrite_gguf(src, dst, change_kv=None, change_tensor=None):
    """A copy of the GGUF src with some metadata values or tensors replaced."""
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "llama")
    w.kv_data[0].clear()
    for k, field in r.fields.items():
        if k.startswith("GGUF."):
            continue
        v, vtype = field.contents(), field.types[0]
        sub = field.types[-1] if len(field.types) > 1 else None
        if change_kv and k in change_kv:
            v = change_kv[k]
            T = gguf.GGUFValueType
            vtype = {str: T.STRING, list: T.ARRAY, float: T.FLOAT32, int: T.UINT32}[type(v)]
            sub = (T.STRING if isinstance(v[0], str) else T.UINT32) if isinstance(v, list) else None
        w.add_key_value(k, v, vtype, sub_type=sub)
    for t in r.tensors:
        if change_tensor and t.name in change_tensor:
            w.add_tensor(t.name, change_tensor[t.name])
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type,
                         raw_shape=tuple(int(d) for d in reversed(t.shape.tolist())))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("kv, tensor, match", [
    ({"llama.attention.head_count": 0}, None, "head_count is 0; it must be at least 1"),
    ({"llama.block_count": 2**31}, None, "block_count is 2147483648, but the file has 11 tensors"),
    ({"llama.block_count": 0}, None, "block_count is 0"),
    (None, {"token_embd.weight": np.zeros((2, 16, 32), np.float32)}, "token_embd.weight has shape .* not two"),
    (None, {"blk.0.attn_q.weight": np.zeros(32, np.float32)}, "attn_q.weight has shape .* not two"),
])
def test_gguf_counts_and_shapes_that_make_no_model_are_refused(tmp_path, kv, tensor, match):
    dst = _rewrite_gguf(os.path.join(SEEDS, "gguf", "tiny-f32"), tmp_path / "x.gguf", kv, tensor)
    with pytest.raises(ModelFileError, match=match):
        convert_gguf(dst, tmp_path / "out", progress=False)


def test_an_error_reading_the_source_is_not_blamed_on_the_cache(tmp_path, monkeypatch, tiny_gguf_file):
    _home(monkeypatch, tmp_path / "home")
    from fastllm.formats import gguf as gguf_format

    def vanished(path, *args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", str(path))
    monkeypatch.setattr(gguf_format, "read_contents", vanished)
    with pytest.raises(FileNotFoundError) as e:
        hub.resolve_model(tiny_gguf_file)
    assert not isinstance(e.value, hub.CacheError)


# ------------------------------------------------- counts a file cannot back

@pytest.mark.slow
def test_a_vocabulary_past_the_embedding_rows_is_refused_before_it_is_decoded(tmp_path):
    """A GGUF file whose tokenizer lists 400,000 tokens for 16 embedding
    rows: refused from the counts, before 400,000 strings are built (some
    25 MB of them)."""
    import tracemalloc
    src = os.path.join(SEEDS, "gguf", "tiny-f32")
    dst = _rewrite_gguf(src, tmp_path / "x.gguf", {"tokenizer.ggml.tokens": [f"t{i}" for i in range(400_000)]})
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError, match="400000 tokens but only 16 embedding rows"):
            convert_gguf(dst, tmp_path / "out", progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MB allocated before refusing"


def test_a_sentencepiece_vocabulary_whose_merges_explode_is_refused():
    """Pieces of 1 to 600 "▁": every split of each is a merge (180,000 of
    them, 70 million characters) that the BPE rebuild would list; real
    vocabularies give about two merges a token."""
    from fastllm.formats.gguf_tokenizer import tokenizer_files
    tokens = ["<unk>", "<s>", "</s>"] + ["\u2581" * k for k in range(1, 601)]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": [0.0] * 3 + [-float(k) for k in range(1, 601)],
          "tokenizer.ggml.token_type": [2, 3, 3] + [1] * 600}
    with pytest.raises(ModelFileError, match="merges"):
        tokenizer_files(md, "spm.gguf")


def test_real_sentencepiece_vocabularies_stay_within_the_merge_bound():
    from fastllm.formats.gguf_tokenizer import tokenizer_files
    gguf = pytest.importorskip("gguf")
    folder = os.path.join(os.path.dirname(__file__), "data", "spm-gguf")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".gguf"):
            md = read_gguf(os.path.join(folder, name), gguf).metadata
            tokenizer_json, _ = tokenizer_files(md, name)
            assert tokenizer_json["model"]["merges"], name


@pytest.mark.parametrize("layers", [10**6, 2**31 - 1])
def test_a_huge_layer_count_is_refused_before_any_per_layer_work(tiny_model_dir, tmp_path, layers):
    from fastllm import Model
    from fastllm.spec.config import ModelConfig
    from oracles import tiny_models
    for kind in ("llama-gqa", "mistral-swa", "qwen3_5-text"):   # the latter two list a type per layer
        folder = tiny_models.with_config(tiny_model_dir(kind), tmp_path / f"{kind}-{layers}",
                                         num_hidden_layers=layers, layer_types=None)
        err = _finishes(lambda: Model.from_pretrained(folder, n_ctx=32))
        assert isinstance(err, ModelFileError) and "num_hidden_layers" in str(err), repr(err)
        err = _finishes(lambda: ModelConfig.from_file(folder / "config.json"))
        assert isinstance(err, ModelFileError) and "at most 4096" in str(err), repr(err)


@pytest.mark.parametrize("head_dim", [8194, 310000002])
def test_a_huge_head_dim_is_refused_before_the_rope_tables_are_built(tiny_model_dir, tmp_path, head_dim):
    # The RoPE tables are sized by head_dim before any weight is read: the
    # fuzzer's 310000002 took 19 GB to build a table of 8 positions.
    from fastllm.spec.config import ModelConfig
    from oracles import tiny_models
    folder = tiny_models.with_config(tiny_model_dir("llama-gqa"), tmp_path / str(head_dim), head_dim=head_dim)
    err = _finishes(lambda: ModelConfig.from_file(folder / "config.json"))
    assert isinstance(err, ModelFileError) and "head_dim must be a positive even integer of at most 8192" in str(err), \
        repr(err)
    assert str(folder / "config.json") in str(err)


def test_a_layer_count_past_the_checkpoint_is_refused_from_the_tensor_count(tiny_model_dir, tmp_path):
    from fastllm import Model
    from oracles import tiny_models
    folder = tiny_models.with_config(tiny_model_dir("llama-gqa"), tmp_path / "m", num_hidden_layers=4000)
    err = _finishes(lambda: Model.from_pretrained(folder, n_ctx=32))
    assert isinstance(err, ModelFileError), repr(err)
    assert re.search(r"num_hidden_layers is 4000, but .* holds only \d+ tensors", str(err)), str(err)


def test_a_huge_max_position_embeddings_gives_a_bounded_default_context(tiny_model_dir, tmp_path):
    """The default context is max_position_embeddings up to DEFAULT_MAX_CTX;
    beyond it, a warning, and tables sized to the context loaded."""
    from fastllm import Model, ResourceLimitWarning
    from fastllm.generate.model import DEFAULT_MAX_CTX
    from oracles import tiny_models
    for n in (10**7, 10**9):
        folder = tiny_models.with_config(tiny_model_dir("llama-gqa"), tmp_path / str(n), max_position_embeddings=n)
        with pytest.warns(ResourceLimitWarning, match=f"max_position_embeddings is {n}.*n_ctx={DEFAULT_MAX_CTX}"):
            model = Model.from_pretrained(folder, threads=1)
        assert model.n_ctx == DEFAULT_MAX_CTX
        assert model.logits([1, 2, 3]).shape == (3, model.config.vocab_size)
    # a model's own context below the bound is the default, as before
    assert Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1).n_ctx == \
        json.loads((tiny_model_dir("llama-gqa") / "config.json").read_text())["max_position_embeddings"]


def test_a_huge_gemma4_layer_scale_is_an_error_not_token_zero_forever(tiny_model_dir, tmp_path):
    from fastllm import Model
    folder = _copy_model(tiny_model_dir, "gemma4-text", tmp_path)
    path = folder / "model.safetensors"
    tensors = {k: np.array(v) for k, v in load_file(path).items()}
    scales = [k for k in tensors if k.endswith("layer_scalar")]
    assert scales
    tensors[scales[0]][...] = 1e38
    save_file(path, tensors)
    model = Model.from_pretrained(folder, threads=1, n_ctx=64)
    assert np.isnan(model.logits([1, 2, 3])[-1]).all()   # what the model computes, as it is
    with pytest.raises(FloatingPointError, match="NaN"):
        list(model.generate_tokens([1, 2, 3], 4))


def _tampered_hf_cache(tmp_path, ref: str):
    cache = tmp_path / "hub"
    repo = cache / "models--org--name"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "refs" / "main").write_text(ref)
    return cache


@pytest.mark.parametrize("ref", ["/etc", "/", "../../../outside", "../../models--org--other/snapshots/x"])
def test_a_tampered_hugging_face_ref_cannot_leave_the_snapshot_folder(tmp_path, monkeypatch, ref):
    pytest.importorskip("huggingface_hub")
    from fastllm.load.huggingface import ModelNotFoundError
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.gguf").write_bytes(b"GGUF")
    other = tmp_path / "hub" / "models--org--other" / "snapshots" / "x"
    other.mkdir(parents=True)
    (other / "model.gguf").write_bytes(b"GGUF")
    cache = _tampered_hf_cache(tmp_path, ref)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    listed = []
    from fastllm.load import huggingface
    real = huggingface._files_under
    monkeypatch.setattr(huggingface, "_files_under", lambda folder: listed.append(folder) or real(folder))
    with pytest.raises(ModelNotFoundError, match="refs/main") as e:
        hub.locate("org/name")
    assert "snapshot" in str(e.value)
    assert listed == []
