"""Prefix reuse across turns and requests, for every family: what a
session resumes from gives, bit for bit, what a cold run gives.

Recurrent layers (Qwen3.5's Gated DeltaNet) cannot forget tokens, so a
session saves their states at checkpoints (the end of a prompt and of a
reply, a few tokens before a prompt's end, every CHECKPOINT_EVERY tokens of
a long one) and a prompt that shares only part of what a session holds
resumes from the nearest checkpoint inside the shared part. Sliding-window
layers hold only their window and one pass (a ring): a session goes back
as far as its rings still hold the window before, and further only to a
checkpoint, which saves the windows.
"""
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.serve.serving import BatchEngine
from fastllm.generate.session import CHECKPOINT_BEFORE_END, CHECKPOINT_EVERY

DATA = Path(__file__).resolve().parent / "data"
FILES = {
    "dense": DATA / "llama-family" / "llama2-256-Q4_K_M.gguf",
    "sliding window": DATA / "gemma-gguf" / "gemma3.gguf",
    "hybrid": DATA / "qwen35-gguf" / "wide-Q4_K_M.gguf",
    "hybrid moe": DATA / "moe-gguf" / "qwen35moe-Q8_0.gguf",
    "moe": DATA / "moe-gguf" / "qwen3moe-F32.gguf",
}
_models = {}


def model(name):
    if name not in _models:
        _models[name] = Model.from_pretrained(FILES[name], n_ctx=2 * CHECKPOINT_EVERY + 256, threads=2)
    return _models[name]


def ids(m, n, seed):
    return np.random.default_rng(seed).integers(3, min(m.config.vocab_size, 250), n).tolist()


@pytest.mark.parametrize("name", sorted(FILES))
def test_a_conversation_resumes_where_it_can_and_matches_a_cold_run(name):
    """Turn 1: prompt, reply. Turn 2 extends the reply (the slot holds it all),
    turn 3 re-renders the end of turn 2's prompt differently (diverges 2
    tokens before its end), turn 4 goes back to turn 1's prompt with another
    question. Each turn's tokens equal a fresh session's."""
    m = model(name)
    s = m.new_session()
    p1 = ids(m, 60, 1)
    r1 = list(m.generate_tokens(p1, 12, stop_token_ids=(), session=s))
    p2 = p1 + r1 + ids(m, 20, 2)
    p3 = p2[:-2] + ids(m, 9, 3)
    p4 = p1[:-1] + ids(m, 7, 4)
    for prompt in (p2, p3, p4):
        reused, held = s.reusable(prompt), list(s.tokens)
        got = list(m.generate_tokens(prompt, 10, stop_token_ids=(), session=s))
        assert got == list(m.generate_tokens(prompt, 10, stop_token_ids=(), session=m.new_session()))
        assert m.last_stats.prompt_tokens == len(prompt)
        if not name.startswith("hybrid"):   # attention caches (rings: within their reach)
            assert reused == max(i for i in range(len(prompt)) if prompt[:i] == held[:i])
    # what was reused each time: all of turn 1 and its reply (minus the reply's
    # last token, never run), then the checkpoint before turn 2's end, then
    # the one before turn 1's end
    if name.startswith("hybrid"):
        t = m.new_session()
        t.prefill(p1)
        list(m.generate_tokens(p1, 12, stop_token_ids=(), session=t))
        assert t.reusable(p2) == len(p1) + len(r1) - 1
        list(m.generate_tokens(p2, 10, stop_token_ids=(), session=t))
        assert t.reusable(p3) == len(p2) - CHECKPOINT_BEFORE_END
        assert t.reusable(p4) == len(p1) - CHECKPOINT_BEFORE_END


