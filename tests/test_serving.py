"""The continuous-batching engine: requests joining and leaving between
steps, prompts prefilled in chunks beside decoding ones, and every
request's tokens exactly those of generate_tokens alone."""
import time

import numpy as np
import pytest

from fastllm import Model, SamplingParams
from fastllm.generate.session import CHECKPOINT_BEFORE_END
from fastllm.serve.serving import BatchEngine, QueueFull


def _prompts(model, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, model.config.vocab_size, int(k)).tolist() for k in rng.integers(3, 20, n)]


def _wait(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3_5-text", "qwen3_moe", "qwen3_5_moe"])
def test_requests_equal_alone_whatever_runs_beside_them(kind, tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir(kind), threads=2)
    prompts = _prompts(model, 7)
    settings = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=11)]
    alone = [[list(model.generate_tokens(p, 12, s, stop_token_ids=())) for p in prompts] for s in settings]
    # 3 slots for 7 requests, 4-token prefill chunks: requests queue, join
    # while others decode, and prefill over several steps.
    engine = BatchEngine(model, parallel=3, max_queue=16, prefill_chunk=4)
    try:
        for s, want in zip(settings, alone):
            requests = []
            for p in prompts:
                requests.append(engine.submit(p, 12, s, stop_ids=()))
                time.sleep(0.001)
            assert [list(r) for r in requests] == want
            assert all(r.finish_reason == "length" for r in requests)
    finally:
        engine.close()


def test_cancel_frees_the_slot_and_the_queue_has_a_bound(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), n_ctx=512, threads=2)
    a, b, c = _prompts(model, 3, seed=1)
    engine = BatchEngine(model, parallel=1, max_queue=1)
    try:
        first = engine.submit(a, 400, stop_ids=())
        _wait(lambda: engine.active == 1)
        second = engine.submit(b, 5, stop_ids=())
        with pytest.raises(QueueFull):
            engine.submit(c, 5, stop_ids=())
        tokens = iter(first)
        next(tokens)
        first.cancel()
        rest = list(tokens)
        assert first.finish_reason == "cancelled" and len(rest) < 399
        assert list(second) == list(model.generate_tokens(b, 5, stop_token_ids=()))
    finally:
        engine.close()


def test_a_longer_prompt_reuses_what_a_slot_holds(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=2)
    base = _prompts(model, 1, seed=2)[0]
    longer = base + [5, 6, 7]
    engine = BatchEngine(model, parallel=2)
    try:
        list(engine.submit(base, 4, stop_ids=()))
        again = engine.submit(longer, 6, stop_ids=())
        assert list(again) == list(model.generate_tokens(longer, 6, stop_token_ids=()))
        assert again.prompt_reused >= len(base) - 1
    finally:
        engine.close()


def test_bad_requests_are_refused_at_submit(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), n_ctx=32, threads=2)
    engine = BatchEngine(model, parallel=1)
    try:
        with pytest.raises(ValueError, match="vocabulary"):
            engine.submit([model.config.vocab_size], 4)
        with pytest.raises(ValueError, match="context"):
            engine.submit(list(range(32)), 4)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3_5-text"])
def test_a_shared_prefix_is_copied_between_slots(kind, tiny_model_dir):
    """A second request whose prompt shares a long prefix with a running one
    starts from a copy of that prefix's cache (attention layers); a recurrent
    state holds everything it has seen, so it is copied from the first
    request's checkpoint inside the shared prefix (CHECKPOINT_BEFORE_END
    tokens before its prompt's end). Either way the tokens are those of the
    request alone."""
    model = Model.from_pretrained(tiny_model_dir(kind), n_ctx=256, threads=2)
    rng = np.random.default_rng(4)
    shared = rng.integers(0, model.config.vocab_size, 40).tolist()
    first, second = shared + [1, 2, 3], shared + [4, 5]
    engine = BatchEngine(model, parallel=2, prefill_chunk=64)
    try:
        running = engine.submit(first, 60, stop_ids=())
        tokens = iter(running)
        next(tokens)
        other = engine.submit(second, 8, stop_ids=())
        assert list(other) == list(model.generate_tokens(second, 8, stop_token_ids=()))
        if model.new_session().can_rewind:
            assert other.prompt_reused == len(shared)
        else:
            assert other.prompt_reused == len(first) - CHECKPOINT_BEFORE_END
        assert list(tokens) == list(model.generate_tokens(first, 60, stop_token_ids=()))[1:]
    finally:
        engine.close()


