"""A bounded run of the HTTP fuzz target (tests/fuzz/fuzz_http.py) without
atheris: a few hundred generated requests, from fixed seeds, through the
server's ASGI app in-process, then the committed inputs that once found a
bug. Any Finding (a 5xx, an exception out of the app, an error not in
OpenAI's shape, a malformed completion or stream, a refused request still
running, a hang) fails the test."""
import importlib.util
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("starlette")

FUZZ = Path(__file__).resolve().parent / "fuzz"


@pytest.fixture(scope="module")
def target():
    saved = sys.modules.get("atheris", False)
    sys.modules["atheris"] = None   # plain imports, no instrumentation
    sys.path.insert(0, str(FUZZ))
    try:
        spec = importlib.util.spec_from_file_location("fuzz_http", FUZZ / "fuzz_http.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(FUZZ))
        if saved is False:
            del sys.modules["atheris"]
        else:
            sys.modules["atheris"] = saved
    yield module
    if module._harness is not None:
        module._harness.close()


@pytest.mark.parametrize("seed", range(4))
def test_generated_requests(target, seed):
    rng = random.Random(seed)
    for _ in range(100):
        target.TestOneInput(rng.randbytes(rng.choice([16, 64, 256, 1024])))
    target.harness().check_engines()


def test_corpus_replays_cleanly(target):
    inputs = sorted((FUZZ / "corpus" / "http").iterdir())
    assert inputs
    for path in inputs:
        target.TestOneInput(path.read_bytes())
    target.harness().check_engines()


def test_a_refused_request_that_still_runs_is_a_finding(target):
    # The checks themselves: a 4xx whose generation was left running is caught.
    h = target.harness()
    served = h.served[0]
    request = served.engine.submit([5, 6, 7], 50)
    served.submitted.append(request)
    sent = {"status": 400, "headers": [(b"content-type", b"application/json")], "done": True,
            "body": [b'{"error": {"message": "no", "type": "invalid_request_error", "param": null, "code": null}}']}
    with pytest.raises(target.Finding, match="still queued or running"):
        h.check(0, "POST", "/v1/completions", b"{}", None, None, sent, 0.01)
    request.cancel()


def test_errors_out_of_shape_are_findings(target):
    h = target.harness()
    for body, ctype in [(b"Not Found", b"text/plain"), (b'{"error": "x"}', b"application/json"),
                        (b'{"error": {"message": "m", "type": "t"}}', b"application/json")]:
        sent = {"status": 404, "headers": [(b"content-type", ctype)], "done": True, "body": [body]}
        with pytest.raises(target.Finding, match="OpenAI's shape"):
            h.check(0, "GET", "/nothing", b"", None, None, sent, 0.01)
    sent = {"status": 500, "headers": [(b"content-type", b"application/json")], "done": True,
            "body": [b'{"error": {"message": "m", "type": "server_error", "param": null, "code": null}}']}
    with pytest.raises(target.Finding, match="500"):
        h.check(0, "POST", "/v1/completions", b"{}", None, None, sent, 0.01)