def test_a_long_prompt_leaves_checkpoints_on_the_way_within_a_bound():
    m = model("hybrid")
    s = m.new_session()
    long = ids(m, 2 * CHECKPOINT_EVERY + 100, 5)
    s.prefill(long)
    assert s.checkpoints == (CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY, len(long) - CHECKPOINT_BEFORE_END,
                             len(long))
    assert s.checkpoint_bytes == 4 * s._state.save_recurrent().nbytes
    other = long[:CHECKPOINT_EVERY + 500] + ids(m, 30, 6)
    assert s.reusable(other) == CHECKPOINT_EVERY
    assert np.array_equal(s.prefill(other), m.new_session().prefill(other))
    s.max_checkpoints = 2
    s.prefill(long)
    assert len(s.checkpoints) == 2 and s.checkpoints[-1] == len(long)
    # rewinding to a checkpoint is allowed, anywhere else refused
    s.rewind(len(long) - CHECKPOINT_BEFORE_END)
    assert np.array_equal(s.extend(long[-CHECKPOINT_BEFORE_END:]), m.new_session().prefill(long))
    with pytest.raises(ValueError, match="rewind to a checkpoint"):
        s.rewind(7)


@pytest.mark.parametrize("name", ["hybrid", "dense"])
def test_the_engine_resumes_a_conversation_from_its_slot_or_another(name):
    """Two slots, turn after turn of two conversations: each turn reuses the
    conversation so far (from a checkpoint where the template re-rendered
    the end) and gives the tokens of a cold run."""
    m = model(name)
    engine = BatchEngine(m, parallel=2, prefill_chunk=64)
    try:
        convs = [ids(m, 80, 10), ids(m, 70, 11)]
        for turn in range(3):
            requests = [engine.submit(c, 8, stop_ids=()) for c in convs]
            outs = [list(r) for r in requests]
            for c, out, r in zip(convs, outs, requests):
                assert out == list(m.generate_tokens(c, 8, stop_token_ids=(), session=m.new_session()))
                if turn:
                    assert r.prompt_reused >= len(c) - 30, (turn, r.prompt_reused, len(c))
            # the next turn: the reply, re-rendered from 2 tokens before the prompt's end
            convs = [c[:-2] + ids(m, 2, 20 + turn) + out + ids(m, 12, 30 + turn) for c, out in zip(convs, outs)]
    finally:
        engine.close()


def test_a_qwen35_chat_resumes_across_turns(tiny_qwen):
    """Qwen3.5's template renders an earlier reply without its thinking, so
    turn 2's prompt differs from what the session ran inside turn 1's reply:
    it resumes from the checkpoint at turn 1's prompt end, not from zero."""
    m = tiny_qwen("qwen3.5")
    s = m.new_session()
    messages = [{"role": "system", "content": "You are terse. " * 20},
                {"role": "user", "content": "Count to three."}]
    reply = m.chat(messages, max_new_tokens=20, session=s, temperature=0)
    messages += [{"role": "assistant", "content": "<think>\nok\n</think>\n\n" + reply},
                 {"role": "user", "content": "Again."}]
    text = m.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = m.tokenizer.encode(text, add_special_tokens=False)
    assert s.reusable(prompt) > 20
    got = m.chat(messages, max_new_tokens=20, session=s, temperature=0)
    assert got == m.chat(messages, max_new_tokens=20, session=m.new_session(), temperature=0)


