"""The Python API and the command line on the default model, and the errors
that bad input must produce."""
import json
import os
import shutil
import subprocess
import sys
import struct
import warnings

import numpy as np
import pytest

from fastllm import Model, ModelFileError, SamplingParams
from fastllm import generate_batch


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return Model.from_pretrained(smollm2_dir, n_ctx=256, threads=2)


@pytest.mark.slow
def test_generate_equals_joined_stream_and_is_deterministic(model):
    text = model.generate("The capital of France is", max_new_tokens=20)
    assert text == "".join(model.stream("The capital of France is", max_new_tokens=20))
    assert "Paris" in text
    assert model.last_stats.generated_tokens <= 20


@pytest.mark.slow
def test_prefix_reuse_gives_the_same_tokens_as_a_fresh_model(model, smollm2_dir):
    model.generate("Once upon a time", max_new_tokens=10)
    reused = model.generate("Once upon a time, a dragon", max_new_tokens=24)
    fresh = Model.from_pretrained(smollm2_dir, n_ctx=256, threads=1)
    assert reused == fresh.generate("Once upon a time, a dragon", max_new_tokens=24)


@pytest.mark.slow
def test_stop_strings_cut_the_text(model):
    full = model.generate("1, 2, 3, 4,", max_new_tokens=24)
    assert " 6," in full
    cut = model.generate("1, 2, 3, 4,", max_new_tokens=24, stop=[" 6,"])
    assert cut == full[:full.index(" 6,")]
    assert model.last_stats.finish_reason == "stop"


@pytest.mark.slow
def test_streamed_pieces_are_whole_characters(model):
    pieces = list(model.stream("Écris une phrase en français avec des accents: é, à, ç.",
                               max_new_tokens=30, temperature=0.9, seed=3))
    assert all(isinstance(p, str) and "\ufffd" not in p for p in pieces)


@pytest.mark.slow
def test_seeded_sampling_reproduces(model):
    kw = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=40, seed=123)
    assert model.generate("My favourite food is", **kw) == model.generate("My favourite food is", **kw)


def test_bad_settings_raise_at_the_call(model):
    for call in (model.stream, model.generate):
        with pytest.raises(ValueError, match="temperature"):
            call("hi", temperature=-1)   # not at the first next()
    with pytest.raises(ValueError, match="top_p"):
        model.chat([{"role": "user", "content": "hi"}], stream=True, top_p=0)
    with pytest.raises(TypeError, match="unknown setting 'temprature'; the settings are max_new_tokens"):
        model.generate("hi", temprature=0.5)
    with pytest.raises(TypeError, match="not both"):
        model.generate("hi", 4, max_tokens=4)


def test_the_front_door_takes_what_other_libraries_users_type(model, smollm2_dir):
    """Model(path) as llama-cpp-python's Llama(path); max_tokens as
    OpenAI's API names the token limit; chat(stream=True) as pieces."""
    same = Model(smollm2_dir, n_ctx=256, threads=2)
    assert type(same) is Model and same.n_ctx == 256 and same.path == model.path
    want = model.generate("The sea is", 6, temperature=0)
    assert same.generate("The sea is", max_tokens=6, temperature=0) == want
    assert model.generate("The sea is", max_tokens=6, temperature=0) == want
    messages = [{"role": "user", "content": "Say hi."}]
    pieces = list(model.chat(messages, max_tokens=8, stream=True, temperature=0))
    assert len(pieces) > 1 and "".join(pieces) == model.chat(messages, 8, temperature=0)
    with pytest.raises(FileNotFoundError):
        Model("no/such/model.gguf")


def test_model_of_a_gguf_file_and_max_tokens_everywhere(model):
    """Model("x.gguf") on a quantized file, as llama-cpp-python's users
    write it, is from_pretrained's model of that file; max_tokens limits
    stream and generate_batch as it does generate; a llama.cpp name for the
    limit is pointed to max_new_tokens."""
    from fastllm.load.hub import default_gguf_path
    gguf = str(default_gguf_path())
    door, loaded = Model(gguf, n_ctx=128, threads=2), Model.from_pretrained(gguf, n_ctx=128, threads=2)
    assert door.dtype == loaded.dtype == "q4_1" and door.n_ctx == 128 and door.path == loaded.path
    want = loaded.generate("The sea is", max_new_tokens=5, temperature=0)
    assert door.generate("The sea is", max_tokens=5, temperature=0) == want
    assert loaded.last_stats.generated_tokens == 5
    assert "".join(door.stream("The sea is", max_tokens=5, temperature=0)) == want
    assert generate_batch(door, ["The sea is", "Hello"], max_tokens=5, temperature=0)[0] == want
    with pytest.raises(TypeError, match="unknown setting 'n_predict' \\(the token limit is max_new_tokens\\)"):
        model.generate("hi", n_predict=4)


