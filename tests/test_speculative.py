"""Speculative decoding gives exactly the tokens of plain decoding.

For every family with a batched pass, greedy and seeded sampling, 1 and 2
threads, int8 and f32 activations: drafts that are always right, always
wrong and right at random give the tokens of plain decoding, through
Model.generate_tokens and through the batch engine beside other requests.
Recurrent states (Qwen3.5's Gated DeltaNet) are rolled back exactly, and
LongRoPE's switch of tables inside a verified pass is undone with it.
"""
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.generate.sampling import SamplingParams
from fastllm.serve.serving import BatchEngine
from fastllm.generate.speculative import (DraftModel, DraftPolicy, NgramDrafter, Speculation,
                                          check_same_vocabulary, speculation)
from fastllm import generate_tokens_batch

DATA = Path(__file__).resolve().parent / "data"

# One committed file per family with a batched path: Llama (K-quants),
# Qwen3.5 (Gated DeltaNet beside gated attention), Qwen3.5-MoE, Qwen3-MoE,
# Mixtral, Gemma 3 (sliding windows, soft-caps), Phi-3 (LongRoPE across
# its original 32 positions), Gemma 2, SmolLM3 (NoPE layers), OLMo 2.
FILES = {
    "llama": DATA / "llama-family" / "llama2-256-Q4_K_M.gguf",
    "qwen35": DATA / "qwen35-gguf" / "wide-Q4_K_M.gguf",
    "qwen35moe": DATA / "moe-gguf" / "qwen35moe-Q8_0.gguf",
    "qwen3moe": DATA / "moe-gguf" / "qwen3moe-F32.gguf",
    "mixtral": DATA / "moe-gguf" / "mixtral-F32.gguf",
    "gemma3": DATA / "gemma-gguf" / "gemma3.gguf",
    "gemma2": DATA / "gemma-gguf" / "gemma2.gguf",
    "phi3-longrope": DATA / "phi3-gguf" / "longrope-F32.gguf",
    "smollm3": DATA / "coverage-gguf" / "smollm3.gguf",
    "olmo2": DATA / "coverage-gguf" / "olmo2.gguf",
}
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
N = 40

_models = {}


def model(name, activations="int8"):
    key = (name, activations)
    if key not in _models:
        _models[key] = Model.from_pretrained(FILES[name], n_ctx=256, threads=2, activations=activations)
    return _models[key]


def prompt_of(m, n=24, seed=0):
    vocab = m.config.vocab_size
    return np.random.default_rng(seed).integers(3, min(vocab, 250), n).tolist()


class Scripted:
    """Guesses from the known plain output: right, wrong, or right with
    probability 0.6 (the rest a different token)."""

    def __init__(self, plain, prompt_len, kind, vocab):
        self.plain, self.prompt_len, self.kind, self.vocab = plain, prompt_len, kind, vocab
        self.rng = np.random.default_rng(3)

    def propose(self, tokens, k):
        n = len(tokens) - self.prompt_len
        right = self.plain[n:n + k]
        if self.kind == "right":
            return right
        if self.kind == "wrong":
            return [(t + 1) % self.vocab for t in right]
        return [t if self.rng.random() < 0.6 else (t + 5) % self.vocab for t in right]


def forced(drafter, k=6):
    """A Speculation that always drafts k guesses (the policy would back
    off from wrong ones; here every path must be taken)."""
    spec = Speculation(drafter, k)
    spec.policy.length = lambda: k
    return spec


def plain_tokens(m, prompt, sampling, n=N):
    return list(m.generate_tokens(prompt, n, sampling, stop_token_ids=[], speculative=False))


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculation_gives_the_plain_tokens(name, sampling):
    m = model(name)
    prompt = prompt_of(m)
    plain = plain_tokens(m, prompt, sampling)
    for kind in ("right", "wrong", "random"):
        spec = forced(Scripted(plain, len(prompt), kind, m.config.vocab_size))
        out = list(m.generate_tokens(prompt, N, sampling, stop_token_ids=[], speculative=spec))
        assert out == plain, (name, kind)
        stats = m.last_stats
        if kind == "right":
            assert stats.accepted_tokens == stats.drafted_tokens > N // 2
        if kind == "wrong":
            assert stats.accepted_tokens == 0 and stats.drafted_tokens > 0


