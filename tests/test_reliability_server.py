"""The server against hostile clients: a body that would cost quadratic
time to pre-scan, request heads sent a byte at a time, schemas that blow up
inside llguidance, a client that stops reading while the server shuts
down, and what may be read without the API key. Each gets a clear 4xx (or a
closed connection), and nobody else waits for it."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from fastllm import Model  # noqa: E402
from fastllm.serve.server import ServeOptions, create_app  # noqa: E402
from fastllm.serve.serving import BatchEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "tiny-llama"
KEY = "sesame"


@pytest.fixture(scope="module")
def model():
    return Model.from_pretrained(TINY, n_ctx=128, threads=1)


@contextmanager
def running(model, api_key=None, **options):
    """test_server's server, with the tiny model's two slots; yields (host, port, engine)."""
    from test_server import running as server
    with server(model, parallel=2, max_queue=8, api_key=api_key, **options) as (url, engine):
        host, port = url.split("//")[1].split("/")[0].split(":")
        yield host, int(port), engine


def exchange(host, port, request: bytes, timeout=30) -> bytes:
    """The whole answer to a raw HTTP/1.1 request sent with Connection: close."""
    with socket.create_connection((host, port)) as s:
        s.sendall(request)
        s.settimeout(timeout)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        return reply


def http(host, port, method, path, body=b"", headers=()) -> tuple:
    """(status, headers, body) of one request."""
    head = [f"{method} {path} HTTP/1.1", "Host: x", "Connection: close", f"Content-Length: {len(body)}",
            *headers]
    reply = exchange(host, port, ("\r\n".join(head) + "\r\n\r\n").encode() + body)
    top, _, data = reply.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    fields = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), fields, data


def app_call(app, method, path, body=b"", headers=()):
    """(status, JSON or text) of a request to the ASGI app, in-process."""
    from starlette.testclient import TestClient
    with TestClient(app) as c:
        r = c.request(method, path, content=body, headers=dict(headers))
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


# ---------------------------------------------------- the body's pre-scan

HOSTILE_BODIES = {
    # a string opened and never closed, every quote escaped: a backtracking
    # string pattern starts a scan to the end at each of them
    "unterminated escaped quotes": b'{"prompt":"' + b'\\"' * (1 << 19),
    "unterminated escape runs": b'{"prompt":"' + b'\\\\\\"' * (1 << 18),
    "quotes and brackets": b'{"prompt":"' + b'[\\"{' * (1 << 18),
}


@pytest.mark.parametrize("name", HOSTILE_BODIES)
def test_a_megabyte_of_unterminated_escapes_is_refused_at_once(name):
    """Refused as invalid JSON in one pass over the body. The scan runs in a
    child process with a deadline a hundred times what the linear scan
    needs: the quadratic one would take hours on this body."""
    body = HOSTILE_BODIES[name]
    code = ("import sys; from fastllm.serve import openai_api as api\n"
            "body = sys.stdin.buffer.read()\n"
            "try:\n    api.parse_json(body)\nexcept api.APIError as e:\n    print(e.status, e)\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], input=body, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the pre-scan of a {len(body)}-byte body did not end within 60 s")
    assert done.stdout.decode().startswith("400 the request body is not valid JSON"), done.stderr[-2000:]


def test_the_depth_scan_still_sees_brackets_outside_strings_only():
    from fastllm.serve import openai_api as api
    deep = b'{"a": "' + b"[" * 500 + b'\\"", "b": ' + b"[" * 70 + b"]" * 70 + b"}"
    with pytest.raises(api.APIError, match="deeper than 64"):
        api.parse_json(deep)
    fine = b'{"a": "' + b"[" * 500 + b'\\\\", "b": ' + b"[" * 60 + b"]" * 60 + b"}"
    assert api.parse_json(fine)["a"] == "[" * 500 + "\\"


# ------------------------------------------------------------ slow heads

def slow_head(host, port, stop: threading.Event, closed: list):
    """A client that sends a request head one byte at a time and never ends it."""
    s = socket.create_connection((host, port))
    s.settimeout(0.2)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    try:
        for byte in head:
            if stop.is_set():
                return
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed.append(time.monotonic())
                return
            try:
                if s.recv(1024) == b"":
                    closed.append(time.monotonic())
                    return
            except socket.timeout:
                pass
            except OSError:
                closed.append(time.monotonic())
                return
    finally:
        s.close()


def test_slow_request_heads_are_cut_and_do_not_crowd_out_real_clients(model):
    with running(model, head_timeout=1.0, max_connections=2) as (host, port, engine):
        stop, closed = threading.Event(), []
        started = time.monotonic()
        slow = [threading.Thread(target=slow_head, args=(host, port, stop, closed)) for _ in range(4)]
        for t in slow:
            t.start()
        time.sleep(0.3)
        try:
            # four half-sent heads and a limit of two: a whole request is still served
            status, _, body = http(host, port, "POST", "/v1/completions",
                                   json.dumps({"prompt": "Hi", "max_tokens": 2}).encode(),
                                   ["Content-Type: application/json"])
            assert status == 200, body
            for t in slow:
                t.join(30)
            # the server closed every slow head (a byte every 0.2 s would keep them for 30 min)
            assert len(closed) == 4
            assert max(closed) - started < 20
        finally:
            stop.set()


# --------------------------------------------------------- schema bombs

BOMBS = {
    "refers to itself": {"$ref": "#"},
    "a cycle of refs": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "a million repetitions": {"type": "string", "pattern": "^a{1000000}$"},
    "a megabyte const": {"const": "x" * (1 << 20)},
    "a bomb behind a required key": {"type": "object", "required": ["k"],
                                     "properties": {"k": {"type": "string", "pattern": "^b{1000000}$"}}},
}


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("name", BOMBS)
def test_a_schema_that_fails_inside_llguidance_is_refused_up_front(model, name):
    pytest.importorskip("llguidance")
    from fastllm.generate.constrain import reply_grammar
    with pytest.raises(ValueError, match="response_format"):
        reply_grammar(model, response_format=schema_format(BOMBS[name]))
    with pytest.raises(ValueError, match="response_format"):
        model.generate("Hi", 8, response_format=schema_format(BOMBS[name]))


def test_schema_bombs_get_400_and_never_reach_the_engine():
    pytest.importorskip("llguidance")
    model = Model.from_pretrained(TINY, n_ctx=1024, threads=1)   # room for a tool's description
    engine = BatchEngine(model, parallel=2, max_queue=8)
    try:
        app = create_app(model, engine, "tiny")
        for name, schema in BOMBS.items():
            for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 8, "response_format": schema_format(schema)}),
                               ("/v1/completions", {"prompt": "Hi", "max_tokens": 8, "stream": True,
                                                    "response_format": schema_format(schema)})]:
                status, reply = app_call(app, "POST", path, json.dumps(body).encode(),
                                         [("content-type", "application/json")])
                assert status == 400, (name, reply)
                assert reply["error"]["param"] == "response_format", reply
                assert "<state>" not in reply["error"]["message"] and len(reply["error"]["message"]) < 700
        tool = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]
        status, reply = app_call(app, "POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "tools": tool,
             "tool_choice": "required"}).encode(), [("content-type", "application/json")])
        assert status == 400 and reply["error"]["param"] == "tools", reply
        assert engine.active == 0 and engine.queue_depth == 0
    finally:
        engine.close()


def test_a_constraint_that_fails_mid_generation_is_the_requests_400_not_a_500(model):
    """Whatever the probe misses, a grammar that fails while decoding is the
    request's fault: a 400 in OpenAI's shape, not a 500 with llguidance's
    state in it."""
    pytest.importorskip("llguidance")
    from fastllm.generate.constrain import ConstraintError, GrammarConstraint

    class Failing:
        def compute_bitmask(self):
            return b"\xff" * 64

        def is_error(self):
            return True

        def get_error(self):
            return "lexer error: too many expressions constructed\n<state>\nTokens: x"

    with pytest.raises(ConstraintError, match="too many expressions") as e:
        GrammarConstraint(Failing()).mask(__import__("numpy").zeros(300, "float32"))
    assert isinstance(e.value, ValueError) and "<state>" not in str(e.value)
    from fastllm.serve.openai_api import engine_error
    assert engine_error(e.value).status == 400


# --------------------------------------------------------------- shutdown

def test_sigterm_ends_the_server_while_a_client_holds_a_stream_unread(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "-m", "fastllm", "serve", "--model", str(TINY), "--ctx", "4096",
                               "--threads", "1", "--port", str(port), "--shutdown-timeout", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                assert time.monotonic() < end and server.poll() is None, server.stderr.read()[-2000:]
                time.sleep(0.1)
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        reader.connect(("127.0.0.1", port))
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 4000,
                           "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "n": 4}).encode()
        reader.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        # some 40 MB of chunks (4 choices, 4000 tokens, 20 logprobs each), never read past the first
        assert reader.recv(64).startswith(b"HTTP/1.1 200")
        time.sleep(3)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server was still shutting down 30 s after SIGTERM")
        reader.close()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# ------------------------------------------------------------------ auth

def test_metrics_need_the_key_and_health_says_only_its_status_without_it(model):
    engine = BatchEngine(model, parallel=1, max_queue=1)
    try:
        app = create_app(model, engine, "tiny", KEY)
        status, body = app_call(app, "GET", "/metrics")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body = app_call(app, "GET", "/metrics", headers=[("authorization", f"Bearer {KEY}")])
        assert status == 200 and "fastllm_requests_total" in body
        assert app_call(app, "GET", "/health") == (200, {"status": "ok"})
        status, body = app_call(app, "GET", "/health", headers=[("authorization", f"Bearer {KEY}")])
        assert status == 200 and body["pid"] == os.getpid() and "active" in body
        # without a key configured, both stay open as before
        open_app = create_app(model, engine, "tiny")
        assert app_call(open_app, "GET", "/metrics")[0] == 200
        assert app_call(open_app, "GET", "/health")[1]["pid"] == os.getpid()
    finally:
        engine.close()


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_auth_scheme_is_case_insensitive(model, scheme):
    engine = BatchEngine(model, parallel=1, max_queue=1)
    try:
        app = create_app(model, engine, "tiny", KEY)
        assert app_call(app, "GET", "/v1/models", headers=[("authorization", f"{scheme} {KEY}")])[0] == 200
        for bad in (f"{scheme} {KEY.upper()}", f"{scheme}{KEY}", f"Basic {KEY}", KEY, f"{scheme} {KEY}x"):
            assert app_call(app, "GET", "/v1/models", headers=[("authorization", bad)])[0] == 401, bad
    finally:
        engine.close()


def test_the_key_is_compared_in_constant_time(model, monkeypatch):
    import hmac
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    engine = BatchEngine(model, parallel=1, max_queue=1)
    try:
        app = create_app(model, engine, "tiny", KEY)
        assert app_call(app, "GET", "/v1/models", headers=[("authorization", "Bearer nope")])[0] == 401
        assert calls
        calls.clear()   # Anthropic's clients send x-api-key
        assert app_call(app, "GET", "/v1/models", headers=[("x-api-key", "nope")])[0] == 401
        assert app_call(app, "GET", "/v1/models", headers=[("x-api-key", KEY)])[0] == 200
        assert (b"nope", KEY.encode()) in calls
    finally:
        engine.close()


# ------------------------------------------------------------- fairness

def test_a_stream_with_pieces_piled_up_lets_other_tasks_run_between_its_chunks(model):
    """A client that reads slowly lets its pieces pile up; once it reads
    again, sends that need not wait and a queue that holds more never
    suspend, and every other client (/health, other streams) waited until
    the pile was gone: seconds, with logprobs. Now the loop turns between
    chunks."""
    import asyncio
    engine = BatchEngine(model, parallel=1, max_queue=1)
    try:
        app = create_app(model, engine, "tiny")
        body = json.dumps({"prompt": "Hi", "max_tokens": 100, "ignore_eos": True, "stream": True}).encode()
        chunks, ticks, chunks_per_tick = [], [0], []

        async def main():
            stop = asyncio.Event()

            async def ticker():
                while not stop.is_set():
                    chunks_per_tick.append(len(chunks))
                    ticks[0] += 1
                    await asyncio.sleep(0)

            sent = []

            async def receive():
                if not sent:
                    sent.append(1)
                    return {"type": "http.request", "body": body, "more_body": False}
                await stop.wait()
                return {"type": "http.disconnect"}

            async def send(message):
                if message["type"] == "http.response.start":
                    await asyncio.sleep(1)   # a slow reader: the pieces pile up meanwhile
                elif message["type"] == "http.response.body" and message.get("body"):
                    chunks.append(message["body"])
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
            tick = asyncio.ensure_future(ticker())
            await app(scope, receive, send)
            stop.set()
            await tick
        asyncio.run(main())
        assert b"[DONE]" in chunks[-1] and len(chunks) > 50
        # the ticker ran between the chunks of the pile, not only before and after it
        steps = [b - a for a, b in zip(chunks_per_tick, chunks_per_tick[1:])]
        assert max(steps) <= 3, max(steps)
    finally:
        engine.close()