@pytest.mark.slow
def test_sampling_object_and_overrides(model):
    params = SamplingParams(temperature=0.8, top_k=20, seed=11)
    a = model.generate("Once upon a time", 12, sampling=params)
    assert a == model.generate("Once upon a time", 12, temperature=0.8, top_k=20, seed=11)
    assert model.generate("Once upon a time", 12, sampling=params, temperature=0) == \
        model.generate("Once upon a time", 12)


def test_chat_stops_at_end_of_turn(model):
    reply = model.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=64)
    assert "Paris" in reply
    assert "<|im_end|>" not in reply
    assert model.last_stats.finish_reason == "stop"


def test_prompt_longer_than_the_context_is_refused(model):
    with pytest.raises(ValueError, match="context"):
        model.generate("word " * 400, max_new_tokens=4)


def test_generation_ends_when_the_context_is_full(smollm2_dir):
    from fastllm.generate.model import ContextFullWarning
    small = Model.from_pretrained(smollm2_dir, n_ctx=16, threads=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small.generate("1, 2, 3,", max_new_tokens=100)
    assert small.last_stats.finish_reason in ("context", "stop")
    full = [w for w in caught if issubclass(w.category, ContextFullWarning)]
    assert len(full) == (small.last_stats.finish_reason == "context")
    assert small.last_stats.prompt_tokens + small.last_stats.generated_tokens <= 16


def test_bad_token_ids_are_refused(model):
    with pytest.raises(ValueError, match="vocabulary"):
        model.logits([1, 2, model.config.vocab_size])
    with pytest.raises(ValueError):
        model.logits([])


# ------------------------------------------------------------------ bad files

def _copy(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    return dst


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ModelFileError, match="config.json"):
        Model.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelFileError, match="config.json.*JSON"):
        Model.from_pretrained(tmp_path)


