"""The same logits, bit for bit, however a prompt reaches the run loop:
whole, in chunks of the work buffers, in uneven calls, token by token, and
beside other sequences in one batched pass."""
from __future__ import annotations

import numpy as np


def _prompt(vocab, n, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_same_bits_however_split(folder, load: dict) -> None:
    """load: Model.from_pretrained's keyword arguments (threads, kv_dtype)."""
    from fastllm import Model
    from fastllm.generate.session import extend_together

    model = Model.from_pretrained(folder, **load)
    ids = _prompt(model.config.vocab_size, 45, seed=2)
    whole = model.logits(ids)

    chunked = Model.from_pretrained(folder, max_batch=3, **load)
    assert np.array_equal(chunked.logits(ids), whole), "chunks of 3"
    session = model.new_session()
    parts = [session.extend(ids[a:b], all_logits=True) for a, b in ((0, 4), (4, 5), (5, 23), (23, 45))]
    assert np.array_equal(np.concatenate(parts), whole), "uneven calls"
    step = Model.from_pretrained(folder, max_batch=1, **{**load, "threads": 1}).new_session()
    for i, t in enumerate(ids):
        assert np.array_equal(step.step(t), whole[i]), f"token by token: position {i}"

    # Three sequences at different positions in one pass (a prompt's
    # chunk, one decoded token, a long extension), each as when alone.
    vocab = model.config.vocab_size
    runs = [(ids[:20], ids[20:33]), (_prompt(vocab, 9, seed=3), [7]),
            (_prompt(vocab, 12, seed=4), _prompt(vocab, 18, seed=0))]
    sessions = [model.new_session() for _ in runs]
    for session, (before, _) in zip(sessions, runs):
        session.extend(before)
    together = extend_together(sessions, [after for _, after in runs])
    assert np.array_equal(together[0], whole[32]), "in a batch"
    for (before, after), got in zip(runs, together):
        alone = model.new_session()
        alone.extend(before)
        assert np.array_equal(got, alone.extend(after)), "in a batch, at another position"


def assert_same_bits_for_thread_counts(folder, n_tokens: int, threads=(2, 3), vocab: int | None = None) -> None:
    """The logits of a prompt of n_tokens (ids below vocab, the model's own
    vocabulary when None) with each thread count, bit for bit as with one."""
    from fastllm import Model

    model = Model.from_pretrained(folder, threads=1)
    ids = _prompt(vocab or model.config.vocab_size, n_tokens, seed=6)
    one = model.logits(ids)
    for n in threads:
        assert np.array_equal(Model.from_pretrained(folder, threads=n).logits(ids), one), f"{n} threads"
