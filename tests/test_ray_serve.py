"""Replicas behind Ray Serve (fastllm.serve.ray_serve), as README's recipe runs
them: two replicas of the default model on a local Ray instance, reached
through Ray's proxy on 127.0.0.1 with OpenAI's client."""
import json
import os
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
from ray import serve  # noqa: E402

from fastllm import Model, SamplingParams  # noqa: E402
from fastllm.load.hub import default_gguf_path  # noqa: E402
from fastllm.serve.ray_serve import build  # noqa: E402

PROMPTS = ["Name a color.", "What is 2 + 2?", "Say hello in French.", "Name a planet.",
           "What is the capital of Italy?", "Count to three."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gguf(fastllm_home):
    return str(default_gguf_path())


@pytest.fixture(scope="module")
def endpoint(gguf):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    # The replicas inherit this process's environment, FASTLLM_HOME included.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 2**20)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # What `serve run fastllm.serve.ray_serve:build model=... replicas=2 ...` runs.
        serve.run(build({"model": gguf, "replicas": "2", "threads": "1", "parallel": "2", "ctx": "512",
                         "model_name": "smollm2", "seed": "11"}),
                  name="fastllm", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_replies_through_ray_equal_the_model_alone(endpoint, gguf):
    model = Model.from_pretrained(gguf, n_ctx=512, threads=1)
    want = [model.chat([{"role": "user", "content": p}], max_new_tokens=MAX_TOKENS,
                       sampling=SamplingParams(temperature=0)) for p in PROMPTS]
    client = openai.OpenAI(base_url=endpoint + "/v1", api_key="none", max_retries=0, timeout=120)

    def ask(i):
        messages = [{"role": "user", "content": PROMPTS[i]}]
        if i % 2:
            parts = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0)
        return reply.choices[0].message.content
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    assert got == want
    assert [m.id for m in client.models.list().data] == ["smollm2"]


@pytest.mark.slow
def test_two_replica_processes_answer(endpoint):
    pids = {_get(endpoint + "/health")["pid"] for _ in range(24)}
    assert len(pids) == 2 and os.getpid() not in pids


@pytest.mark.slow
def test_every_replica_samples_an_unseeded_request_with_the_servers_seed(endpoint, gguf):
    model = Model.from_pretrained(gguf, n_ctx=512, threads=1)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    want = model.chat(messages, max_new_tokens=MAX_TOKENS, sampling=SamplingParams(temperature=1.0, seed=11))
    client = openai.OpenAI(base_url=endpoint + "/v1", api_key="none", max_retries=0, timeout=120)

    def ask(_):
        return client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=1.0).choices[0].message.content
    with ThreadPoolExecutor(4) as pool:   # both replicas answer some of them
        assert list(pool.map(ask, range(8))) == [want] * 8


@pytest.mark.slow
def test_errors_keep_openai_shape_through_the_proxy(endpoint):
    request = urllib.request.Request(endpoint + "/v1/completions", data=b'{"prompt": "hi", "max_tokens": -1}',
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 400
    assert json.loads(e.value.read())["error"]["param"] == "max_tokens"


def test_build_refuses_unknown_or_malformed_settings():
    with pytest.raises(ValueError, match="unknown setting.*replica"):
        build({"replica": "2"})
    with pytest.raises(ValueError, match="replicas='two' is not an int"):
        build({"replicas": "two"})
    with pytest.raises(ValueError, match="must be positive"):
        build({"parallel": "0"})
    with pytest.raises(ValueError, match="seed='x' is not an int"):
        build({"seed": "x"})
    with pytest.raises(ValueError, match="seed must be from 0"):
        build({"seed": "-1"})
