"""Embeddings: Model.embed against sentence-transformers in float64 on a
tiny random Qwen3-Embedding-like checkpoint (a Qwen3 with last-token
pooling, and the same with the other pooling modes its config can name),
the final-normed hidden states against transformers' last_hidden_state,
how pooling is read, and /v1/embeddings, /tokenize and /detokenize through
fastllm serve (OpenAI's client, and HF tokenizers for the token ids)."""
import base64
import json
import shutil
import urllib.request

import numpy as np
import pytest

from fastllm import Model
from fastllm.generate.embeddings import Pooling, gguf_pooling, read_pooling
from fastllm.spec.errors import ModelFileError

torch = pytest.importorskip("torch")
TEXTS = ["The capital of France is Paris.", "h\u00e9llo w\u00f6rld \U0001f642", "a", "word " * 40]


@pytest.fixture(scope="module")
def embedding_folders(request, tmp_path_factory):
    """pooling -> a Qwen3-Embedding-like folder pooled that way (one
    checkpoint, one folder per Pooling config)."""
    from oracles.tiny_embedding_models import POOLING_CONFIGS, make_tiny_qwen3_embedding
    cache = request.config.cache.mkdir("fastllm_qwen_tokenizers")
    root = tmp_path_factory.mktemp("embedding")
    base = make_tiny_qwen3_embedding(root / "lasttoken", cache)
    folders = {"lasttoken": base}
    for pooling, config in POOLING_CONFIGS.items():
        if pooling != "lasttoken":
            folders[pooling] = shutil.copytree(base, root / pooling.replace("+", "_"))
            (folders[pooling] / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return folders


@pytest.fixture(scope="module")
def embedder(embedding_folders):
    return Model.from_pretrained(embedding_folders["lasttoken"], n_ctx=256, threads=2)


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["lasttoken", "mean", "cls", "mean+max"])
def test_embed_equals_sentence_transformers_in_float64(embedding_folders, pooling):
    st = pytest.importorskip("sentence_transformers")
    folder = embedding_folders[pooling]
    reference = st.SentenceTransformer(str(folder), device="cpu").to(torch.float64)
    want = reference.encode(TEXTS, batch_size=1, convert_to_numpy=True)   # one at a time: no padding
    model = Model.from_pretrained(folder, n_ctx=256, threads=2)
    got = model.embed(TEXTS)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    assert model.embed(TEXTS[0]).shape == (want.shape[1],)


def test_unnormalized_and_shortened_embeddings_against_transformers(embedder, embedding_folders):
    from transformers import AutoModel, AutoTokenizer
    folder = embedding_folders["lasttoken"]
    reference = AutoModel.from_pretrained(folder, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
        assert embedder.tokenizer.encode(text) == ids
        with torch.no_grad():
            hidden = reference(torch.tensor([ids])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(embedder.new_session().hidden(ids), hidden, atol=2e-5, rtol=1e-5)
        raw = embedder.embed(text, normalize=False)
        np.testing.assert_allclose(raw, hidden[-1], atol=2e-5, rtol=1e-5)
        short = embedder.embed(text, dimensions=16)
        np.testing.assert_allclose(short, hidden[-1][:16] / np.linalg.norm(hidden[-1][:16]), atol=2e-6)
        mean = embedder.embed(text, pooling="mean", normalize=False)
        np.testing.assert_allclose(mean, hidden.mean(axis=0), atol=2e-5, rtol=1e-5)


def test_hidden_states_over_several_chunks_match_the_lm_heads_input():
    from oracles.hf_reference import load_hf
    folder = "tests/data/tiny-llama"
    model = Model.from_pretrained(folder, threads=1)
    ids = list(range(3, 40))
    hidden = model.new_session(max_batch=5).hidden(ids)   # 8 chunks
    reference = load_hf(folder)
    with torch.no_grad():
        want = reference.model(torch.tensor([ids])).last_hidden_state[0].numpy()
    np.testing.assert_allclose(hidden, want, atol=2e-5, rtol=1e-5)
    # what the LM head multiplies: the logits follow from these rows
    head = reference.lm_head.weight.detach().numpy()
    np.testing.assert_allclose(hidden @ head.T, model.logits(ids), atol=2e-5, rtol=1e-5)


def test_how_pooling_is_read(tmp_path, embedding_folders):
    assert read_pooling(embedding_folders["mean"]).modes == ("mean",)
    assert read_pooling(embedding_folders["mean+max"]).modes == ("max", "mean")
    assert read_pooling(tmp_path) == Pooling()          # nothing said: the last token
    assert Pooling().modes == ("lasttoken",)
    assert Pooling.of("last").modes == ("lasttoken",) and Pooling.of(["mean", "cls"]).modes == ("cls", "mean")
    for bad in ("median", [], 3, ["mean", "sum"]):
        with pytest.raises(ValueError, match="pooling must be"):
            Pooling.of(bad)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    dense = read_pooling(tmp_path)
    assert dense.modes == ("mean",) and "Dense" in dense.unsupported
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "median"}))
    with pytest.raises(ModelFileError, match="pooling must be"):
        read_pooling(tmp_path)
    for broken in ("{", "[1, 2]", json.dumps([{"path": "../x", "type": "Pooling"}])):
        (tmp_path / "modules.json").write_text(broken)
        with pytest.raises(ModelFileError):
            read_pooling(tmp_path)
    assert gguf_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 3}).modes == ("lasttoken",)
    assert gguf_pooling({"general.architecture": "bert", "bert.pooling_type": 1}).modes == ("mean",)
    assert gguf_pooling({"general.architecture": "llama"}) == Pooling()
    assert "pooling_type" in gguf_pooling({"general.architecture": "x", "x.pooling_type": 4}).unsupported


