"""Where models come from (fastllm.load.hub, fastllm.load.huggingface): local paths,
the default model's name, and Hugging Face repo ids.

Oracle for the Hub: a Hugging Face cache laid out as huggingface_hub lays
it out (models--org--name/{blobs,refs/main,snapshots/<commit>/...}, the
snapshot files relative symlinks to content-addressed blobs), which
huggingface_hub itself must read back (scan_cache_dir, hf_hub_download and
snapshot_download with local_files_only) before fastllm is asked to. The
default model's GGUF file and a tiny HF folder go in; nothing touches the
network (HF_HUB_OFFLINE=1, or an endpoint on a closed local port).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

huggingface_hub = pytest.importorskip("huggingface_hub")

from fastllm import Model  # noqa: E402
from fastllm.load import hub  # noqa: E402
from fastllm.cli.main import main  # noqa: E402
from fastllm.load.huggingface import ModelNotFoundError, parse_repo_id, pick_file, repo_id_of  # noqa: E402
from test_cli import run_repl, write_byte_tokenizer  # noqa: E402

GGUF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FOLDER_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
IDS = [1, 17, 923, 4, 2048]


def add_repo(cache: Path, repo_id: str, files: dict) -> Path:
    """Put files ({path in the repo: local file}) into cache as
    huggingface_hub's downloads leave them; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    for name, src in files.items():
        data = Path(src).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory, tiny_model_dir):
    """A Hugging Face cache with two repos: the default model's GGUF (twice,
    under two quantization names, one blob) and a tiny HF folder."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    gguf = hub.default_gguf_path()
    add_repo(cache, GGUF_REPO, {"SmolLM2-135M-Instruct.Q4_1.gguf": gguf,
                                "SmolLM2-135M-Instruct.Q8_0.gguf": gguf, "README.md": gguf.parent / "__init__.py"})
    tiny = tmp_path_factory.mktemp("tiny") / "tiny"
    shutil.copytree(tiny_model_dir("llama-gqa"), tiny)
    write_byte_tokenizer(tiny, json.loads((tiny / "config.json").read_text())["vocab_size"])
    add_repo(cache, FOLDER_REPO, {f.name: f for f in tiny.iterdir() if f.is_file()})
    return cache


@pytest.fixture
def offline(hf_cache, fastllm_home, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    return hf_cache


def _env(**extra):
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(hub.__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


# ---------------------------------------------------------------------------
# The layout is huggingface_hub's own


def test_huggingface_hub_reads_the_fake_cache(hf_cache):
    info = huggingface_hub.scan_cache_dir(hf_cache)
    assert not info.warnings, info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {GGUF_REPO, FOLDER_REPO}
    (rev,) = repos[GGUF_REPO].revisions
    assert rev.commit_hash == COMMIT and rev.refs == {"main"}
    assert {f.file_name for f in rev.files} == {"SmolLM2-135M-Instruct.Q4_1.gguf",
                                               "SmolLM2-135M-Instruct.Q8_0.gguf", "README.md"}
    got = huggingface_hub.hf_hub_download(GGUF_REPO, "SmolLM2-135M-Instruct.Q4_1.gguf", cache_dir=hf_cache,
                                          local_files_only=True)
    assert Path(got).read_bytes()[:4] == b"GGUF"
    snapshot = Path(huggingface_hub.snapshot_download(FOLDER_REPO, cache_dir=hf_cache, local_files_only=True))
    assert (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").is_file()


# ---------------------------------------------------------------------------
# Names


@pytest.mark.parametrize("name,parsed", [
    ("org/name", ("org/name", None)),
    ("org/name:Q4_K_M", ("org/name", "Q4_K_M")),
    ("org/name:*Q4_1.gguf", ("org/name", "*Q4_1.gguf")),
    ("hf.co/bartowski/Qwen2.5-0.5B-Instruct-GGUF:q8_0", ("bartowski/Qwen2.5-0.5B-Instruct-GGUF", "q8_0")),
    ("https://huggingface.co/org/my_model.v2", ("org/my_model.v2", None)),
    ("model.gguf", None), ("./org/name", None), ("/abs/org/name", None), ("a/b/c", None),
    (r"C:\models\x.gguf", None), ("org/", None), ("org/name:", None),
])
def test_parse_repo_id(name, parsed):
    assert parse_repo_id(name) == parsed


def test_pick_file():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-q4_k_s.gguf", "sub/m-Q6_K.gguf"]
    assert pick_file("r", files, None) == "m-Q4_K_M.gguf"            # llama.cpp's default
    assert pick_file("r", files, "q8_0") == "m-Q8_0.gguf"            # tags in any case
    assert pick_file("r", files, "Q4_K_S") == "m-q4_k_s.gguf"
    assert pick_file("r", files, "Q6_K") == "sub/m-Q6_K.gguf"
    assert pick_file("r", files, "*Q8_0.gguf") == "m-Q8_0.gguf"      # globs
    assert pick_file("r", files, "m-Q6_K.gguf") == "sub/m-Q6_K.gguf"
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file of r matches 'Q4_K'.*m-Q4_K_M.gguf"):
        pick_file("r", files, "Q4_K")
    with pytest.raises(ModelNotFoundError, match=r"2 GGUF files of r match '\*Q4_K_\*'"):
        pick_file("r", files, "*Q4_K_*")
    with pytest.raises(ModelNotFoundError, match=r"3 GGUF files and none is Q4_K_M; name one as r:TAG"):
        pick_file("r", ["a.Q8_0.gguf", "a.Q4_0.gguf", "a.F16.gguf"], None)
    assert pick_file("r", ["x.gguf"], None) == "x.gguf"
    assert pick_file("r", ["config.json", "model.safetensors", "x.gguf"], None) is None   # a folder first
    with pytest.raises(ModelNotFoundError, match="neither config.json"):
        pick_file("r", ["README.md", "config.json"], None)


def test_repo_id_of_cache_paths(tmp_path):
    assert repo_id_of(tmp_path / "models--org--a--b" / "snapshots" / COMMIT) == "org/a--b"
    assert repo_id_of(tmp_path / "models--org--a" / "snapshots" / COMMIT / "x.gguf") == "org/a"
    assert repo_id_of(tmp_path / "models" / "snapshots") is None


# ---------------------------------------------------------------------------
# Loading from the cache, offline


def _logits(model):
    return model.logits(IDS)


def test_gguf_repo_with_filename(offline):
    snapshot = offline / ("models--" + GGUF_REPO.replace("/", "--")) / "snapshots" / COMMIT
    m = Model.from_pretrained(GGUF_REPO, filename="*Q4_1.gguf", n_ctx=64, threads=1)
    assert m.source == snapshot / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert m.name == "SmolLM2-135M-Instruct.Q4_1" and m.dtype == "q4_1"
    default = Model.from_pretrained(n_ctx=64, threads=1)
    assert np.array_equal(_logits(m), _logits(default))
    assert hub.locate(f"{GGUF_REPO}:q8_0") == snapshot / "SmolLM2-135M-Instruct.Q8_0.gguf"


def test_gguf_repo_needs_a_choice_among_several(offline):
    with pytest.raises(ModelNotFoundError) as e:
        hub.locate(GGUF_REPO)
    msg = str(e.value)
    assert "2 GGUF files and none is Q4_K_M" in msg and f"{GGUF_REPO}:TAG" in msg
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ModelNotFoundError, match="no GGUF file of .* matches 'Q5_K_M'"):
        hub.locate(f"{GGUF_REPO}:Q5_K_M")
    with pytest.raises(ValueError, match="give one"):
        hub.locate(f"{GGUF_REPO}:Q8_0", filename="*Q4_1.gguf")


def test_folder_repo(offline, tiny_model_dir):
    m = Model.from_pretrained(FOLDER_REPO, n_ctx=64, threads=1)
    assert m.source.parent.name == "snapshots" and m.name == FOLDER_REPO
    local = Model.from_pretrained(tiny_model_dir("llama-gqa"), n_ctx=64, threads=1)
    ids = [i % local.config.vocab_size for i in IDS]
    assert np.array_equal(m.logits(ids), local.logits(ids))


def test_local_path_wins_over_a_repo_id(offline, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir("qwen2"), tmp_path / FOLDER_REPO)
    m = Model.from_pretrained(FOLDER_REPO, n_ctx=64, threads=1)
    assert m.config.model_type == "qwen2" and m.source == Path(FOLDER_REPO)


def test_repo_not_in_the_cache_offline(offline):
    with pytest.raises(ModelNotFoundError) as e:
        Model.from_pretrained("someone/not-cached")
    msg = str(e.value)
    assert "not in the Hugging Face cache" in msg and str(offline) in msg and "HF_HUB_OFFLINE is set" in msg
    assert "hf download someone/not-cached" in msg


def test_without_huggingface_hub_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ModelNotFoundError, match=r"needs huggingface_hub: pip install 'fastllm-engine\[hub\]'"):
        hub.locate("org/name")
    with pytest.raises(FileNotFoundError, match="model not found: no_such_model"):
        hub.locate("no_such_model")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_falls_back_to_the_cache(hf_cache, tmp_path):
    # HF_ENDPOINT on a closed local port: every request fails to connect.
    env = _env(HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}", HF_HUB_CACHE=str(hf_cache),
               FASTLLM_HOME=str(tmp_path / "home"))
    env.pop("HF_HUB_OFFLINE", None)
    r = subprocess.run([sys.executable, "-m", "fastllm", "info", "--model", f"{GGUF_REPO}:Q4_1"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"{COMMIT}/SmolLM2-135M-Instruct.Q4_1.gguf" in r.stdout
    r = subprocess.run([sys.executable, "-m", "fastllm", "info", "--model", "someone/not-cached"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1
    assert "the Hugging Face Hub cannot be reached" in r.stderr and "not in the Hugging Face cache" in r.stderr


# ---------------------------------------------------------------------------
# The command line names models as Model.from_pretrained does


def _info_rows(out: str) -> dict:
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out.splitlines() if line.strip())


def test_info_prints_the_gguf_file(fastllm_home, capsys):
    for argv in ([], ["--model", hub.DEFAULT_MODEL]):
        assert main(["info", "--ctx", "64", "--threads", "1", *argv]) == 0
        rows = _info_rows(capsys.readouterr().out)
        assert rows["path"] == str(hub.default_gguf_path())
        assert "-tokenizer-" in rows["tokenizer cache"] and "cache folder" not in rows


def test_show_prints_the_gguf_file(offline, capsys):
    m = Model.from_pretrained(f"{GGUF_REPO}:Q4_1", n_ctx=64, threads=1)
    _, _, out = run_repl(m, ["/show"], capsys=capsys)
    assert f"{m.source} (llama)" in out.err and m.path == m.source   # the file itself, no cache folder


def test_convert_takes_model_names(offline, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FASTLLM_HOME", str(tmp_path / "home"))
    # a Hub name; an output without .gguf gets it, and says so
    assert main(["convert", FOLDER_REPO, str(tmp_path / "tiny")]) == 0
    err = capsys.readouterr().err
    assert (tmp_path / "tiny.gguf").is_file() and not (tmp_path / "tiny").exists()
    assert "the .gguf extension was added" in err and f"wrote {tmp_path / 'tiny.gguf'}" in err
    # the default model's name (here standing for the tiny GGUF file)
    monkeypatch.setattr(hub, "default_gguf_path", lambda: tmp_path / "tiny.gguf")
    assert main(["convert", hub.DEFAULT_MODEL, str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llama"


# ---------------------------------------------------------------------------
# Online: what is asked of huggingface_hub (its network calls stand in here)


class _Hub:
    """huggingface_hub's HfApi.model_info, hf_hub_download and
    snapshot_download, answering from the fake cache and recording calls."""

    def __init__(self, monkeypatch, cache: Path, files: dict):
        self.calls = []
        self.cache = cache
        api = self

        class Api:
            def model_info(self, repo_id):
                api.calls.append(("model_info", repo_id))
                if isinstance(files.get(repo_id), BaseException):
                    raise files[repo_id]
                return type("Info", (), {"siblings": [type("S", (), {"rfilename": f}) for f in files[repo_id]]})

        def hf_hub_download(repo_id, filename, cache_dir=None):
            self.calls.append(("hf_hub_download", repo_id, filename, cache_dir))
            return _real_hf_hub_download(repo_id, filename, cache_dir=cache_dir, local_files_only=True)

        def snapshot_download(repo_id, allow_patterns=None, cache_dir=None, local_files_only=False):
            self.calls.append(("snapshot_download", repo_id, allow_patterns, cache_dir, local_files_only))
            return _real_snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True)

        monkeypatch.setattr(huggingface_hub, "HfApi", Api)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


_real_snapshot_download = huggingface_hub.snapshot_download
_real_hf_hub_download = huggingface_hub.hf_hub_download


def _hub_error(cls, message):
    # Built without the HTTP response their constructors want.
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    return e


@pytest.fixture
def online(hf_cache, fastllm_home, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    files = {GGUF_REPO: ["README.md", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q8_0.gguf"],
             FOLDER_REPO: ["README.md", ".gitattributes", "config.json", "generation_config.json",
                           "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                           "onnx/model.onnx", "onnx/config.json"],
             "someone/missing": _hub_error(huggingface_hub.errors.RepositoryNotFoundError, "404"),
             "someone/gated": _hub_error(huggingface_hub.errors.GatedRepoError, "401")}
    return _Hub(monkeypatch, hf_cache, files)


def test_online_downloads_only_what_is_needed(online):
    path = hub.locate(f"{GGUF_REPO}:Q8_0")
    assert path.name == "SmolLM2-135M-Instruct.Q8_0.gguf"
    assert online.calls == [("model_info", GGUF_REPO),
                            ("hf_hub_download", GGUF_REPO, "SmolLM2-135M-Instruct.Q8_0.gguf", str(online.cache))]
    online.calls.clear()
    folder = hub.locate(FOLDER_REPO)
    assert (folder / "config.json").is_file()
    (_, (_, repo, patterns, cache, local_only)) = online.calls
    assert repo == FOLDER_REPO and cache == str(online.cache) and not local_only
    assert sorted(patterns) == ["config.json", "generation_config.json", "model.safetensors",
                                "tokenizer.json", "tokenizer_config.json"]


def test_online_errors_say_what_to_do(online):
    with pytest.raises(ModelNotFoundError, match="nor a model on the Hugging Face Hub.*hf auth login"):
        hub.locate("someone/missing")
    with pytest.raises(ModelNotFoundError, match="someone/gated is gated: accept its terms"):
        hub.locate("someone/gated")
    with pytest.raises(ModelNotFoundError, match="2 GGUF files and none is Q4_K_M") as e:
        hub.locate(GGUF_REPO)
    assert "cache" not in str(e.value)   # the Hub's listing, not the cache's