@pytest.mark.slow
def test_unsupported_model_type(tiny_model_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama-gqa"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="model_type 'mamba' is not supported"):
        Model.from_pretrained(d)


@pytest.mark.slow
def test_truncated_and_malformed_safetensors(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama-gqa")
    d = _copy(src, tmp_path / "m")
    data = (src / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match="model.safetensors.*data_offsets"):
        Model.from_pretrained(d)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(ModelFileError, match="header length"):
        Model.from_pretrained(d)
    (d / "model.safetensors").write_bytes(b"abc")
    with pytest.raises(ModelFileError, match="too short"):
        Model.from_pretrained(d)


def test_shape_mismatch_and_missing_tensor(tiny_model_dir, tmp_path):
    from fastllm.formats.safetensors import load_file, save_file
    src = tiny_model_dir("llama-gqa")
    tensors = dict(load_file(src / "model.safetensors"))
    d = _copy(src, tmp_path / "shape")
    bad = dict(tensors)
    bad["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(d / "model.safetensors", bad)
    with pytest.raises(ModelFileError, match=r"up_proj.weight.*shape \[3, 3\]"):
        Model.from_pretrained(d)
    d = _copy(src, tmp_path / "missing")
    bad = dict(tensors)
    del bad["model.layers.0.self_attn.k_proj.weight"]
    save_file(d / "model.safetensors", bad)
    with pytest.raises(ModelFileError, match="k_proj.weight.*missing"):
        Model.from_pretrained(d)


def test_safetensors_round_trip_and_bf16_rounding(tmp_path):
    import torch
    from safetensors.torch import load_file as torch_load
    from fastllm.formats.safetensors import SafetensorsFile, save_file
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 5)).astype(np.float32)
    a[0, :3] = [np.inf, -np.inf, np.nan]
    save_file(tmp_path / "x.safetensors", {"a": a, "b": np.arange(6, dtype=np.int64)}, bf16=True)
    ref = torch_load(str(tmp_path / "x.safetensors"))
    want = torch.tensor(a).to(torch.bfloat16)
    assert ref["a"].dtype == torch.bfloat16
    assert torch.equal(ref["a"].view(torch.int16)[1:], want.view(torch.int16)[1:])
    f = SafetensorsFile(tmp_path / "x.safetensors")
    got = f.float32("a")
    assert np.array_equal(got[1:], want[1:].float().numpy())
    assert np.isnan(got[0, 2]) and got[0, 0] == np.inf
    assert np.array_equal(f.raw("b"), np.arange(6))


def test_sharded_checkpoint_loads(tiny_model_dir, tmp_path):
    from fastllm.formats.safetensors import load_file, save_file
    src = tiny_model_dir("qwen2")
    tensors = dict(load_file(src / "model.safetensors"))
    d = _copy(src, tmp_path / "sharded")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file(d / shard, {k: tensors[k] for k in keys})
        weight_map.update({k: shard for k in keys})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = list(range(3, 30))
    assert np.array_equal(Model.from_pretrained(d).logits(ids), Model.from_pretrained(src).logits(ids))


# ------------------------------------------------------------------------ CLI

def _cli(args, stdin=None, env_home=None):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "fastllm", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.slow
def test_cli_run_info_and_errors(smollm2_dir):
    out = _cli(["run", "--raw", "--model", str(smollm2_dir), "-n", "12", "--ctx", "128", "--verbose",
                "The capital of France is"])
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "tok/s" in out.stderr
    out = _cli(["info", "--model", str(smollm2_dir), "--ctx", "128"])
    assert out.returncode == 0 and "134,515,008" in out.stdout
    out = _cli(["run", "--model", "/nonexistent/model", "hi"])
    assert out.returncode == 1 and "nonexistent" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_repl_commands(smollm2_dir):
    script = "/temp 0\n/steps 8\nThe capital of France is\n/chat on\nSay hi.\n/bogus\n/quit\n"
    out = _cli(["--raw", "--model", str(smollm2_dir), "--ctx", "256"], stdin=script)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "[temp 0]" in out.stderr and "[steps 8]" in out.stderr and "unknown command" in out.stderr


@pytest.mark.slow
def test_cli_answers_a_question_as_the_python_api_does(smollm2_dir, model):
    # An instruct model ends a plain continuation of a question at once;
    # `fastllm run` chats by default, with the Python API's defaults (a
    # repetition penalty made this answer "2+2 is ... undefined").
    out = _cli(["run", "--model", str(smollm2_dir), "--verbose", "What is 2+2?"])
    assert out.returncode == 0, out.stderr
    reply = model.chat([{"role": "user", "content": "What is 2+2?"}])
    assert out.stdout == reply + "\n" and "4" in reply


@pytest.mark.parametrize("bad", [2**32 + 5, -2**32 + 5, 2**63, 2**64 + 1])
def test_token_ids_are_checked_before_they_are_narrowed(model, bad):
    """Ids that wrap to a valid int32 (2**32 + 5 -> 5) must be refused, not run."""
    session = model.new_session()
    calls = [lambda: model.logits([1, bad]),
             lambda: list(model.generate_tokens([1, bad], 2)),
             lambda: session.prefill([1, bad]),
             lambda: session.step(bad)]
    for call in calls:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            call()
    assert session.position == 0


def test_a_full_session_refuses_more_tokens(smollm2_dir):
    small = Model.from_pretrained(smollm2_dir, n_ctx=8, threads=2)
    session = small.new_session()
    session.prefill([1, 2, 3, 4, 5, 6, 7])
    session.step(8)
    with pytest.raises(ValueError, match="do not fit the context"):
        session.step(9)
    with pytest.raises(ValueError, match="do not fit the context"):
        session.extend([1, 2])
    with pytest.raises(ValueError, match="do not fit the context"):
        session.prefill(list(range(1, 10)))
    assert session.tokens == (1, 2, 3, 4, 5, 6, 7, 8)   # nothing was run, nothing changed
    with pytest.raises(ValueError, match="integers"):
        session.step(1.0)