def test_a_model_whose_pipeline_fastllm_cannot_follow_refuses_unless_told(embedder):
    saved = embedder._pooling
    try:
        embedder.pooling = Pooling(("mean",), "modules.json", "its pipeline has a Dense module")
        with pytest.raises(ValueError, match="Dense module"):
            embedder.embed("x")
        assert embedder.embed("x", pooling="mean").shape == (64,)
        embedder.pooling = "cls"
        assert embedder.pooling.modes == ("cls",)
    finally:
        embedder._pooling = saved
    with pytest.raises(ValueError, match="dimensions"):
        embedder.embed("x", dimensions=65)
    with pytest.raises(TypeError):
        embedder.embed([b"bytes"])
    assert embedder.embed([]).shape == (0, 64) and embedder.embed([], pooling=["mean", "max"]).shape == (0, 128)


# ---------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server(embedder):
    pytest.importorskip("uvicorn")
    from test_server import running
    with running(embedder, parallel=1) as (url, engine):
        yield url, engine


def post(url, path, body):
    request = urllib.request.Request(url.removesuffix("/v1") + path, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_v1_embeddings_through_openais_client(embedder, server):
    openai = pytest.importorskip("openai")
    from test_server import client
    c = client(server[0])
    r = c.embeddings.create(model="any", input=TEXTS)   # the client asks for base64 and decodes it
    got = np.array([d.embedding for d in r.data])
    np.testing.assert_array_equal(got, embedder.embed(TEXTS))
    assert [d.index for d in r.data] == [0, 1, 2, 3] and r.model == "smollm2"
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(embedder.tokenizer.encode(t)) for t in TEXTS)
    one = c.embeddings.create(model="any", input="a", dimensions=8, encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, embedder.embed("a", dimensions=8), atol=1e-7)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        c.embeddings.create(model="any", input="a", dimensions=65)


