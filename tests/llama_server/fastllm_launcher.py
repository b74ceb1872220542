"""A pytest plugin that runs llama.cpp's own server tests
(tools/server/tests/unit in llama.cpp's source) against `fastllm serve`:
their ServerProcess starts fastllm instead of llama-server, with the
settings each test gives it translated, and nothing else of theirs is
changed. run.sh fetches the tests and runs them with this plugin:

    cd llama.cpp/tools/server/tests && PYTHONPATH=DIR pytest -p fastllm_launcher unit/test_x.py

FASTLLM_PEER_KNOWN names a file of the tests that cannot pass against
fastllm, each with the reason (known_failures.txt); they are skipped.

The tests' stand-in model (tinyllama2, a 260K-parameter story model
fetched from the Hugging Face hub) is not here: the default model runs in
its place (FASTLLM_PEER_MODEL names another folder), so a test that
expects that model's own words or token counts fails for that reason
alone. Each server setting maps to fastllm's:
- port, host, API key, slots (--parallel), context (--ctx), alias
  (--model-name), the seed of requests that give none (--seed),
  --cors-origins (llama-server's default allows any
  origin: "*" here);
- the default token budget (n_predict) and temperature of requests that
  set none: the model folder's generation_config.json, which fastllm serve
  falls back on (a copy of the folder, its weights linked, holds them);
- a chat template (a file, or the text of one): the copy's
  tokenizer_config.json;
- another model (an embedding model, a vision model, a router of several):
  FASTLLM_PEER_MODELS, a JSON object {"<hf repo>[:<hf file>]": "<folder or
  .gguf>"}; without an entry the server does not start and the test fails
  saying so.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

# llama.cpp's short names of built-in templates that tests ask for, as the
# templates they stand for (from the tests' own models/templates folder).
TEMPLATE_FILES = {"llama3": "meta-llama-Llama-3.1-8B-Instruct.jinja"}
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")

_made = {}
_tmp = None


def default_model() -> str:
    if os.environ.get("FASTLLM_PEER_MODEL"):
        return os.environ["FASTLLM_PEER_MODEL"]
    from fastllm.load.hub import default_model_dir
    return str(default_model_dir())


def model_for(server) -> str:
    """The folder or file that serves in place of the test's model."""
    preset = server.model_hf_repo or ""
    if server.model_hf_file:
        preset += ":" + server.model_hf_file
    if preset in ("", "ggml-org/test-model-stories260K", "ggml-org/models:tinyllamas/stories260K.gguf"):
        if server.model_file is None and not server.models_dir:
            return default_model()
    others = json.loads(os.environ.get("FASTLLM_PEER_MODELS") or "{}")
    if preset in others:
        return others[preset]
    raise RuntimeError(f"no model here stands in for {preset or server.model_file or server.models_dir!r} "
                       "(FASTLLM_PEER_MODELS maps llama.cpp's test models to local ones)")


def template_of(server) -> str | None:
    """The chat template text the test sets, or None."""
    if server.chat_template_file:
        return Path(server.chat_template_file).read_text()
    name = server.chat_template
    if not name:
        return None
    if name == "chatml":
        return CHATML
    if name in TEMPLATE_FILES:
        return (Path("../../../models/templates") / TEMPLATE_FILES[name]).read_text()
    return name   # the text of a template


def variant(model: str, template: str | None, generation: dict) -> str:
    """model (a folder) as served with this template and these request
    defaults: a folder of copies of its small files, its weights and
    subfolders linked."""
    global _tmp
    if template is None and not generation:
        return model
    if not os.path.isdir(model):
        raise RuntimeError(f"a chat template or request defaults need a model folder, not {model}")
    key = hashlib.sha256(json.dumps([model, template, generation]).encode()).hexdigest()[:16]
    if key in _made:
        return _made[key]
    if _tmp is None:
        _tmp = tempfile.mkdtemp(prefix="fastllm-peer-models-")
    out = Path(_tmp) / key
    out.mkdir()
    for f in Path(model).iterdir():
        if f.is_dir() or f.suffix == ".safetensors":   # weights, and sentence-transformers' modules
            (out / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, out / f.name)
    if template is not None:
        path = out / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        config["chat_template"] = template
        path.write_text(json.dumps(config))
    path = out / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(generation)
    path.write_text(json.dumps(config))
    _made[key] = str(out)
    return str(out)


