"""What clients other than a chat app expect of fastllm serve: web pages
(CORS, its preflight and headers, from a real headless Chromium too),
evaluation harnesses (/v1/completions with lists of prompts or of token ids,
echo with the prompt's logprobs, max_tokens 0), and usage that says what
the server reused (cached_tokens) and what the bits depend on
(system_fingerprint). The prompt's logprobs equal, bit for bit, those of
the model run token by token."""
import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from fastllm import Model, SamplingParams  # noqa: E402
from fastllm.serve.serving import _logprobs  # noqa: E402
from test_server import client, openai_error, post, running  # noqa: E402

GREEDY = SamplingParams(temperature=0)
PAGE = "http://localhost:3000"


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return Model.from_pretrained(smollm2_dir, n_ctx=512, threads=2)


@pytest.fixture(scope="module")
def server(model):
    with running(model, api_key="sesame", cors_origins=f"{PAGE},localhost") as (url, engine):
        yield url, engine


def request(url, path, method="GET", headers=None, body=None):
    """(status, headers with lower-case names, body bytes) of one request."""
    req = urllib.request.Request(url.replace("/v1", "") + path, method=method, headers=headers or {},
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def preflight(url, origin, method="POST", asked="authorization, content-type", path="/v1/chat/completions"):
    return request(url, path, "OPTIONS",
                   {"Origin": origin, "Access-Control-Request-Method": method,
                    "Access-Control-Request-Headers": asked})


# ------------------------------------------------------------------ CORS

def test_a_preflight_from_an_allowed_origin_is_answered_without_the_key(server):
    url, _ = server
    for origin in (PAGE, "http://127.0.0.1:8080", "http://[::1]:5173", "http://localhost"):
        status, headers, _ = preflight(url, origin)
        assert status == 200, origin
        assert headers["access-control-allow-origin"] == origin
        assert headers["access-control-allow-credentials"] == "true"
        assert {m.strip() for m in headers["access-control-allow-methods"].split(",")} >= {"GET", "POST"}
        # the headers asked for are named back (the Fetch standard does not let "*" cover Authorization)
        assert headers["access-control-allow-headers"] == "authorization, content-type"


def test_a_preflight_from_another_origin_is_refused_in_openais_shape(server):
    url, _ = server
    for origin in ("http://evil.example", "http://localhost.evil.example", "http://notlocalhost:3000", "null"):
        status, headers, body = preflight(url, origin)
        assert "access-control-allow-origin" not in headers
        assert f"origin '{origin}'" in openai_error(status, json.loads(body), 403)["message"]
    status, _, body = preflight(url, PAGE, method="PATCH")
    assert "method 'PATCH'" in openai_error(status, json.loads(body), 403)["message"]


def test_a_refused_preflight_of_anthropics_api_is_in_its_shape(server):
    """(Found by the HTTP fuzzer: the refusal of a preflight to /v1/messages
    came in OpenAI's shape.)"""
    url, _ = server
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, headers, body = preflight(url, "http://evil.example", path=path)
        body = json.loads(body)
        assert status == 403 and "access-control-allow-origin" not in headers
        assert body["type"] == "error" and body["error"]["type"] == "permission_error", body
        assert "origin 'http://evil.example'" in body["error"]["message"]


def test_responses_carry_the_origin_and_the_key_is_still_needed(server, model):
    url, _ = server
    ask = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    status, headers, body = request(url, "/v1/chat/completions", "POST",
                                    {"Origin": PAGE, "Content-Type": "application/json"}, ask)
    assert status == 401 and headers["access-control-allow-origin"] == PAGE   # the page can read why
    status, headers, body = request(url, "/v1/chat/completions", "POST",
                                    {"Origin": PAGE, "Authorization": "Bearer sesame",
                                     "Content-Type": "application/json"}, {**ask, "stream": True})
    assert status == 200 and headers["access-control-allow-origin"] == PAGE
    assert body.decode().rstrip().endswith("data: [DONE]")
    status, headers, _ = request(url, "/v1/models", headers={"Origin": "http://evil.example",
                                                            "Authorization": "Bearer sesame"})
    assert status == 200 and "access-control-allow-origin" not in headers


def test_without_cors_origins_a_preflight_is_not_allowed(model):
    with running(model) as (url, _):
        status, headers, body = preflight(url, PAGE)
        assert "OPTIONS is not allowed" in openai_error(status, json.loads(body), 405)["message"]
        status, headers, _ = request(url, "/v1/models", headers={"Origin": PAGE})
        assert status == 200 and "access-control-allow-origin" not in headers


def test_cors_origins_that_are_not_origins_are_refused():
    from fastllm.serve.server import ServeOptions
    for bad in ("http://localhost:3000/", "localhost:3000", "http://a.example/x", ""):
        with pytest.raises(ValueError, match="is not an origin"):
            ServeOptions(cors_origins=bad)
    assert ServeOptions(cors_origins="*, http://a.example:8080, localhost").cors_origins


CHROMIUM = shutil.which("chromium-headless-shell") or shutil.which("chromium")

# The page calls the server as a web UI would, then posts what it saw to its
# own origin: a whole reply, a stream read as it comes, the 401 of a request
# without the key; from an origin not allowed, fetch itself fails.
SCRIPT = """
async function main() {
  const out = {};
  const ask = {model: "m", messages: [{role: "user", content: "Say hi."}], max_tokens: 4, temperature: 0};
  const json = {"Content-Type": "application/json"};
  try {
    let r = await fetch(SERVER + "/v1/chat/completions", {method: "POST", body: JSON.stringify(ask),
        headers: {...json, "Authorization": "Bearer sesame"}});
    out.status = r.status;
    out.content = (await r.json()).choices[0].message.content;
    r = await fetch(SERVER + "/v1/chat/completions", {method: "POST",
        body: JSON.stringify({...ask, stream: true}), headers: {...json, "Authorization": "Bearer sesame"}});
    const reader = r.body.getReader();
    let text = "";
    for (;;) { const {done, value} = await reader.read(); if (done) break; text += new TextDecoder().decode(value); }
    out.streamed = text.split("\\n\\n").filter(e => e.startsWith("data: {"))
        .map(e => JSON.parse(e.slice(6)).choices.map(c => c.delta.content || "").join("")).join("");
    r = await fetch(SERVER + "/v1/chat/completions", {method: "POST", body: JSON.stringify(ask), headers: json});
    out.unauthorized = [r.status, (await r.json()).error.code];
  } catch (e) {
    out.error = String(e);
  }
  await fetch("/result", {method: "POST", body: JSON.stringify(out)});
}
main();
"""


def browser_visit(page_url: str, server_url: str) -> dict:
    """What the page at page_url (served here) saw calling server_url from
    a headless Chromium."""
    results = []

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"<html><body><script>const SERVER = {json.dumps(server_url)};{SCRIPT}</script>" \
                   "</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body.encode())

        def do_POST(self):
            results.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    site = ThreadingHTTPServer(("127.0.0.1", int(page_url.rsplit(":", 1)[1])), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    profile = tempfile.mkdtemp(prefix="fastllm-chromium-")
    browser = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                                f"--user-data-dir={profile}", page_url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 120
        while not results and browser.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert results, "the page reported nothing"
        return results[0]
    finally:
        browser.terminate()
        browser.wait(30)
        site.shutdown()
        site.server_close()
        shutil.rmtree(profile, ignore_errors=True)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian: chromium-headless-shell)")
def test_a_page_in_chromium_calls_the_server(model):
    port = free_port()
    page = f"http://localhost:{port}"
    want = model.chat([{"role": "user", "content": "Say hi."}], 4, sampling=GREEDY)
    with running(model, api_key="sesame", cors_origins=page) as (url, _):
        server_url = url.removesuffix("/v1")
        seen = browser_visit(page, server_url)
        assert seen == {"status": 200, "content": want, "streamed": want,
                        "unauthorized": [401, "invalid_api_key"]}, seen
        # the same page from an origin the server does not name: the browser refuses
        seen = browser_visit(f"http://127.0.0.1:{port}", server_url)
        assert set(seen) == {"error"} and "Failed to fetch" in seen["error"], seen


# -------------------------------------------------- completions for harnesses

@pytest.mark.slow
def test_prompt_lists_each_get_their_choices_as_alone(server, model):
    url, _ = server
    c = client(url, api_key="sesame")
    texts = ["The capital of France is", "Once upon a time"]
    ids = model.tokenizer.encode("The sea is")
    r = c.completions.create(model="smollm2", prompt=texts, max_tokens=6, temperature=0, n=2)
    want = [model.generate(t, 6, sampling=GREEDY) for t in texts]
    assert [(ch.index, ch.text) for ch in r.choices] == [(0, want[0]), (1, want[0]), (2, want[1]),
                                                          (3, want[1])]
    assert r.usage.prompt_tokens == sum(len(model.tokenizer.encode(t)) for t in texts)
    r = c.completions.create(model="smollm2", prompt=[ids, ids[:2]], max_tokens=5, temperature=0)
    assert [ch.text for ch in r.choices] == [model.tokenizer.decode(list(model.generate_tokens(p, 5, GREEDY)))
                                             for p in (ids, ids[:2])]
    # streamed: every prompt's choices, interleaved, each ending once
    chunks = list(c.completions.create(model="smollm2", prompt=texts, max_tokens=6, temperature=0,
                                       stream=True))
    streamed = ["", ""]
    for ch in chunks:
        for choice in ch.choices:
            streamed[choice.index] += choice.text
    assert streamed == want
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices[0].finish_reason) == [0, 1]