def test_v1_embeddings_takes_llama_servers_forms_of_input(embedder, server):
    ids = embedder.tokenizer.encode("hello world")
    status, plain = post(server[0], "/v1/embeddings", {"input": "hello world", "encoding_format": "float"})
    assert status == 200
    want = plain["data"][0]["embedding"]
    for form in (ids, [ids], {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]},
                 {"prompt_string": "hello world"}):
        status, body = post(server[0], "/v1/embeddings", {"input": form})
        assert status == 200 and body["data"][0]["embedding"] == want, form
    status, body = post(server[0], "/v1/embeddings", {"input": ["a", [5, 6], {"prompt_string": "b"}],
                                                      "encoding_format": "base64"})
    vectors = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]]
    np.testing.assert_array_equal(vectors[0], embedder.embed("a"))
    status, body = post(server[0], "/v1/embeddings", {"input": "a", "normalize": False})
    np.testing.assert_allclose(body["data"][0]["embedding"], embedder.embed("a", normalize=False), atol=1e-7)


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "non-empty array"),
    ({"input": None}, "'input' must be"),
    ({"input": [[]]}, "has no tokens"),
    ({"input": [1, "a", None]}, "'input' must be"),
    ({"input": [10**9]}, "outside the vocabulary"),
    ({"input": [[1], [-1]]}, "input[1]' token id -1"),
    ({"input": "word " * 300}, "too large"),
    ({"input": ["a"] * 2049}, "at most 2048"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "data:"}}]}}, "reads text only"),
    ({"input": {"content": "string"}}, "'input' must be"),
    ({"input": "a", "encoding_format": "int8"}, "'encoding_format' must be"),
    ({"input": "a", "dimensions": 0}, "'dimensions' must be an integer from 1 to 64"),
    ({"input": "\ud800"}, "cannot be tokenized"),
])
def test_bad_embedding_requests_are_400s(server, body, message):
    status, reply = post(server[0], "/v1/embeddings", body)
    assert status == 400 and message in reply["error"]["message"], reply


def test_tokenize_and_detokenize_agree_with_hf_tokenizers(embedder, server, embedding_folders):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(embedding_folders["lasttoken"] / "tokenizer.json"))
    text = "This is a test string with unicode \u5abd and emoji \U0001f917 <|im_start|>"
    status, body = post(server[0], "/tokenize", {"content": text})
    assert status == 200 and body["tokens"] == hf.encode(text, add_special_tokens=False).ids
    status, special = post(server[0], "/tokenize", {"content": text, "add_special": True})
    assert special["tokens"] == hf.encode(text).ids == body["tokens"] + [hf.token_to_id("<|endoftext|>")]
    status, pieces = post(server[0], "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == body["tokens"]
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                   for p in pieces["tokens"])
    assert raw.decode() == text and any(isinstance(p["piece"], list) for p in pieces["tokens"])
    status, back = post(server[0], "/detokenize", {"tokens": body["tokens"]})
    assert back["content"] == hf.decode(body["tokens"], skip_special_tokens=False) == text
    status, mixed = post(server[0], "/tokenize", {"content": ["a", 5, "b"], "add_special": True})
    assert mixed["tokens"] == hf.encode("a").ids + [5] + hf.encode("b", add_special_tokens=False).ids
    for path, bad, message in [("/tokenize", {"content": 5}, "'content' must be"),
                               ("/tokenize", {"content": ["a", -3]}, "outside the vocabulary"),
                               ("/tokenize", {"content": "a", "parse_special": False}, "not supported"),
                               ("/detokenize", {"tokens": [1, "a"]}, "array of token ids"),
                               ("/detokenize", {"tokens": [2**40]}, "outside the vocabulary")]:
        status, reply = post(server[0], path, bad)
        assert status == 400 and message in reply["error"]["message"], (path, bad, reply)


def test_a_long_embedding_job_stops_at_the_time_limit_or_when_the_client_goes():
    import asyncio
    from fastllm.serve.openai_api import APIError
    from fastllm.serve.server import ServeOptions, _cancellable

    class Client:
        gone = False

        async def is_disconnected(self):
            return self.gone

    def work(job, served, cancelled):   # an embedding job of many inputs, stopped between them
        for _ in range(600):
            if cancelled.wait(0.05):
                return None
        return "finished"

    with pytest.raises(APIError, match="did not finish within 0.2 s") as e:
        asyncio.run(_cancellable(work, None, None, Client(), ServeOptions(request_timeout=0.2)))
    assert e.value.status == 408
    client = Client()
    client.gone = True
    with pytest.raises(APIError, match="went away"):
        asyncio.run(_cancellable(work, None, None, client, ServeOptions()))
    quick = asyncio.run(_cancellable(lambda job, served, cancelled: [job], 7, None, Client(), ServeOptions()))
    assert quick == [7]