@pytest.mark.parametrize("name", ["qwen35", "llama", "qwen35moe"])
@pytest.mark.parametrize("activations", ["int8", "f32"])
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_activations(name, activations, threads):
    m = model(name, activations)
    m.threads = threads
    try:
        prompt = prompt_of(m, seed=1)
        plain = plain_tokens(m, prompt, SEEDED)
        spec = forced(Scripted(plain, len(prompt), "random", m.config.vocab_size), k=4)
        assert list(m.generate_tokens(prompt, N, SEEDED, stop_token_ids=[], speculative=spec)) == plain
    finally:
        m.threads = 2


def test_a_rolled_back_recurrent_state_is_the_state_of_the_kept_tokens():
    """Qwen3.5: verify 7 tokens, keep j of them, go on: the logits are, bit
    for bit, those of a session that ran only the j tokens; and a session
    that cannot rewind refuses anything but keep() after a verify."""
    m = model("qwen35")
    ids = prompt_of(m, 40, seed=2)
    ref = m.new_session().logits(ids)
    for j in range(8):
        s = m.new_session()
        s.prefill(ids[:20])
        rows = s.verify(ids[20:27])
        assert np.array_equal(rows, ref[20:27])
        s.keep(j)
        assert s.position == 20 + j
        assert np.array_equal(s.extend(ids[20 + j:], all_logits=True), ref[20 + j:])
    s = m.new_session()
    s.prefill(ids[:20])
    s.verify(ids[20:25])
    s.keep(3)
    s.keep(1)   # a further cut of the same pass
    assert np.array_equal(s.extend(ids[21:30], all_logits=True), ref[21:30])
    with pytest.raises(ValueError, match="follows a verify"):
        s.keep(0)
    with pytest.raises(ValueError, match="cannot forget"):
        s.rewind(25)


def test_keep_refuses_what_the_pass_did_not_run():
    m = model("llama")
    s = m.new_session()
    s.prefill([5, 6, 7])
    s.verify([8, 9])
    with pytest.raises(ValueError, match="cannot keep 3"):
        s.keep(3)
    with pytest.raises(ValueError, match="does not fit one pass"):
        m.new_session(max_batch=4).verify([1, 2, 3, 4, 5])


@pytest.mark.parametrize("name", ["qwen35", "llama", "gemma3", "qwen3moe"])
def test_the_batch_engine_verifies_beside_other_requests(name):
    """Four requests, some speculating (right, wrong, random guesses), one
    not, decoded together: each gets the tokens it gets alone."""
    m = model(name)
    samplings = [GREEDY, SEEDED, SamplingParams(temperature=0.8, top_k=20, seed=3), GREEDY]
    prompts = [prompt_of(m, 10 + 7 * i, seed=10 + i) for i in range(4)]
    plains = [plain_tokens(m, p, s) for p, s in zip(prompts, samplings)]
    kinds = ["right", "wrong", "random", None]

    class Engine(BatchEngine):
        def _speculation(self, slot, request):
            i = prompts.index(request.prompt_ids)
            if kinds[i] is None:
                return None
            return forced(Scripted(plains[i], len(prompts[i]), kinds[i], m.config.vocab_size), k=5)

    engine = Engine(m, parallel=4, prefill_chunk=16, speculative="ngram")
    try:
        requests = [engine.submit(p, N, s, stop_ids=[]) for p, s in zip(prompts, samplings)]
        outs = [list(r) for r in requests]
    finally:
        engine.close()
    assert outs == plains
    assert requests[0].accepted == requests[0].drafted > 0
    assert requests[1].accepted == 0 < requests[1].drafted
    assert requests[3].drafted == 0
    assert engine.drafted == sum(r.drafted for r in requests)


def test_ngram_speculation_in_the_engine_and_the_model_on_the_default_model(monkeypatch):
    """The default model copying a text: n-gram guesses are mostly kept, and
    the text is the plain one, in Model.chat and in the engine.

    How many tokens the policy drafts follows the measured pass times, which
    on a slow or busy machine can favour short drafts; a fixed cost (a pass
    of n tokens costs a step and a quarter step per extra token) makes the
    drafts a function of the text alone."""
    monkeypatch.setattr(DraftPolicy, "cost", lambda self, n: 1.0 + 0.25 * (n - 1))
    m = Model.from_pretrained(n_ctx=2048, threads=2)
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()[:1200]
    messages = [{"role": "user", "content": "Repeat this text exactly:\n\n" + text}]
    plain = m.chat(messages, max_new_tokens=120, speculative=False)
    fast = m.chat(messages, max_new_tokens=120, speculative="ngram")
    assert fast == plain
    assert m.last_stats.accepted_tokens > 60
    ids = m.tokenizer.encode(m.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                             add_special_tokens=False)
    tokens = list(m.generate_tokens(ids, 120, speculative=False))
    assert generate_tokens_batch(m, [ids, ids[:-40]], 120, speculative="ngram")[0] == tokens


