"""fastllm serve through OpenAI's own client, on 127.0.0.1: completions and
chat, streaming and not, logprobs, 16 concurrent clients whose replies equal
the model's alone (batch invariance through the server), bad requests, an
overfull queue, a client that goes away, the API key and the metrics."""
import json
import socket
import threading
import urllib.request
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from fastllm import Model, SamplingParams  # noqa: E402
from fastllm.server import create_app  # noqa: E402
from fastllm.serving import BatchEngine  # noqa: E402

GREEDY = SamplingParams(temperature=0)


@contextmanager
def running(model, parallel=4, max_queue=32, api_key=None):
    """A server on a free port of 127.0.0.1; yields (base_url, engine)."""
    engine = BatchEngine(model, parallel=parallel, max_queue=max_queue)
    app = create_app(model, engine, "smollm2", api_key)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < end, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", engine
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()
        sock.close()


def client(url, **kw):
    return openai.OpenAI(base_url=url, api_key=kw.pop("api_key", "none"), max_retries=0, timeout=120, **kw)


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return Model.from_pretrained(smollm2_dir, n_ctx=512, threads=2)


@pytest.fixture(scope="module")
def server(model):
    with running(model) as (url, engine):
        yield url, engine


def messages(i):
    return [{"role": "user", "content": f"Name {i + 2} animals that live in the sea."}]


def test_chat_and_completions_equal_the_model_alone(model, server):
    url, _ = server
    c = client(url)
    assert [m.id for m in c.models.list().data] == ["smollm2"]
    r = c.chat.completions.create(model="smollm2", messages=messages(0), max_tokens=24, temperature=0)
    assert r.choices[0].message.content == model.chat(messages(0), 24, sampling=GREEDY)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 10
    r = c.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=12,
                             temperature=0)
    assert r.choices[0].text == model.generate("The capital of France is", 12, sampling=GREEDY)


def test_streaming_gives_the_same_text_and_usage(model, server):
    c = client(server[0])
    chunks = list(c.chat.completions.create(model="smollm2", messages=messages(1), max_tokens=20,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == model.chat(messages(1), 20, sampling=GREEDY)
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    pieces = list(c.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=10,
                                       temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == model.generate("Once upon a time", 10,
                                                                        sampling=GREEDY)


def test_sixteen_concurrent_clients_each_get_their_reply_alone(model, server):
    url, _ = server
    want = [model.chat(messages(i), 16, sampling=GREEDY) for i in range(16)]

    def ask(i):
        r = client(url).chat.completions.create(model="smollm2", messages=messages(i), max_tokens=16,
                                                temperature=0)
        return r.choices[0].message.content
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert got == want


def test_logprobs(server):
    r = client(server[0]).chat.completions.create(model="smollm2", messages=messages(2), max_tokens=8,
                                                   temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])   # greedy takes the most likely token
        assert entry.logprob <= 0


def test_bad_requests_get_openai_errors(model, server):
    c = client(server[0])
    for bad in ({"temperature": 5}, {"n": 0}, {"max_tokens": -1}, {"stop": 3}):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="smollm2", messages=messages(0), **bad)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="smollm2", prompt="word " * 600, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="smollm2", messages=[])


def test_a_client_that_goes_away_frees_its_slot(server):
    url, engine = server
    stream = client(url).chat.completions.create(model="smollm2", messages=messages(3), max_tokens=400,
                                                 temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    end = time.monotonic() + 10
    while engine.active:
        assert time.monotonic() < end, "the slot was not freed"
        time.sleep(0.01)


def test_a_full_queue_answers_503(model):
    with running(model, parallel=1, max_queue=1) as (url, engine):
        long = client(url).chat.completions.create(model="smollm2", messages=messages(4), max_tokens=300,
                                                   temperature=0, stream=True)
        next(iter(long))
        waiting = ThreadPoolExecutor(1).submit(
            lambda: client(url).completions.create(model="smollm2", prompt="Hi", max_tokens=2))
        end = time.monotonic() + 10
        while engine.queue_depth == 0:
            assert time.monotonic() < end
            time.sleep(0.005)
        with pytest.raises(openai.InternalServerError) as e:
            client(url).completions.create(model="smollm2", prompt="Hello", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        long.close()
        assert waiting.result(60).choices[0].text is not None


def test_api_key_and_metrics(model):
    with running(model, api_key="sesame") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            client(url).completions.create(model="smollm2", prompt="Hi", max_tokens=2)
        r = client(url, api_key="sesame").completions.create(model="smollm2", prompt="Hi", max_tokens=3)
        assert r.usage.completion_tokens > 0
        text = urllib.request.urlopen(url.replace("/v1", "/metrics")).read().decode()
        assert 'fastllm_requests_total{endpoint="completions",status="401"} 1' in text
        assert 'fastllm_requests_total{endpoint="completions",status="200"} 1' in text
        assert "fastllm_generated_tokens_total" in text and "fastllm_queue_depth 0" in text
        health = json.loads(urllib.request.urlopen(url.replace("/v1", "/health")).read())
        assert health["status"] == "ok"
