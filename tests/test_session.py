"""Sessions: several sequences on one loaded model, prefix reuse, rewinding,
and threads sharing a Model."""
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from fastllm import Model, SamplingParams, Session
from fastllm.core import _core


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=96)


@pytest.fixture(scope="module")
def qwen35(tiny_model_dir):
    return Model.from_pretrained(tiny_model_dir("qwen3_5-text"), threads=1, n_ctx=96)


PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 10, 11, 12], [40, 41], [5, 6, 7, 8, 9, 13, 14]]


def test_sessions_share_weights_but_not_state(llama):
    a, b = llama.new_session(), Session(llama)
    want_a, want_b = llama.logits(PROMPTS[0]), llama.logits(PROMPTS[2])
    # interleaved: each session's cache holds its own sequence
    got_a = [a.step(t) for t in PROMPTS[0][:2]]
    got_b = [b.step(t) for t in PROMPTS[2]]
    got_a += [a.step(t) for t in PROMPTS[0][2:]]
    assert np.array_equal(np.stack(got_a), want_a) and np.array_equal(np.stack(got_b), want_b)
    assert a.tokens == tuple(PROMPTS[0]) and b.position == 2 and a.can_rewind


@pytest.mark.parametrize("which", ["llama", "qwen35"])
def test_prefill_reuses_a_prefix_and_matches_a_fresh_session(which, request):
    model = request.getfixturevalue(which)
    session = model.new_session()
    for ids in PROMPTS + PROMPTS[::-1]:
        got = session.prefill(ids)
        assert np.array_equal(got, model.new_session().prefill(ids)), ids
        assert session.tokens == tuple(ids)


def test_rewind(llama, qwen35):
    s = llama.new_session()
    s.prefill(PROMPTS[3])
    s.rewind(3)
    assert s.tokens == tuple(PROMPTS[3][:3])
    assert np.array_equal(s.extend(PROMPTS[3][3:], all_logits=True), llama.logits(PROMPTS[3])[3:])
    with pytest.raises(ValueError, match="holds 7 tokens"):
        s.rewind(8)
    r = qwen35.new_session()
    r.prefill(PROMPTS[0])
    assert not r.can_rewind
    with pytest.raises(ValueError, match="cannot forget"):
        r.rewind(2)
    r.rewind(5)   # to where it is: nothing to forget
    r.reset()
    assert r.position == 0


def test_a_closed_generation_leaves_only_what_ran(llama):
    session = llama.new_session()
    tokens = llama.generate_tokens(PROMPTS[0], 10, stop_token_ids=(), session=session)
    first = [next(tokens), next(tokens)]
    tokens.close()
    # the second token was handed out but never run
    assert session.tokens == tuple(PROMPTS[0] + first[:1])
    again = list(llama.generate_tokens(PROMPTS[0] + first, 6, stop_token_ids=(), session=session))
    fresh = list(llama.generate_tokens(PROMPTS[0] + first, 6, stop_token_ids=(), session=llama.new_session()))
    assert again == fresh


def test_one_thread_cannot_interleave_two_default_generations(llama):
    first = llama.generate_tokens(PROMPTS[0], 4, stop_token_ids=())
    next(first)
    with pytest.raises(RuntimeError, match="already generating"):
        list(llama.generate_tokens(PROMPTS[1], 4, stop_token_ids=()))
    first.close()
    assert len(list(llama.generate_tokens(PROMPTS[1], 4, stop_token_ids=()))) == 4


def _work(model, prompt, session=None):
    params = SamplingParams(temperature=0.9, top_k=20, seed=sum(prompt))
    tokens = list(model.generate_tokens(prompt, 12, params, stop_token_ids=(), session=session))
    return tokens, model.logits(prompt + tokens, session=session)