def test_structured_output_and_stop_strings_hold_under_speculation():
    pytest.importorskip("llguidance")
    m = Model.from_pretrained(n_ctx=2048, threads=2)
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}}}
    messages = [{"role": "user", "content": 'Give {"name": "Ada", "age": 36} back as JSON, as it is.'}]
    plain = m.chat(messages, max_new_tokens=60, response_format=schema, speculative=False)
    assert m.chat(messages, max_new_tokens=60, response_format=schema, speculative="ngram") == plain
    story = [{"role": "user", "content": "Say 'one two three four five six' three times."}]
    plain = m.chat(story, max_new_tokens=80, stop=["five"], speculative=False)
    assert m.chat(story, max_new_tokens=80, stop=["five"], speculative="ngram") == plain


def test_ngram_drafter_prefers_the_longest_then_the_latest_match():
    d = NgramDrafter(n_min=2, n_max=6)
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [1, 2, 3, 4, 9, 9, 5, 2, 3, 7, 1, 2, 3]
    # suffix (1, 2, 3): the match at 0..2 is longer (3) than the later one at 7..8 (2)
    assert d.propose(tokens, 3) == [4, 9, 9]
    # a later match of the same length wins
    assert d.propose([5, 6, 1, 5, 6, 2, 8, 5, 6], 2) == [2, 8]
    # none: nothing; the continuation stops at the end of the text
    assert d.propose([1, 2, 3, 4], 3) == []
    assert d.propose([1, 2, 1, 2], 5) == [1, 2]
    # the index follows a sequence that was cut and changed
    assert d.propose([1, 2, 3, 4, 9, 9, 5, 8, 8, 1, 2], 2) == [3, 4]
    assert d.propose([7, 7, 3, 1, 2], 2) == []
    assert d.propose([7, 7, 3, 1, 2, 7, 7], 2) == [3, 1]


def test_the_policy_backs_off_when_guesses_fail_and_comes_back():
    policy = DraftPolicy(max_draft=8)
    for _ in range(5):   # a pass of n tokens costs 1 + 0.05 (n - 1)
        for n in (1, 5, 9):
            policy.timed(n, 1 + 0.05 * (n - 1))
    for _ in range(20):
        policy.outcome(8, 8)
    assert policy.length() == 8
    for _ in range(40):
        policy.outcome(4, 0)
    lengths = [policy.length() for _ in range(64)]
    assert lengths.count(0) > 50 and 1 in lengths   # plain steps, and a probe now and then
    for _ in range(10):
        policy.outcome(1, 1)
    assert policy.length() > 1


def test_a_draft_model_of_another_vocabulary_is_refused():
    target = Model.from_pretrained(threads=2)
    other = model("qwen35")
    with pytest.raises(ValueError, match="vocabulary differs from the target's: token '.+' is id 0 in"):
        check_same_vocabulary(other, target)
    with pytest.raises(ValueError, match="vocabulary differs"):
        speculation(other, target)
    with pytest.raises(ValueError, match="vocabulary differs"):
        BatchEngine(target, speculative=other)
    check_same_vocabulary(target, target)


@pytest.mark.slow   # the default model dequantized to f32 (once per FASTLLM_HOME), and run
def test_a_draft_model_gives_the_target_model_tokens():
    """The default model (Q4_1) drafting for itself dequantized to f32:
    most guesses are kept, and the text is the f32 model's own."""
    target = Model.from_pretrained(dtype="f32", n_ctx=1024, threads=2)
    draft = Model.from_pretrained(n_ctx=1024, threads=2)
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    plain = target.chat(messages, max_new_tokens=60, speculative=False)
    spec = Speculation(DraftModel(draft, target), 6)
    assert target.chat(messages, max_new_tokens=60, speculative=spec) == plain
    assert spec.stats.accepted > spec.stats.drafted // 2
    # the same draft session again: it reuses what it ran
    assert target.chat(messages, max_new_tokens=60, speculative=spec) == plain


def test_a_recurrent_draft_model_keeps_its_state_between_proposals():
    m = model("qwen35")
    prompt = prompt_of(m, seed=4)
    plain = plain_tokens(m, prompt, GREEDY)
    spec = forced(DraftModel(model("qwen35", "f32"), m), k=3)
    assert list(m.generate_tokens(prompt, N, GREEDY, stop_token_ids=[], speculative=spec)) == plain
    assert spec.stats.accepted > 0