def test_asyncio_readers_get_every_token_without_a_thread_each(tiny_model_dir):
    """`async for` over requests: the engine wakes each reader's event loop
    per token, whether the reader waits before its tokens come or starts
    after all of them came."""
    import asyncio
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=2)
    prompts = _prompts(model, 5, seed=3)
    want = [list(model.generate_tokens(p, 10, stop_token_ids=())) for p in prompts]
    engine = BatchEngine(model, parallel=2, max_queue=8)

    async def read(request):
        return [token async for token in request]

    async def main():
        requests = [engine.submit(p, 10, stop_ids=()) for p in prompts]
        _wait(lambda: requests[0].finish_reason)   # its tokens all came before its reader starts
        return await asyncio.wait_for(asyncio.gather(*(read(r) for r in requests)), 60)
    try:
        assert asyncio.run(main()) == want
    finally:
        engine.close()


class _Boom(Exception):
    pass


class _FailingConstraint:
    """Fails in mask() at its n-th call: a failure inside one request's step."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def mask(self, logits):
        self.calls += 1
        if self.calls == self.n:
            raise _Boom("mask failed")
        return logits

    def accept(self, token):
        pass

    done = False


def test_a_failing_request_ends_alone_and_the_engine_goes_on(tiny_model_dir, monkeypatch):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=2)
    a, b, c = _prompts(model, 3, seed=5)
    want_b = list(model.generate_tokens(b, 8, stop_token_ids=()))
    engine = BatchEngine(model, parallel=2)
    try:
        bad = engine.submit(a, 8, stop_ids=(), constraint=_FailingConstraint(3))
        good = engine.submit(b, 8, stop_ids=())
        with pytest.raises(_Boom):
            list(bad)
        assert bad.finish_reason == "error" and isinstance(bad.error, _Boom)
        assert list(good) == want_b and good.finish_reason == "length"
        # a whole pass that fails ends the requests in it; the next ones run
        from fastllm.serve import serving
        real = serving.extend_together
        calls = []

        def fail_once(*args):
            calls.append(1)
            if len(calls) == 1:
                raise _Boom("pass failed")
            return real(*args)
        monkeypatch.setattr(serving, "extend_together", fail_once)
        hit = engine.submit(c, 8, stop_ids=())
        with pytest.raises(_Boom):
            list(hit)
        assert engine.alive
        assert list(engine.submit(b, 8, stop_ids=())) == want_b
    finally:
        engine.close()
    assert not engine.alive


def test_bad_settings_are_refused_on_the_callers_thread(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=2)
    engine = BatchEngine(model, parallel=1)
    try:
        with pytest.raises(ValueError, match="seed"):
            engine.submit([1, 2], 4, SamplingParams(temperature=1.0).replace(seed=-1))
        with pytest.raises(ValueError, match="logit_bias"):
            engine.submit([1, 2], 4, SamplingParams(logit_bias={model.config.vocab_size: 1.0}))
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.submit([1, 2], -1)
        assert engine.queue_depth == 0 and engine.active == 0
        assert list(engine.submit([1, 2], 3, stop_ids=())) == \
            list(model.generate_tokens([1, 2], 3, stop_token_ids=()))
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3_5-text"])
def test_choices_of_one_prompt_share_its_prefill(kind, tiny_model_dir):
    """n choices: the prompt runs once, the others copy its keys/values and
    logits; each choice is what it would be alone with its own seed."""
    model = Model.from_pretrained(tiny_model_dir(kind), threads=2)
    prompt = _prompts(model, 1, seed=6)[0] * 3
    settings = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    alone = [list(model.generate_tokens(prompt, 9, s, stop_token_ids=())) for s in settings]
    engine = BatchEngine(model, parallel=3, prefill_chunk=8)
    try:
        requests = engine.submit_many(prompt, 9, settings, stop_ids=())
        assert [list(r) for r in requests] == alone
        assert [r.prompt_reused for r in requests] == [0, len(prompt), len(prompt)]
        with pytest.raises(QueueFull):   # all or none
            BatchEngine.submit_many(engine, prompt, 2, [None] * 65)
        assert engine.queue_depth == 0
    finally:
        engine.close()