@pytest.mark.parametrize("own_sessions", [False, True])
def test_four_threads_on_one_model_match_sequential_results(llama, own_sessions):
    """Threads sharing the default session are served one at a time; threads
    with sessions of their own run at once. Either way nothing mixes."""
    want = [_work(llama, p) for p in PROMPTS]
    got, errors = {}, []

    def hammer(i):
        try:
            session = llama.new_session() if own_sessions else None
            for round in range(10):
                got[i, round] = _work(llama, PROMPTS[(i + round) % 4], session)
        except Exception as e:  # reported below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads often, so that calls do interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for (i, round), (tokens, logits) in got.items():
        want_tokens, want_logits = want[(i + round) % 4]
        assert tokens == want_tokens and np.array_equal(logits, want_logits), (i, round)


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_every_calling_thread_runs_on_the_one_compute_thread(tiny_model_dir):
    """libgomp gives each thread that starts parallel work a worker pool of
    its own and stops spinning at barriers once the pools outnumber the
    cores, so calls from other threads must not start pools of their own."""
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=2, n_ctx=96)
    want = model.new_session().prefill(PROMPTS[0])
    before = _tasks()
    stepped, release = threading.Barrier(5), threading.Event()
    got = {}

    def call(i):
        got[i] = model.new_session().prefill(PROMPTS[0])
        stepped.wait()
        release.wait()
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    stepped.wait()
    try:
        assert _tasks() - before == 4    # the callers themselves, no new workers
        assert _core.compute_thread_ident() not in {t.ident for t in threads} | {threading.get_ident()}
    finally:
        release.set()
        for t in threads:
            t.join()
    assert all(np.array_equal(g, want) for g in got.values())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_runs_the_model(llama):
    """The parent's compute thread does not exist in a forked child: the
    child starts its own instead of waiting on it forever."""
    want = llama.new_session().prefill(PROMPTS[1])
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # fork with threads running
        pid = os.fork()
    if pid == 0:
        try:
            os.write(write, llama.new_session().prefill(PROMPTS[1]).tobytes())
        finally:
            os._exit(0)
    os.close(write)
    try:
        data = b""
        deadline = time.monotonic() + 60
        while len(data) < want.nbytes and time.monotonic() < deadline:
            if select.select([read], [], [], 1)[0]:
                chunk = os.read(read, want.nbytes)
                if not chunk:
                    break
                data += chunk
        assert np.array_equal(np.frombuffer(data, np.float32), want), "the child gave no logits in 60 s"
    finally:
        os.close(read)
        if os.waitpid(pid, os.WNOHANG) == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_gevent_patched_process_runs_the_model(llama, tiny_model_dir):
    """gevent's monkey-patching turns threading.Thread into a greenlet,
    which would never run the compute thread's C loop: it is an OS thread."""
    pytest.importorskip("gevent")
    want = list(llama.generate_tokens(PROMPTS[0], 4, stop_token_ids=()))
    code = ("from gevent import monkey; monkey.patch_all()\n"
            "import sys\n"
            "from fastllm import Model\n"
            "m = Model.from_pretrained(sys.argv[1], threads=2, n_ctx=96)\n"
            f"print(list(m.generate_tokens({PROMPTS[0]}, 4, stop_token_ids=())))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_dir("llama-gqa"))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(want)


def test_an_explicit_session_refuses_a_second_thread_or_generation(llama):
    session = llama.new_session()
    first = llama.generate_tokens(PROMPTS[0], 6, stop_token_ids=(), session=session)
    head = [next(first)]
    errors = []

    def other_thread():
        for use in (lambda: list(llama.generate_tokens(PROMPTS[1], 3, stop_token_ids=(), session=session)),
                    lambda: session.prefill(PROMPTS[1]), lambda: session.reset()):
            try:
                use()
                errors.append(None)
            except RuntimeError as e:
                errors.append(str(e))
    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert all(e and "another thread" in e for e in errors), errors
    with pytest.raises(RuntimeError, match="already used by a generation"):
        list(llama.generate_tokens(PROMPTS[1], 3, stop_token_ids=(), session=session))
    # the first generation was not disturbed, and the session is free afterwards
    assert head + list(first) == list(llama.generate_tokens(PROMPTS[0], 6, stop_token_ids=()))
    assert len(list(llama.generate_tokens(PROMPTS[1], 3, stop_token_ids=(), session=session))) == 3


def test_a_call_cut_off_while_it_holds_a_session_leaves_it_to_its_thread(llama):
    # A Ctrl-C can end a call anywhere between taking the session and giving
    # it back; the hold it leaves is its own thread's to take over, and still
    # refuses other threads until then.
    session = llama.new_session()
    want = list(llama.generate_tokens(PROMPTS[0], 4, stop_token_ids=()))
    cut = session._use()
    cut.__enter__()          # taken, and never given back by that call
    seen = []
    t = threading.Thread(target=lambda: seen.append(_refused(lambda: session.prefill(PROMPTS[1]))))
    t.start()
    t.join()
    assert seen == [True]
    assert list(llama.generate_tokens(PROMPTS[0], 4, stop_token_ids=(), session=session)) == want
    del cut                  # the abandoned call, closed late, frees nothing it no longer holds
    t = threading.Thread(target=lambda: seen.append(_refused(lambda: session.prefill(PROMPTS[1]))))
    t.start()
    t.join()
    assert seen == [True, False]


def _refused(use) -> bool:
    try:
        use()
    except RuntimeError as e:
        assert "another thread" in str(e)
        return True
    return False


def test_the_c_boundary_checks_token_ids_itself(llama):
    """State.run and run_batch refuse ids outside the vocabulary even when a
    caller skipped check_token_ids (it would read outside the embeddings)."""
    state = _core.State(llama._weights, 8)
    vocab = llama.config.vocab_size
    for bad in (-100000, -1, vocab):
        ids = np.array([1, bad, 2], dtype=np.int32)
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            state.run(ids, 0)
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            _core.run_batch([state], [ids], [0])
    assert state.run(np.array([1, 2], dtype=np.int32), 0).shape == (vocab,)
