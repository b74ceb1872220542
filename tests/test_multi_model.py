"""Several models behind one fastllm serve: each request answered by the
model its `model` field names (as that model alone answers it), /v1/models
listing them, unknown names refused with 404s in each API's shape, and
`fastllm serve --model A --model B` / `--models-file`."""
import json
from contextlib import contextmanager
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("uvicorn")

from fastllm import Model, SamplingParams  # noqa: E402
from fastllm.cli import main as cli  # noqa: E402
from fastllm.serve.server import ServeOptions, create_app  # noqa: E402
from fastllm.serve.serving import BatchEngine  # noqa: E402
from test_server import client, serving  # noqa: E402

GREEDY = SamplingParams(temperature=0)
TINY = Path(__file__).parent / "data" / "tiny-llama"


@contextmanager
def serving_models(entries, **options):
    """A server of [(name, model), ...] on a free port; yields its base URL."""
    engines = [BatchEngine(m, parallel=2, max_queue=8) for _, m in entries]
    try:
        with serving(create_app(None, None, options=ServeOptions(**options),
                                models=[(n, m, e) for (n, m), e in zip(entries, engines)])) as url:
            yield url
    finally:
        for e in engines:
            e.close()


@pytest.fixture(scope="module")
def models(fastllm_home):
    return [("smollm2", Model.from_pretrained(n_ctx=512, threads=2)),
            ("tiny", Model.from_pretrained(TINY, n_ctx=128, threads=2))]


@pytest.fixture(scope="module")
def url(models):
    with serving_models(models) as url:
        yield url


def test_each_request_goes_to_the_model_it_names(models, url):
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["smollm2", "tiny"]
    for name, model in models:
        r = c.completions.create(model=name, prompt="The sea is", max_tokens=8, temperature=0)
        assert r.model == name and r.choices[0].text == model.generate("The sea is", 8, sampling=GREEDY)
        a = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="x", max_retries=0)
        m = a.messages.create(model=name, max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                              extra_body={"temperature": 0})
        assert m.model == name and m.content[0].text == model.chat([{"role": "user", "content": "Hi"}], 6,
                                                                   sampling=GREEDY)
        e = c.embeddings.create(model=name, input="x")
        assert len(e.data[0].embedding) == model.config.hidden_size and e.model == name
    # no model named: the first
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="", prompt="x", max_tokens=1)
    plain = c.post("/completions", body={"prompt": "The sea is", "max_tokens": 3, "temperature": 0},
                   cast_to=object)
    assert plain["model"] == "smollm2"


def test_an_unknown_model_is_a_404_in_the_apis_shape(url):
    c = client(url)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and "smollm2, tiny" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="gpt-4o", input="hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="text-embedding-3-small", input="hi")
    a = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        a.messages.create(model="claude-sonnet-4-5", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": e.value.body["error"]["message"]}}
    with pytest.raises(openai.BadRequestError, match="'model' must be a string"):
        c.post("/completions", body={"model": 5, "prompt": "x"}, cast_to=object)


def test_one_model_answers_any_name_and_says_its_own(models):
    with serving_models(models[1:]) as url:
        r = client(url).completions.create(model="gpt-4o", prompt="x", max_tokens=2)
        assert r.model == "tiny"


def test_serve_loads_every_model_it_is_given(monkeypatch, tmp_path, capsys):
    from fastllm.serve import server
    served = {}
    monkeypatch.setattr(cli, "serve", lambda models, options: served.update(models=models, options=options))
    assert cli.main(["serve", "--model", str(TINY), "--model", str(TINY), "--model-name", "a",
                     "--model-name", "b", "--ctx", "64", "--pooling", "mean", "-t", "1"]) == 0
    assert [(n, m.n_ctx, m.pooling.modes) for n, m in served["models"]] == [("a", 64, ("mean",)),
                                                                            ("b", 64, ("mean",))]
    listing = tmp_path / "models.json"
    listing.write_text(json.dumps({"models": [{"model": str(TINY), "name": "small", "ctx": 32},
                                              str(TINY)]}))
    assert cli.main(["serve", "--models-file", str(listing), "-t", "1"]) == 0
    assert [(n, m.n_ctx) for n, m in served["models"]] == [("small", 32), ("tiny-llama", 128)]
    assert cli.main(["serve", "--model", str(TINY), "--model-name", "solo", "-t", "1"]) == 0
    assert served["options"].model_name == "solo" and isinstance(served["models"], Model)
    for args, message in [(["--model", str(TINY), "--model", str(TINY), "--model-name", "a", "--model-name",
                            "b", "--model-name", "c"], "3 --model-name for 2 --model"),
                          (["--models-file", str(tmp_path / "none.json")], "--models-file"),
                          (["--models-file", str(listing), "--model", str(TINY)], "not both")]:
        capsys.readouterr()
        assert cli.main(["serve", *args]) == 1
        assert message in capsys.readouterr().err
    for content, message in [("[]", "non-empty list"), ('[{"model": "x", "port": 1}]', "sets 'port'"),
                             ("[5]", "entry 0 must be")]:
        listing.write_text(content)
        assert cli.main(["serve", "--models-file", str(listing)]) == 1
        assert message in capsys.readouterr().err


def test_two_models_of_one_name_are_refused(models):
    with pytest.raises(ValueError, match="two models are served as 'x'"):
        create_app(None, None, models=[("x", m, None) for _, m in models])