@pytest.mark.parametrize("name", ["hybrid", "dense"])
def test_the_prompt_cache_keeps_what_a_slot_held_for_a_later_request(name):
    """One slot: conversation A, then an unrelated request B takes the slot,
    then A's next turn comes back and resumes from the prompt cache; C, a
    new conversation under A's system prompt, resumes there (for a hybrid
    model from the checkpoint left where C's prompt parted from A's). A
    small budget keeps nothing."""
    m = model(name)
    system = ids(m, 300, 40)
    a1 = system + ids(m, 10, 41)
    b = ids(m, 200, 42)
    engine = BatchEngine(m, parallel=1, prefill_chunk=64, cache_bytes=256 << 20)
    try:
        out = list(engine.submit(a1, 6, stop_ids=()))
        list(engine.submit(b, 6, stop_ids=()))
        assert len(engine.cache) == 1
        a2 = a1 + out + ids(m, 15, 43)
        c = system + ids(m, 12, 44)
        d = system + ids(m, 9, 45)
        # (C may share a token or two more with A by chance, and the checkpoints
        # at the branch point are taken there and CHECKPOINT_BEFORE_END before)
        for prompt, reused in ((a2, len(a1) + len(out) - 1), (c, 300 if m.new_session().can_rewind else 0),
                               (d, 300 if m.new_session().can_rewind else 300 - CHECKPOINT_BEFORE_END)):
            request = engine.submit(prompt, 6, stop_ids=())
            got = list(request)
            assert got == list(m.generate_tokens(prompt, 6, stop_token_ids=(), session=m.new_session()))
            assert reused <= request.prompt_reused <= reused + 3, (request.prompt_reused, reused)
        assert engine.cache.hits >= 1 and engine.cache.nbytes <= 256 << 20
    finally:
        engine.close()
    small = BatchEngine(m, parallel=1, cache_bytes=1 << 10)
    try:
        list(small.submit(a1, 2, stop_ids=()))
        list(small.submit(b, 2, stop_ids=()))
        assert len(small.cache) == 0
    finally:
        small.close()


def test_sliding_window_rings_go_back_within_their_reach_and_to_checkpoints():
    """Gemma 3's sliding layers (window 7) in rings of 256 slots (passes of at
    most 16 tokens): a session goes back up to 250 tokens from the furthest
    it ran without a checkpoint, further only to a checkpoint (which saves
    the windows), and every resumed or copied run gives a cold run's logits."""
    m = Model.from_pretrained(FILES["sliding window"], n_ctx=1024, threads=2, max_batch=16)
    s = m.new_session()
    assert not s.can_rewind and s.max_batch == 16
    long = ids(m, 700, 50)
    cold = m.new_session().logits(long)
    assert np.array_equal(s.logits(long), cold)
    # the rings hold 256 positions of each sliding layer, not 700
    full = Model.from_pretrained(FILES["sliding window"], n_ctx=1024, threads=2, max_batch=1024).new_session()
    full.prefill(long)
    assert s.memory_bytes < 0.5 * full.memory_bytes
    assert s.can_rewind_to(700 - 250) and not s.can_rewind_to(700 - 251)
    s.rewind(500)
    assert np.array_equal(s.extend(long[500:], all_logits=True), cold[500:])
    with pytest.raises(ValueError, match="hold only their window"):
        s.rewind(300)
    # a prompt parting from the sequence 400 tokens back resumes from a
    # checkpoint: none yet, so from zero; with one, from there
    other = long[:300] + ids(m, 20, 51)
    assert s.reusable(other) == 0
    s.prefill(long[:300])
    s.checkpoint()
    s.extend(long[300:])
    assert 300 in s.checkpoints and s.reusable(other) == 300
    assert np.array_equal(s.prefill(other), m.new_session().prefill(other))
    s.rewind(300)
    assert np.array_equal(s.extend(long[300:], all_logits=True), cold[300:])
    # a copy: from within the other's reach, or at its checkpoint
    t = m.new_session()
    t.copy_prefix(s, 600)
    assert np.array_equal(t.extend(long[600:], all_logits=True), cold[600:])
    t.copy_prefix(s, 300)
    assert np.array_equal(t.extend(long[300:], all_logits=True), cold[300:])
    with pytest.raises(ValueError, match="at a checkpoint"):
        t.copy_prefix(s, 200)
    # speculative verification: a draft of a pass, then a prefix kept
    s.rewind(680)
    s.verify(long[680:696])
    s.keep(5)
    assert np.array_equal(s.extend(long[685:], all_logits=True), cold[685:])