def test_the_cli_speculates_with_the_same_text(capsys):
    from fastllm.cli import main as cli
    argv = ["run", "--raw", "-n", "48", "--threads", "2",
            "The alphabet: a b c d e f g h i j k l m n o p. The alphabet again: a b c"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert cli.main(argv[:1] + ["--spec", "ngram", "--draft-max", "8", "-v"] + argv[1:]) == 0
    out = capsys.readouterr()
    assert out.out == plain
    assert "guesses:" in out.err and " kept" in out.err
    with pytest.raises(SystemExit):
        cli.main(argv[:1] + ["--draft-max", "65"] + argv[1:])
    assert "--draft-max: must be at most 64" in capsys.readouterr().err
    assert cli.main(argv[:1] + ["--draft", str(FILES["qwen35"])] + argv[1:]) == 1
    assert "vocabulary differs from the target's" in capsys.readouterr().err


def test_the_server_speculates_per_request_and_counts_guesses():
    import json
    import socket
    import threading
    import time
    import urllib.request

    uvicorn = pytest.importorskip("uvicorn")
    from fastllm.serve.server import ServeOptions, create_app

    m = Model.from_pretrained(n_ctx=1024, threads=2)
    engine = BatchEngine(m, parallel=2, speculative="ngram", draft_max=8)
    app = create_app(m, engine, "smollm2", None, ServeOptions())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def post(body):
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        prompt = "One, two, three, four, five. One, two, three, four, five. One, two,"
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
        status, plain = post(dict(body, **{"speculative.n_max": 0}))
        assert status == 200 and engine.drafted == 0
        status, fast = post(body)
        assert status == 200 and engine.accepted > 0
        assert fast["choices"][0]["text"] == plain["choices"][0]["text"]
        expected = m.generate(prompt, 40, speculative=False)
        assert plain["choices"][0]["text"] == expected
        status, error = post(dict(body, **{"speculative.n_max": 65}))
        assert status == 400 and "speculative.n_max" in error["error"]["message"]
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert f"fastllm_draft_tokens_total {engine.drafted}" in metrics
        assert f"fastllm_draft_accepted_tokens_total {engine.accepted}" in metrics
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()
        sock.close()


@pytest.mark.parametrize("name", ["qwen35", "llama"])
def test_the_engine_drafts_with_a_draft_model_for_every_request_together(name):
    """The same file with f32 activations drafting for its int8 self: three
    requests guess together, one pass of the draft model a step, and each
    gets its tokens alone (a recurrent draft model resumes from its saved
    state between proposals)."""
    m, draft = model(name), model(name, "f32")
    prompts = [prompt_of(m, 12 + 5 * i, seed=50 + i) for i in range(3)]
    samplings = [GREEDY, SEEDED, GREEDY]
    plains = [plain_tokens(m, p, s) for p, s in zip(prompts, samplings)]
    engine = BatchEngine(m, parallel=3, prefill_chunk=16, speculative=draft, draft_max=4)
    try:
        outs = [list(r) for r in [engine.submit(p, N, s, stop_ids=[]) for p, s in zip(prompts, samplings)]]
    finally:
        engine.close()
    assert outs == plains
    assert engine.accepted > 0


def test_the_engine_masks_every_verified_position_of_a_constrained_request():
    """JSON Schema output in the engine with n-gram guesses (the prompt holds
    the JSON to repeat): the text is the constrained text without them."""
    pytest.importorskip("llguidance")
    from fastllm.generate.constrain import reply_grammar
    m = Model.from_pretrained(n_ctx=2048, threads=2)
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                                             "items": {"type": "string"}}},
        "required": ["name", "tags"]}}}
    grammar = reply_grammar(m, response_format=schema)
    messages = [{"role": "user", "content": 'Repeat {"name": "Ada Lovelace", "tags": ["math", "engines", '
                                            '"poetry"]} as JSON.'}]
    ids = m.tokenizer.encode(m.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                             add_special_tokens=False)
    plain = list(m.generate_tokens(ids, 60, constraint=grammar.start(), speculative=False))
    engine = BatchEngine(m, parallel=2, speculative="ngram")
    try:
        request = engine.submit(ids, 60, constraint=grammar.start())
        assert list(request) == plain
        assert request.drafted > 0
    finally:
        engine.close()
