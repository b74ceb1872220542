"""The constraint hook of constrained decoding: a Sampler, Model and the
batching engine take an object that masks the logits, hears of each token
chosen, and says when the output is complete."""
import numpy as np
import pytest

from fastllm import Model, SamplingParams
from fastllm.generate.sampling import Sampler
from fastllm.serve.serving import BatchEngine


class FixedSequence:
    """Allows only the tokens of `sequence`, in order; done after the last."""

    def __init__(self, sequence):
        self.sequence = list(sequence)
        self.accepted = []
        self.masked = []   # the logits mask() was given, for checking the order of steps

    def mask(self, logits):
        self.masked.append(logits.copy())
        out = np.full_like(logits, -np.inf)
        want = self.sequence[len(self.accepted)]
        out[want] = logits[want]
        return out

    def accept(self, token):
        assert token == self.sequence[len(self.accepted)], "a disallowed token was chosen"
        self.accepted.append(token)

    @property
    def done(self):
        return len(self.accepted) == len(self.sequence)


def test_the_mask_comes_after_the_penalties_and_bias_and_before_the_draw():
    logits = np.linspace(-2, 2, 10, dtype=np.float32)
    c = FixedSequence([3, 3, 1])
    params = SamplingParams(temperature=0.7, seed=5, repetition_penalty=1.3, logit_bias={2: 5.0})
    s = Sampler(params, constraint=c)
    assert [s(logits, [4, 2]) for _ in range(3)] == [3, 3, 1]
    assert s.done
    # mask() saw the logits after the repetition penalty and the bias
    want = Sampler(params).process(logits, [4, 2])
    assert np.array_equal(c.masked[0], want)
    assert not Sampler(params).done   # no constraint: never done


def test_model_generation_follows_the_constraint_and_stops_when_done(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=2)
    seq = [7, 7, 30, 2, 9]
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        out = list(model.generate_tokens([1, 2, 3], 50, params, stop_token_ids=(),
                                         constraint=FixedSequence(seq)))
        assert out == seq
        assert model.last_stats.finish_reason == "stop"


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3_5-text"])
def test_constrained_requests_in_a_batch_equal_alone(kind, tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir(kind), threads=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, int(k)).tolist() for k in (5, 9, 3, 12)]
    seqs = [rng.integers(0, model.config.vocab_size, int(k)).tolist() for k in (4, 7, 2, 6)]
    settings = SamplingParams(temperature=0.8, seed=4)
    # a constrained request beside unconstrained ones: each gets what it gets alone
    alone = [list(model.generate_tokens(p, 10, settings, stop_token_ids=(),
                                        constraint=FixedSequence(s) if i % 2 == 0 else None))
             for i, (p, s) in enumerate(zip(prompts, seqs))]
    assert alone[0] == seqs[0] and alone[2] == seqs[2]
    engine = BatchEngine(model, parallel=3, max_queue=8, prefill_chunk=4)
    try:
        requests = [engine.submit(p, 10, settings, stop_ids=(),
                                  constraint=FixedSequence(s) if i % 2 == 0 else None)
                    for i, (p, s) in enumerate(zip(prompts, seqs))]
        assert [list(r) for r in requests] == alone
        assert [r.finish_reason for r in requests] == ["stop", "length", "stop", "length"]
    finally:
        engine.close()