def fastllm_args(server) -> list:
    generation = {}
    if server.n_predict and server.n_predict > 0:   # -1: no limit but the context
        generation["max_new_tokens"] = int(server.n_predict)
    if server.temperature is not None:
        generation["temperature"] = float(server.temperature)
        generation["do_sample"] = server.temperature > 0
    model = variant(model_for(server), template_of(server), generation)
    args = [sys.executable, "-m", "fastllm", "serve", "--model", model, "--host", server.server_host,
            "--port", str(server.server_port), "--threads", os.environ.get("FASTLLM_PEER_THREADS", "2"),
            "--cors-origins", server.cors_origins or "*"]
    if server.api_key:
        args += ["--api-key", server.api_key]
    if server.n_slots:
        args += ["--parallel", str(server.n_slots)]
    if server.n_ctx:
        args += ["--ctx", str(server.n_ctx)]
    if server.seed is not None and server.seed >= 0:   # llama-server's -1: random
        args += ["--seed", str(server.seed)]
    if server.model_alias:
        args += ["--model-name", server.model_alias]
    return args


def start(self, timeout_seconds: int = 60) -> None:
    import utils
    args = fastllm_args(self)
    print(f"tests: starting fastllm with: {' '.join(args)}")
    self._log = open(self.log_path, "w") if self.log_path else sys.stdout
    self.process = subprocess.Popen(args, stdout=self._log, stderr=self._log if self._log is not sys.stdout
                                    else sys.stdout)
    utils.server_instances.add(self)
    end = time.time() + max(timeout_seconds, 120)   # fastllm loads its model in Python, a few seconds
    while time.time() < end:
        try:
            if self.make_request("GET", "/health").status_code == 200:
                self.ready = True
                return
        except Exception:
            pass
        if self.process.poll() is not None:
            raise RuntimeError(f"fastllm serve exited with {self.process.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"fastllm serve did not start within {timeout_seconds} s")


# utils imports wget to fetch models from the hub, which never happens here
sys.modules.setdefault("wget", types.ModuleType("wget"))


def case_insensitive_headers(make_request):
    """utils' make_request with the response's headers kept as HTTP has
    them, case-insensitive (it makes a plain dict of them): fastllm's server
    (Starlette) sends their names in lower case, and the tests look for
    "Access-Control-Allow-Origin"."""
    from requests.structures import CaseInsensitiveDict

    def wrapped(self, *args, **kwargs):
        result = make_request(self, *args, **kwargs)
        result.headers = CaseInsensitiveDict(result.headers)
        return result
    return wrapped


def pytest_sessionstart(session):
    sys.path.insert(0, str(session.config.rootpath))
    import utils
    utils.ServerProcess.start = start
    utils.ServerProcess.make_request = case_insensitive_headers(utils.ServerProcess.make_request)
    # the presets' models are fetched from the hub before the first test: none here
    utils.ServerPreset.load_all = staticmethod(lambda: None)


def known_failures(path) -> list:
    """[(test id prefix, why)] of a known-failures file: "prefix | why" a
    line (a * in the prefix stands for anything), # comments."""
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            prefix, _, why = line.partition(" | ")
            out.append((prefix.strip(), why.strip()))
    return out


def pytest_collection_modifyitems(config, items):
    """With FASTLLM_PEER_KNOWN (a known-failures file), the tests it names
    are skipped with their reason: those that need llama-server's own
    endpoints or fields, a model that is not here, or one model's words."""
    import pytest
    path = os.environ.get("FASTLLM_PEER_KNOWN")
    if not path:
        return
    known = [(re.compile(re.escape(prefix).replace(r"\*", ".*")), why) for prefix, why in known_failures(path)]
    for item in items:
        for prefix, why in known:
            if prefix.match(item.nodeid):
                item.add_marker(pytest.mark.skip(reason=why))
                break


def pytest_sessionfinish(session):
    if _tmp is not None:
        shutil.rmtree(_tmp, ignore_errors=True)
