"""A session's state in a file (Session.save_file / load_file) and the
server's prompt cache on disk (--cache-dir): a session that loads a file,
in another Model of the same file as a later process would, holds what the
saved one held, and every token after it is what a cold run gives, bit
for bit, for dense, sliding-window, hybrid and mixture-of-experts models.
A file of another model, build or setting, cut short or damaged is a
ModelFileError naming it (the prompt cache deletes a damaged one)."""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.generate import session_file
from fastllm.generate.session import CHECKPOINT_BEFORE_END
from fastllm.serve.prompt_cache import PromptCache
from fastllm.serve.serving import BatchEngine
from fastllm.spec.errors import ModelFileError

from test_prefix_reuse import FILES, ids

_models = {}


def model(name, **kw):
    key = (name, tuple(sorted(kw.items())))
    if key not in _models:
        _models[key] = Model.from_pretrained(FILES[name], n_ctx=1024, threads=2, **kw)
    return _models[key]


def fresh(name):
    """Another Model of the same file: what a later process loads."""
    return Model.from_pretrained(FILES[name], n_ctx=1024, threads=2)


def cold(m, prompt, n=8):
    return list(m.generate_tokens(prompt, n, stop_token_ids=(), session=m.new_session()))


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_loaded_session_continues_as_a_cold_run_does(name, tmp_path):
    """Turn 1 (a prompt longer than the sliding window, and a reply) is
    saved; another Model of the file loads it, and turn 2 (extending turn
    1) and a prompt that parts from it a few tokens before turn 1's end
    (re-rendered: it resumes from the checkpoint there) give a cold run's
    tokens and logits."""
    m = model(name)
    s = m.new_session()
    p1 = ids(m, 300, 1)
    r1 = list(m.generate_tokens(p1, 10, stop_token_ids=(), session=s))
    path = tmp_path / "turn1.flmsession"
    s.save_file(path)
    other = fresh(name)
    loaded = other.new_session()
    loaded.load_file(path)
    assert loaded.tokens == s.tokens and loaded.checkpoints == s.checkpoints
    assert loaded.memory_bytes == s.memory_bytes
    p2 = p1 + r1 + ids(m, 20, 2)
    assert loaded.reusable(p2) == len(p1) + len(r1) - 1
    assert np.array_equal(loaded.prefill(p2), other.new_session().prefill(p2))
    assert list(other.generate_tokens(p2, 8, stop_token_ids=(), session=loaded)) == cold(other, p2)
    # parted before turn 1's end: a checkpoint there (recurrent states and
    # rings), or anywhere for plain attention caches
    again = other.new_session()
    again.load_file(path)
    p3 = p1[:-2] + ids(m, 9, 3)
    expect = len(p1) - 2 if again.can_rewind else len(p1) - CHECKPOINT_BEFORE_END
    assert again.reusable(p3) == expect
    assert list(other.generate_tokens(p3, 8, stop_token_ids=(), session=again)) == cold(other, p3)


def test_files_of_another_model_build_or_setting_are_refused(tmp_path):
    m = model("dense")
    s = m.new_session()
    s.prefill(ids(m, 100, 1))
    path = tmp_path / "a.flmsession"
    s.save_file(path)
    for other, why in ((model("moe"), "another file"), (model("dense", kv_dtype="f16"), "other settings"),
                       (model("dense", activations="f32"), "other settings")):
        t = other.new_session()
        t.prefill(ids(other, 5, 2))
        with pytest.raises(ModelFileError, match="not a session file of this model") as e:
            t.load_file(path)
        assert str(path) in str(e.value), why
        assert t.position == 5   # a file refused before it is read leaves the session as it was
        p = ids(other, 9, 2)
        assert np.array_equal(t.prefill(p), other.new_session().prefill(p))
    # a key of another build (the code digest is one of its parts)
    want = dict(s.file_key(), weights=dict(s.file_key()["weights"], code="another build"))
    with pytest.raises(ModelFileError, match="not a session file of this model"):
        m.new_session().load_file(path, want)
    with pytest.raises(ModelFileError, match="no such|not found|cannot"):
        m.new_session().load_file(tmp_path / "missing.flmsession")
    with pytest.raises(ValueError, match="holds no tokens"):
        m.new_session().save_file(tmp_path / "empty.flmsession")


