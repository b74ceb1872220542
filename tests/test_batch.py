"""Several sequences in one pass over the weights: every sequence's results
are the same, bit for bit, as when it runs alone, whatever runs beside it
(batch invariance)."""
import numpy as np
import pytest

from fastllm import Model
from fastllm.generate.session import extend_together
from fastllm import generate_batch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3_5-text"])
def test_sessions_in_one_pass_equal_each_alone(kind, tiny_model_dir):
    """Continuous batching: sessions at different positions, one prefilling
    while the others decode, a recurrent (Gated DeltaNet) model included."""
    model = Model.from_pretrained(tiny_model_dir(kind), threads=2)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (9, 4, 13)]
    together = [model.new_session() for _ in seqs]
    alone = [model.new_session() for _ in seqs]
    # The first session starts earlier, the third joins with a whole prompt.
    plans = [[(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)],
             [None, (0, 1), (1, 2), (2, 3), (3, 4)],
             [None, None, (0, 11), (11, 12), (12, 13)]]
    for step in range(5):
        batch = [(k, plan[step]) for k, plan in enumerate(plans) if plan[step]]
        got = extend_together([together[k] for k, _ in batch],
                              [seqs[k][a:b] for k, (a, b) in batch])
        for row, (k, (a, b)) in zip(got, batch):
            want = alone[k].extend(seqs[k][a:b])
            assert np.array_equal(row, want), f"session {k} at step {step} differs from alone"
    for s, ids in zip(together, seqs):
        assert s.tokens == tuple(ids)


def test_batch_checks_its_inputs(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=2)
    s = model.new_session()
    with pytest.raises(ValueError, match="twice"):
        extend_together([s, s], [[1], [2]])
    with pytest.raises(ValueError, match="vocabulary"):
        extend_together([s], [[model.config.vocab_size]])
    other = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=2)
    with pytest.raises(ValueError, match="another model"):
        extend_together([s, other.new_session()], [[1], [2]])
    assert s.position == 0


@pytest.mark.slow
def test_generate_batch_equals_generate_alone(smollm2_dir):
    model = Model.from_pretrained(smollm2_dir, n_ctx=256, threads=2)
    for settings in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}):
        batch = generate_batch(model, PROMPTS, 24, **settings)
        alone = [model.generate(p, 24, **settings) for p in PROMPTS]
        assert batch == alone, settings
    # A stop string cuts each continuation where generate would stop.
    assert generate_batch(model, PROMPTS[:2], 24, stop="\n") == \
        [model.generate(p, 24, stop="\n") for p in PROMPTS[:2]]
