"""Bad calls, bad config values and interrupts: each gets a clear error or
leaves the model consistent, never a crash, a hang or a silent wrong answer."""
import json
import shutil
import signal
import threading
import time
import warnings

import numpy as np
import pytest

from fastllm import Model, SamplingParams
from fastllm import _core
from fastllm.config import ModelConfig
from fastllm.errors import ModelFileError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
N_NEW = 8
KINDS = {"llama": "llama-gqa", "qwen35": "qwen3_5-text"}


@pytest.fixture(scope="module", params=list(KINDS))
def small_batch_model(request, tiny_model_dir):
    """A model whose sessions run at most 4 tokens per C call, so a prompt
    is several calls and an interrupt can land between any two."""
    return Model.from_pretrained(tiny_model_dir(KINDS[request.param]), threads=1, n_ctx=256, max_batch=4)


def fresh(model, prompt, n):
    return list(model.generate_tokens(prompt, n, session=model.new_session()))


def continue_after(model, session, prompt, got, n):
    """What generation on session yields after an interrupt, having
    already yielded got: the rest, from prompt + got."""
    return list(model.generate_tokens(prompt + got, n - len(got), session=session))


# ------------------------------------------------------------- interrupts

class InterruptAfterRun:
    """Stands in for a session's C state: runs the chunk, then raises
    KeyboardInterrupt on the k-th call, as a Ctrl-C that lands after C
    returned and before the session listed the tokens."""

    def __init__(self, state, k):
        self.state, self.k, self.calls = state, k, 0

    def run(self, *args):
        out = self.state.run(*args)
        self.calls += 1
        if self.calls == self.k:
            raise KeyboardInterrupt
        return out


def test_an_interrupt_after_any_c_call_leaves_the_session_consistent(small_batch_model):
    model = small_batch_model
    want = fresh(model, PROMPT, N_NEW)
    calls = -(-len(PROMPT) // 4) + N_NEW - 1
    session = model.new_session()
    real = session._state
    for k in range(1, calls + 1):
        session.reset()
        session._state = InterruptAfterRun(real, k)
        got = []
        with pytest.raises(KeyboardInterrupt):
            for token in model.generate_tokens(PROMPT, N_NEW, session=session):
                got.append(token)
        session._state = real
        held = session.tokens
        assert list(held) == (PROMPT + got)[:len(held)], k
        rest = continue_after(model, session, PROMPT, got, N_NEW)
        assert got + rest == want, k
        assert rest == fresh(model, PROMPT + got, N_NEW - len(got)), k


def test_an_interrupt_in_a_logits_processor_at_any_step(small_batch_model):
    model = small_batch_model
    want = fresh(model, PROMPT, N_NEW)
    session = model.new_session()
    for k in range(N_NEW):
        def stop_at_k(tokens, logits, k=k):
            if len(tokens) == len(PROMPT) + k:
                raise KeyboardInterrupt
            return logits
        got = []
        with pytest.raises(KeyboardInterrupt):
            for token in model.generate_tokens(PROMPT, N_NEW, session=session, logits_processors=[stop_at_k]):
                got.append(token)
        assert len(got) == k
        assert got + continue_after(model, session, PROMPT, got, N_NEW) == want, k


def _interrupt_in(seconds):
    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, raise_interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    return old


def test_a_timer_interrupt_during_prefill_and_decode(small_batch_model):
    """Ctrl-C as a signal at many moments: during a long prompt's prefill
    (many chunks), or during decoding; the next call matches a fresh model."""
    model = small_batch_model
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 200, 150)]
    n = 12
    want = fresh(model, prompt, n)
    t0 = time.perf_counter()
    fresh(model, prompt, n)
    whole = time.perf_counter() - t0
    session = model.new_session()
    interrupted = 0
    mid_prefill = 0
    for delay in np.linspace(0.02, 1.2, 25) * whole:
        got = []
        session.reset()
        old = _interrupt_in(delay)
        try:
            for token in model.generate_tokens(prompt, n, session=session):
                got.append(token)
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        held = session.tokens
        assert list(held) == (prompt + got)[:len(held)]
        mid_prefill += 0 < len(held) < len(prompt)
        assert got + continue_after(model, session, prompt, got, n) == want, delay
    assert interrupted > 0
    if session.can_rewind:
        # a recurrent state restarts after an interrupt; an attention cache
        # keeps the chunks that ran
        assert mid_prefill > 0


def test_long_prompts_go_to_c_in_chunks(small_batch_model):
    model = small_batch_model
    session = model.new_session()
    real, sizes = session._state, []

    class Spy:
        def run(self, ids, *args):
            sizes.append(len(ids))
            return real.run(ids, *args)
    session._state = Spy()
    logits = session.logits(PROMPT)
    session._state = real
    assert sizes == [4, 4, 3]
    assert np.allclose(logits, model.new_session().logits(PROMPT), atol=1e-5)