def test_echo_scores_the_prompt_bit_for_bit_as_token_by_token(server, model):
    url, _ = server
    c = client(url, api_key="sesame")
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = model.tokenizer.encode(text)
    session = model.new_session()
    steps = [session.step(t) for t in ids[:-1]]   # one token at a time, no prompt pass
    want = [_logprobs(row, token, 3) for row, token in zip(steps, ids[1:])]
    r = c.completions.create(model="smollm2", prompt=[text, ids], echo=True, logprobs=3, max_tokens=0)
    for choice in r.choices:
        lp = choice.logprobs
        assert choice.text == text and choice.finish_reason == "length"
        assert lp.tokens == [model.tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == [w[0] for w in want]
        assert lp.top_logprobs[1:] == [{model.tokenizer.decode([i]): v for i, v in best} for _, best in want]
        assert lp.text_offset == [len(model.tokenizer.decode(ids[:i])) for i in range(len(ids))]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 2 * len(ids)
    # with tokens generated after the prompt: text and logprobs go on from the echo
    r = c.completions.create(model="smollm2", prompt=text, echo=True, logprobs=1, max_tokens=4, temperature=0)
    more = model.generate(text, 4, sampling=GREEDY)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text + more and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[1:len(ids)] == [w[0] for w in want]
    # streamed: the echo first, then the tokens
    chunks = list(c.completions.create(model="smollm2", prompt=text, echo=True, max_tokens=4, temperature=0,
                                       stream=True))
    assert chunks[0].choices[0].text == text and "".join(ch.choices[0].text for ch in chunks) == text + more


@pytest.mark.slow
def test_an_echoed_prompt_is_scored_whole_beside_other_requests(model):
    """A prompt to score is not taken from a slot that holds its prefix (no
    logits are left of it), and a long one runs in several chunks while
    other requests decode."""
    text = " ".join(["word"] * 150) + " end"   # more than one prefill chunk of 128
    ids = model.tokenizer.encode(text)
    whole = model.logits(ids)
    want = [_logprobs(row, t, 0)[0] for row, t in zip(whole, ids[1:])]
    with running(model, parallel=3) as (url, _):
        c = client(url)
        c.completions.create(model="smollm2", prompt=text, max_tokens=1)   # a slot now holds the prompt
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(lambda: c.completions.create(model="smollm2", prompt="The sea", max_tokens=40,
                                                            temperature=0, extra_body={"ignore_eos": True}))
            r = c.completions.create(model="smollm2", prompt=text, echo=True, logprobs=0, max_tokens=0)
            assert busy.result().usage.completion_tokens == 40
    assert r.choices[0].logprobs.token_logprobs[1:] == want
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_lists_of_prompts_for_scoring_are_bounded(server, model):
    url, engine = server
    auth = {"Authorization": "Bearer sesame", "Content-Type": "application/json"}
    for body, words in [({"prompt": [[1]] * 100_000, "echo": True, "max_tokens": 0}, "100000 prompts"),
                        ({"prompt": ["x"] * 100_000}, "at most 32 per request"),
                        ({"prompt": [[1, 2], [3, 10**6]], "echo": True}, "token id 1000000 is outside"),
                        ({"prompt": [[1, 2], [-1]]}, "token id -1 is outside"),
                        ({"prompt": [[7] * 600], "echo": True, "max_tokens": 0}, "the context holds 512"),
                        ({"prompt": ["x"] * 20, "n": 2}, "20 prompts of n=2 choices"),
                        ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be an integer >= 1")]:
        start = time.monotonic()
        status, _, raw = request(url, "/v1/completions", "POST", auth, body)
        assert words in openai_error(status, json.loads(raw), 400)["message"], body
        assert time.monotonic() - start < 30 and engine.active == 0 and engine.queue_depth == 0


def test_a_body_over_the_limit_reaches_the_client_as_413(model):
    """Clients send their whole body before they read the answer: the
    server reads (and drops) the rest, so they get the 413, not a
    connection reset by peer."""
    with running(model, max_body=100_000) as (url, engine):
        body = {"prompt": "ab " * 3_000_000, "max_tokens": 1}   # past what socket buffers hold
        for headers in ({"Content-Type": "application/json"}, {"Content-Type": "application/json",
                                                               "Transfer-Encoding": "chunked"}):
            data = json.dumps(body).encode()
            if "Transfer-Encoding" in headers:   # urllib sends an iterable as chunks
                data = iter([data[i:i + 65536] for i in range(0, len(data), 65536)])
            req = urllib.request.Request(url + "/completions", data=data, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            assert "larger than 100000 bytes" in openai_error(e.value.code, json.loads(e.value.read()), 413)["message"]
        status, _, _ = request(url, "/v1/models")
        assert status == 200 and engine.active == 0


def test_usage_names_the_cached_prompt_and_the_fingerprint(server, model):
    url, _ = server
    c = client(url, api_key="sesame")
    system = "You are a helpful assistant who answers in one short sentence. " * 4
    ask = lambda q: c.chat.completions.create(  # noqa: E731
        model="gpt-4o", messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        max_tokens=2, temperature=0)
    first, second = ask("Name a fish."), ask("Name a bird.")
    shared = 0
    a = model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a fish."}],
        add_generation_prompt=True), add_special_tokens=False)
    b = model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a bird."}],
        add_generation_prompt=True), add_special_tokens=False)
    while a[shared] == b[shared]:
        shared += 1
    assert second.usage.prompt_tokens_details.cached_tokens == shared > 20
    assert first.usage.prompt_tokens_details.cached_tokens < shared
    from fastllm.spec.version import __version__
    from fastllm.core._core import simd_path
    assert second.system_fingerprint.startswith(f"fastllm-{__version__}-{simd_path()}-")
    assert second.model == "smollm2"   # the model that answered, whatever the request named
    chunks = list(c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert {ch.system_fingerprint for ch in chunks} == {second.system_fingerprint}


def test_the_token_logprobs_of_a_batch_equal_each_rows_own():
    from fastllm.serve.serving import _logprob_rows
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 1000)) * 4).astype(np.float32)
    logits[2, [5, 9, 700]] = logits[2].max() + 1   # ties in the top: the lower id first
    tokens = [3, 5, 9, 999, 0, 700]
    for top in (0, 1, 2, 5):
        assert _logprob_rows(logits, tokens, top) == [_logprobs(row, t, top) for row, t in zip(logits, tokens)]