def test_damaged_and_cut_files_are_refused_never_used(tmp_path):
    m = model("hybrid")
    s = m.new_session()
    s.prefill(ids(m, 120, 1))
    path = tmp_path / "a.flmsession"
    s.save_file(path)
    whole = path.read_bytes()
    assert oct(path.stat().st_mode & 0o777) == oct(0o444)   # read-only, as the pack cache's files
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.flmsession"
    cases = [whole[:n] for n in (0, 10, 63, 64, 4096, len(whole) // 2, len(whole) - 1)] + [whole + b"x"]
    # every byte but the header page's padding (56 .. 4095), which nothing reads
    for at in [*rng.integers(0, 56, 10), *rng.integers(4096, len(whole), 40)]:
        flipped = bytearray(whole)
        flipped[at] ^= 1 << int(rng.integers(8))
        cases.append(bytes(flipped))
    for data in cases:
        if bad.exists():
            bad.chmod(0o644)
        bad.write_bytes(data)
        t = m.new_session()
        with pytest.raises(ModelFileError) as e:
            t.load_file(bad)
        assert str(bad) in str(e.value)
        assert t.position == 0
    t = m.new_session()
    t.load_file(path)
    assert t.tokens == s.tokens


def test_a_model_built_in_memory_has_no_files():
    from oracles import tiny_models  # noqa: F401  (the tests' own path)
    m = model("dense")
    built = Model(m._weights, m.config, m.tokenizer, m.path, m.dtype, m.eos_token_ids)
    with pytest.raises(ValueError, match="not read from files"):
        built.new_session().file_key()


@pytest.mark.parametrize("name", ["dense", "hybrid", "sliding window"])
def test_a_server_started_later_resumes_from_the_files(name, tmp_path):
    """Engine 1 serves conversation A (a 300-token system prompt), then B,
    which takes A's slot (A goes into the cache: RAM and a file), and stops
    (B goes into a file too). Engine 2, on another Model of the file with
    the same folder, resumes A's next turn and B's from the files, and C
    (A's system prompt, another question) from A's file; every reply is a
    cold run's."""
    m = model(name)
    system = ids(m, 300, 40)
    a1 = system + ids(m, 10, 41)
    b1 = ids(m, 200, 42)
    folder = tmp_path / "cache"
    engine = BatchEngine(m, parallel=1, prefill_chunk=64, cache_bytes=256 << 20, cache_dir=folder)
    try:
        out_a = list(engine.submit(a1, 6, stop_ids=()))
        out_b = list(engine.submit(b1, 6, stop_ids=()))
    finally:
        engine.close()
    assert engine.cache.disk.written == 2 and len(list(folder.glob("*.flmsession"))) == 2
    other = fresh(name)
    later = BatchEngine(other, parallel=1, prefill_chunk=64, cache_bytes=256 << 20, cache_dir=folder)
    try:
        assert later.cache.disk.files == 2
        a2 = a1 + out_a + ids(m, 15, 43)
        b2 = b1 + out_b + ids(m, 7, 44)
        c = system + ids(m, 12, 45)
        for prompt, reused in ((a2, len(a1) + len(out_a) - 1), (b2, len(b1) + len(out_b) - 1),
                               (c, 300 if m.new_session().can_rewind else 0)):
            request = later.submit(prompt, 6, stop_ids=())
            assert list(request) == cold(other, prompt, 6)
            assert reused <= request.prompt_reused <= reused + 3, (request.prompt_reused, reused)
        assert later.cache.disk.loaded >= 2
    finally:
        later.close()


def test_the_files_stay_within_their_budget_and_damaged_ones_go(tmp_path, capfd):
    m = model("dense")
    folder = tmp_path / "cache"
    s = m.new_session()
    s.prefill(ids(m, 100, 1))
    size = s.memory_bytes
    cache = PromptCache(m, 0, folder, disk_bytes=int(2.5 * size) + 4096)   # RAM: none; files: two
    for seed in range(4):
        t = m.new_session()
        t.prefill(ids(m, 100, seed + 10))
        cache.save(t)
        cache.disk.flush()
        os.utime(cache.disk.path_for(t.tokens), ns=(seed * 10**9, seed * 10**9))  # the order they came
    files = sorted(folder.glob("*.flmsession"))
    assert len(files) == 2 and cache.disk.files == 2 and len(cache) == 0
    # the newest two are kept; each is found again by a prompt extending it
    for seed in (2, 3):
        got, n = cache.best(ids(m, 100, seed + 10) + [5, 6])
        assert n == 100 and got.tokens == tuple(ids(m, 100, seed + 10))
    # a file that extends another supersedes it
    longer = m.new_session()
    longer.prefill(ids(m, 100, 13) + ids(m, 30, 99))
    cache.save(longer)
    cache.disk.flush()
    assert cache.disk.files == 2 and not cache.disk.path_for(ids(m, 100, 13)).exists()
    cache.close()
    # damaged: deleted when the next cache opens the folder; another model's: left alone
    victim = cache.disk.path_for(longer.tokens)
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[20] ^= 0xFF
    victim.write_bytes(bytes(data))
    foreign = model("moe").new_session()
    foreign.prefill(ids(model("moe"), 80, 3))
    foreign_path = folder / "other-model.flmsession"
    foreign.save_file(foreign_path)
    capfd.readouterr()
    reopened = PromptCache(m, 1 << 20, folder)
    assert "cannot be used" in capfd.readouterr().err
    assert not victim.exists() and foreign_path.exists() and reopened.disk.files == 1
    reopened.close()


def test_a_folder_that_cannot_be_used_is_a_clear_error(tmp_path):
    m = model("dense")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="--cache-dir .*file"):
        PromptCache(m, 1 << 20, blocker / "cache")


def test_the_cli_passes_the_cache_folder_and_its_budget():
    from fastllm.cli.main import build_parser
    from fastllm.serve.server import OPTION_NAMES
    args = build_parser().parse_args(["serve", "--cache-dir", "/tmp/x", "--cache-disk", "100"])
    assert (args.cache_dir, args.cache_disk) == ("/tmp/x", 100)
    assert {"cache_dir", "cache_disk"} <= set(OPTION_NAMES)


def test_the_server_shows_the_files_in_its_metrics(tmp_path):
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient
    from fastllm.serve.server import create_app
    m = model("dense")
    engine = BatchEngine(m, parallel=1, cache_bytes=64 << 20, cache_dir=tmp_path / "c")
    try:
        with TestClient(create_app(m, engine)) as client:
            list(engine.submit(ids(m, 100, 1), 2, stop_ids=()))
            list(engine.submit(ids(m, 100, 2), 2, stop_ids=()))   # the first goes into the cache
            engine.cache.disk.flush()
            text = client.get("/metrics").text
        assert "fastllm_prompt_cache_files 1" in text and "fastllm_prompt_cache_files_loaded_total 0" in text
        assert f"fastllm_prompt_cache_bytes {engine.cache.nbytes}" in text and engine.cache.nbytes > 0
    finally:
        engine.close()
