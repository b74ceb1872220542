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
from fastllm.serve.server import ServeOptions, create_app, uvicorn_config  # noqa: E402
from fastllm.serve.serving import BatchEngine  # noqa: E402

GREEDY = SamplingParams(temperature=0)


@contextmanager
def running(model, parallel=4, max_queue=32, api_key=None, **options):
    """A server on a free port of 127.0.0.1, configured as `fastllm serve`
    configures uvicorn; yields (base_url, engine)."""
    engine = BatchEngine(model, parallel=parallel, max_queue=max_queue)
    opts = ServeOptions(**options)
    try:
        with serving(create_app(model, engine, "smollm2", api_key, opts), opts) as url:
            yield url, engine
    finally:
        engine.close()


@contextmanager
def serving(app, options=ServeOptions()):
    """app served on a free port of 127.0.0.1, with the settings `fastllm
    serve` gives uvicorn for options; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_config(options)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < end, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(30)
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


@pytest.mark.slow
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


def test_a_mixture_of_experts_answers_each_client_as_alone(fastllm_home):
    """Concurrent requests to a mixture of experts (tokens of several
    sequences grouped by expert in each batched step) get the model's
    replies alone."""
    from pathlib import Path
    moe = Model.from_pretrained(Path(__file__).parent / "data" / "moe-gguf" / "qwen3moe-F32.gguf", threads=2)
    prompts = [f"Item {i}: the sea holds {i * 7} fish and" for i in range(6)]
    want = [moe.generate(p, 14, sampling=GREEDY) for p in prompts]
    with running(moe, parallel=3) as (url, _):
        def ask(p):
            return client(url).completions.create(model="smollm2", prompt=p, max_tokens=14,
                                                  temperature=0).choices[0].text
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(ask, prompts))
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
        # The one slot must still be busy when the third request comes: the
        # long reply runs to its 400 tokens (ignore_eos), and the other two
        # requests' clients are made beforehand, so that they follow at once.
        waiter, third, pool = client(url), client(url), ThreadPoolExecutor(1)
        long = client(url).chat.completions.create(model="smollm2", messages=messages(4), max_tokens=400,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(long))
        waiting = pool.submit(lambda: waiter.completions.create(model="smollm2", prompt="Hi", max_tokens=2))
        end = time.monotonic() + 10
        while engine.queue_depth == 0:
            assert time.monotonic() < end
            time.sleep(0.005)
        with pytest.raises(openai.InternalServerError) as e:
            third.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        long.close()
        assert waiting.result(60).choices[0].text is not None


def test_api_key_and_metrics(model):
    with running(model, api_key="sesame") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            client(url).completions.create(model="smollm2", prompt="Hi", max_tokens=2)
        r = client(url, api_key="sesame").completions.create(model="smollm2", prompt="Hi", max_tokens=3)
        assert r.usage.completion_tokens > 0
        metrics = urllib.request.Request(url.replace("/v1", "/metrics"), headers={"Authorization": "Bearer sesame"})
        text = urllib.request.urlopen(metrics).read().decode()
        assert 'fastllm_requests_total{endpoint="completions",status="401"} 1' in text
        assert 'fastllm_requests_total{endpoint="completions",status="200"} 1' in text
        assert "fastllm_generated_tokens_total" in text and "fastllm_queue_depth 0" in text
        health = json.loads(urllib.request.urlopen(url.replace("/v1", "/health")).read())
        assert health["status"] == "ok"


# ------------------------------------------------------------ robustness

def post(url, path, body, timeout=120):
    """(status, JSON) of a POST of body (bytes or a JSON value)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url.replace("/v1", "") + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def openai_error(status, body, code):
    assert status == code, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_fields_are_refused_before_they_take_a_slot(model):
    with running(model, parallel=1, max_queue=1) as (url, engine):
        for bad in ({"stop": 3}, {"stream": "yes"}, {"stream": True, "stream_options": 5},
                    {"seed": -2}, {"max_tokens": 0}, {"repetition_penalty": 1e308}, {"stop": ""},
                    {"n": 99}, {"logit_bias": {"100000": 1}}):
            status, body = post(url, "/v1/chat/completions", {"messages": messages(0), **bad})
            openai_error(status, body, 400)
            assert engine.active == 0 and engine.queue_depth == 0, bad
        # an error that quotes a lone surrogate of the client's still renders
        status, body = post(url, "/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}')
        assert "role" in openai_error(status, body, 400)["message"]
        status, body = post(url, "/v1/chat/completions",
                            b'{"messages": [], "repetition_penalty": Infinity}')
        assert "not valid JSON" in openai_error(status, body, 400)["message"]
        status, body = post(url, "/v1/chat/completions", {"messages": messages(0), "n": 2})
        assert "at most 1 on this server" in openai_error(status, body, 400)["message"]
        # the one slot is free for a good request
        r = client(url).chat.completions.create(model="smollm2", messages=messages(0), max_tokens=2)
        assert r.choices[0].finish_reason == "length"


def test_seed_minus_one_is_a_random_seed_and_the_engine_lives_on(model, server):
    url, engine = server
    c = client(url)
    for _ in range(2):
        # (ignore_eos: a random draw may end the reply before 3 tokens)
        r = c.chat.completions.create(model="smollm2", messages=messages(1), max_tokens=3, seed=-1,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    assert engine.alive
    health = json.loads(urllib.request.urlopen(url.replace("/v1", "/health")).read())
    assert health["status"] == "ok"


def test_the_servers_seed_is_that_of_requests_that_give_none(model):
    ask = {"model": "smollm2", "messages": messages(3), "max_tokens": 8, "temperature": 1.5,
           "extra_body": {"ignore_eos": True}}
    with running(model, seed=7) as (url, _):
        c = client(url)
        unseeded = [c.chat.completions.create(**ask).choices[0].message.content for _ in range(2)]
        assert unseeded[0] == unseeded[1] == c.chat.completions.create(**ask, seed=7).choices[0].message.content
        assert c.chat.completions.create(**ask, seed=8).choices[0].message.content != unseeded[0]
        two = c.chat.completions.create(**ask, n=2).choices
        assert [x.message.content for x in two] == [
            unseeded[0], c.chat.completions.create(**ask, seed=8).choices[0].message.content]
        anthropic = {"model": "smollm2", "messages": messages(3), "max_tokens": 8, "temperature": 1.0,
                     "ignore_eos": True}
        (status, body), again = post(url, "/v1/messages", anthropic), post(url, "/v1/messages", anthropic)
        assert status == again[0] == 200 and body["content"] == again[1]["content"]
    for bad in (-1, 2**64, 1.5, True, "7"):
        with pytest.raises(ValueError, match="seed"):
            ServeOptions(seed=bad)


def test_errors_of_routing_and_bodies_keep_openais_shape(model):
    with running(model, max_body=1000) as (url, engine):
        base = url.replace("/v1", "")
        for path, method, code in (("/v1/nowhere", "GET", 404), ("/v1/chat/completions", "GET", 405),
                                   ("/health", "POST", 405)):
            req = urllib.request.Request(base + path, method=method, data=b"{}" if method == "POST" else None)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req)
            openai_error(e.value.code, json.loads(e.value.read()), code)
        status, body = post(url, "/v1/completions", {"prompt": "x" * 2000})
        assert "larger than 1000 bytes" in openai_error(status, body, 413)["message"]
        for raw in (b"{nope", b"[" * 400 + b"]" * 400, b'{"prompt": ' + b"[" * 300 + b"]" * 300 + b"}"):
            status, body = post(url, "/v1/completions", raw)
            openai_error(status, body, 400)
        assert engine.alive


def _raw_reply(url, head: bytes, body: bytes = b"") -> bytes:
    """The status line and headers the server answers to a raw request."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + body)
        s.settimeout(30)
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += s.recv(4096)
        return reply


def test_a_fifty_megabyte_body_is_refused_at_once(model, server):
    """Refused from its Content-Length, or, without one, as soon as the
    chunks read pass the limit."""
    url, engine = server
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (50 << 20))
    assert _raw_reply(url, head, b'{"prompt": "aaaa').startswith(b"HTTP/1.1 413")
    chunk = b"a" * (1 << 20)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(5))
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    assert _raw_reply(url, head, chunked).startswith(b"HTTP/1.1 413")
    assert engine.active == 0


def test_a_body_that_does_not_arrive_gets_408(model):
    with running(model, body_timeout=0.5) as (url, engine):
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{")
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda _: _raw_reply(url, head), range(3)))
        assert all(r.startswith(b"HTTP/1.1 408") for r in replies), replies


def test_a_failure_inside_a_step_fails_that_request_and_the_next_succeeds(model, monkeypatch):
    from fastllm.serve import serving
    real = serving.extend_together
    calls = []

    def fail_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real(*args)
    with running(model) as (url, engine):
        monkeypatch.setattr(serving, "extend_together", fail_once)
        status, body = post(url, "/v1/chat/completions", {"messages": messages(2), "max_tokens": 4})
        error = openai_error(status, body, 500)
        assert error["type"] == "server_error" and "injected fault" in error["message"]
        r = client(url).chat.completions.create(model="smollm2", messages=messages(2), max_tokens=4,
                                                temperature=0)
        assert r.usage.completion_tokens == 4 and engine.alive
        # streamed: the error comes as an event in OpenAI's shape
        calls.clear()
        stream = client(url).chat.completions.create(model="smollm2", messages=messages(2), max_tokens=4,
                                                     stream=True)
        with pytest.raises(openai.APIError, match="injected fault"):
            list(stream)
        engine.close()
        status, body = json_get(url.replace("/v1", "/health"))
        assert status == 503 and body["status"] == "unhealthy"


def json_get(url):
    try:
        with urllib.request.urlopen(url) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_content_parts_null_content_tool_messages_and_names(model, server):
    c = client(server[0])
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name two"},
                                          {"type": "text", "text": "animals that live in the sea."}]}]
    joined = [{"role": "user", "content": "Name two\nanimals that live in the sea."}]
    a = c.chat.completions.create(model="smollm2", messages=parts, max_tokens=8, temperature=0)
    b = c.chat.completions.create(model="smollm2", messages=joined, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    history = [{"role": "user", "content": "Weather in Paris?", "name": "ann"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = c.chat.completions.create(model="smollm2", messages=history, max_tokens=4,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError, match="text only"):
        c.chat.completions.create(model="smollm2", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


@pytest.mark.slow
def test_n_choices_penalties_bias_and_ignore_eos(model, server):
    c = client(server[0])
    prompt = messages(5)
    r = c.chat.completions.create(model="smollm2", messages=prompt, max_tokens=6, temperature=1.0,
                                  seed=11, n=3)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    again = c.chat.completions.create(model="smollm2", messages=prompt, max_tokens=6, temperature=1.0,
                                      seed=11, n=3)
    texts = [ch.message.content for ch in r.choices]
    assert texts == [ch.message.content for ch in again.choices]   # reproducible
    # choice i is what a single request seeded seed + i gives
    one = c.chat.completions.create(model="smollm2", messages=prompt, max_tokens=6, temperature=1.0, seed=12)
    assert one.choices[0].message.content == texts[1]
    assert 3 <= r.usage.completion_tokens <= 18   # counted over all choices
    chunks = list(c.chat.completions.create(model="smollm2", messages=prompt, max_tokens=5, temperature=1.0,
                                            seed=11, n=3, stream=True))
    streamed = ["", "", ""]
    for ch in chunks:
        for choice in ch.choices:
            streamed[choice.index] += choice.delta.content or ""
    want = [t[:len(s)] for t, s in zip(texts, streamed)]
    assert streamed == want
    # a bias of -100 on the greedy reply's first token changes it; +100 on another forces it
    plain = c.completions.create(model="smollm2", prompt="The sea is", max_tokens=3, temperature=0)
    first = model.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    biased = c.completions.create(model="smollm2", prompt="The sea is", max_tokens=3, temperature=0,
                                  logit_bias={str(first): -100})
    assert biased.choices[0].text != plain.choices[0].text
    forced = c.completions.create(model="smollm2", prompt="The sea is", max_tokens=3, temperature=0,
                                  logit_bias={"42": 100})
    assert forced.choices[0].text == model.tokenizer.decode([42, 42, 42])
    # penalties change a greedy reply that repeats itself
    loop = c.completions.create(model="smollm2", prompt="one one one one one", max_tokens=12, temperature=0)
    penalized = c.completions.create(model="smollm2", prompt="one one one one one", max_tokens=12,
                                     temperature=0, frequency_penalty=2.0, presence_penalty=1.0)
    assert penalized.choices[0].text != loop.choices[0].text
    # ignore_eos: a reply that would end at the end-of-turn token runs to max_tokens
    short = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                      max_tokens=60, temperature=0)
    assert short.choices[0].finish_reason == "stop"
    full = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                     max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 60


def test_the_servers_fallbacks_are_the_models_generation_config(model, server, monkeypatch):
    c = client(server[0])
    greedy = c.chat.completions.create(model="smollm2", messages=messages(6), max_tokens=5, temperature=0)
    monkeypatch.setattr(model, "generation_defaults", {"temperature": 0.0, "max_new_tokens": 5})
    r = c.chat.completions.create(model="smollm2", messages=messages(6))
    assert r.choices[0].message.content == greedy.choices[0].message.content
    assert r.usage.completion_tokens == 5


def test_a_time_limit_ends_a_request_as_length(model):
    with running(model, request_timeout=0.05) as (url, engine):
        r = client(url).completions.create(model="smollm2", prompt="Once upon a time", max_tokens=480,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens < 480
        assert engine.active == 0


def test_serve_passes_its_limits_to_uvicorn_and_says_what_it_serves(model, monkeypatch, capsys):
    from fastllm.serve import server
    got = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: got.update(kw))
    options = ServeOptions(port=8123, parallel=2, api_key="k", keep_alive=3, head_timeout=4, shutdown_timeout=6)
    server.serve(model, options)
    assert got["timeout_keep_alive"] == 3 and got["timeout_graceful_shutdown"] == 6 and got["port"] == 8123
    assert got["http"].__name__.startswith("HeadDeadline")
    line = capsys.readouterr().err
    assert str(model.source) in line and "2 slots of 512 tokens" in line
    assert "http://127.0.0.1:8123/v1" in line and "API key is required" in line
    assert any(t in line for t in model.weight_types)
    with pytest.raises(ValueError, match="max_body must be positive"):
        ServeOptions(max_body=0)


@pytest.mark.slow
def test_concurrent_clients_on_the_q4_1_file_with_int8_activations_get_their_reply_alone(fastllm_home):
    """Batch invariance on the path `fastllm serve` runs by default: the
    default model's own GGUF (Q4_1) with int8 activations, greedy and seeded."""
    from fastllm.load.hub import default_gguf_path
    q4 = Model.from_pretrained(str(default_gguf_path()), n_ctx=512, threads=2)
    assert q4.activations == "int8" and "q4_1" in q4.weight_types
    settings = [dict(temperature=0), dict(temperature=0.9, top_p=0.95, seed=7)]
    want = [[q4.chat(messages(i), 12, sampling=SamplingParams(**s)) for i in range(8)] for s in settings]
    with running(q4, parallel=8) as (url, _):
        for s, expected in zip(settings, want):
            def ask(i):
                r = client(url).chat.completions.create(model="smollm2", messages=messages(i), max_tokens=12,
                                                        **s)
                return r.choices[0].message.content
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(ask, range(8))) == expected


def test_a_stop_string_ends_every_choice_with_stop(model, server):
    c = client(server[0])
    plain = c.completions.create(model="smollm2", prompt="The sea is", max_tokens=12, temperature=0)
    text = plain.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    r = c.completions.create(model="smollm2", prompt="The sea is", max_tokens=12, temperature=0, stop=stop, n=2)
    assert [ch.text for ch in r.choices] == [text[:text.index(stop)]] * 2
    assert [ch.finish_reason for ch in r.choices] == ["stop", "stop"]
    chunks = list(c.completions.create(model="smollm2", prompt="The sea is", max_tokens=12, temperature=0,
                                       stop=[stop], stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text[:text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
