"""Sampling against transformers' logits processors, and reproducibility."""
import numpy as np
import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from fastllm.generate.sampling import Sampler, SamplingParams, apply_warpers, uniform_at


def hf_probs(logits, p: SamplingParams, previous=()):
    scores = torch.tensor(logits, dtype=torch.float32)[None]
    ids = torch.tensor([list(previous)], dtype=torch.long)
    if p.repetition_penalty != 1.0 and len(previous):
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    for warper in [TemperatureLogitsWarper(p.temperature),
                   TopKLogitsWarper(p.top_k) if p.top_k else None,
                   TopPLogitsWarper(p.top_p) if p.top_p < 1 else None,
                   MinPLogitsWarper(p.min_p) if p.min_p > 0 else None]:
        if warper is not None:
            scores = warper(ids, scores)
    return torch.softmax(scores, dim=-1)[0].double().numpy()


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.8, top_k=50, top_p=0.5),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.6, top_k=40, top_p=0.95, min_p=0.02),
    dict(temperature=1.0, repetition_penalty=1.3),
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_warpers_match_transformers(setting):
    """The whole chain (repetition penalty over a real history, then the
    warpers) against transformers' processors on the same history."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        logits = (rng.standard_normal(500) * 3).astype(np.float32)
        previous = rng.integers(0, 500, 30).tolist()
        p = SamplingParams(**setting)
        ours = apply_warpers(Sampler(p).process(logits, previous), p)
        want = hf_probs(logits, p, previous)
        assert np.array_equal(ours > 0, want > 0), f"kept sets differ in trial {trial}"
        assert np.allclose(ours, want, atol=1e-6)


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_transformers(penalty):
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal(100) * 3).astype(np.float32)
    previous = [3, 3, 7, 50, 99] + rng.integers(0, 100, 20).tolist()
    full = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([previous]), torch.tensor(logits)[None])
    ours = Sampler(SamplingParams(repetition_penalty=penalty)).process(logits, previous)
    assert np.array_equal(ours, full[0].numpy())
    assert not np.array_equal(ours, logits)
    # repeat_last_n looks back on the last N tokens only, as transformers does given those
    hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([previous[-4:]]), torch.tensor(logits)[None])
    ours = Sampler(SamplingParams(repetition_penalty=penalty, repeat_last_n=4)).process(logits, previous)
    assert np.array_equal(ours, hf[0].numpy())
    # no history, or a window of 0: nothing changes
    assert np.array_equal(Sampler(SamplingParams(repetition_penalty=penalty)).process(logits, []), logits)
    off = Sampler(SamplingParams(repetition_penalty=penalty, repeat_last_n=0))
    assert np.array_equal(off.process(logits, previous), logits)
    assert Sampler(SamplingParams(repetition_penalty=penalty))(logits, previous) == int(np.argmax(full[0]))


def test_greedy_is_argmax_and_seed_reproduces():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal(1000).astype(np.float32)
    assert Sampler(SamplingParams())(logits) == int(np.argmax(logits))

    def draws(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s(logits, position=p) for p in range(50)]
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_a_draw_depends_on_the_seed_and_position_alone():
    """Speculative decoding may draw at a position, throw the draw away and
    draw there again: the same (seed, position) must give the same token,
    whatever was drawn before, in whatever order."""
    logits = np.random.default_rng(5).standard_normal(500).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, seed=11))
    forward = [s(logits, position=p) for p in range(40)]
    backward = [s(logits, position=p) for p in reversed(range(40))][::-1]
    again = Sampler(SamplingParams(temperature=1.0, seed=11))
    assert forward == backward == [again(logits, list(range(p))) for p in range(40)]
    # an unseeded sampler picks its own seed once: reproducible within itself
    free = Sampler(SamplingParams(temperature=1.0))
    assert [free(logits, position=p) for p in range(40)] == [free(logits, position=p) for p in range(40)]
    assert Sampler(SamplingParams(temperature=1.0)).seed != free.seed


def test_uniforms_are_uniform_and_independent():
    """uniform_at over positions and over seeds: the mean, variance and lag-1
    correlation of a uniform sequence, within 5 standard errors."""
    n = 20000
    for row in ([uniform_at(3, p) for p in range(n)], [uniform_at(s, 17) for s in range(n)]):
        u = np.array(row)
        assert ((0 <= u) & (u < 1)).all()
        se = 1 / np.sqrt(n)
        assert abs(u.mean() - 0.5) < 5 * se * np.sqrt(1 / 12)
        assert abs(u.var() - 1 / 12) < 5 * se * np.sqrt(1 / 180)
        assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 * se


def test_draws_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount([s(logits, position=p) for p in range(20000)], minlength=3) / 20000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.015)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=12),
                                      dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.05)])
def test_draws_pass_a_chi_square_test_against_the_warped_softmax(settings):
    """Draws over 30,000 positions of one seed, and over 30,000 seeds at one
    position, against the probabilities apply_warpers gives: Pearson's
    chi-square statistic below its 0.999 quantile (scipy's), over the tokens
    expected at least 5 times (the rest pooled)."""
    from scipy.stats import chi2
    logits = (np.random.default_rng(6).standard_normal(40) * 1.5).astype(np.float32)
    params = SamplingParams(seed=0, **settings)
    probs = apply_warpers(logits, params)
    n = 30000
    one = Sampler(params)
    by_position = [one(logits, position=p) for p in range(n)]
    by_seed = [Sampler(params.replace(seed=s))(logits, position=9) for s in range(n)]
    for draws in (by_position, by_seed):
        counts = np.bincount(draws, minlength=probs.size)
        assert counts[probs == 0].sum() == 0   # nothing outside the kept set
        expected = probs * n
        big = expected >= 5
        observed = np.append(counts[big], counts[~big].sum())
        wanted = np.append(expected[big], expected[~big].sum())
        keep = wanted > 0
        stat = (((observed - wanted) ** 2)[keep] / wanted[keep]).sum()
        assert stat < chi2.ppf(0.999, keep.sum() - 1), (stat, keep.sum())


def test_top_k_one_is_greedy():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(300).astype(np.float32)
    s = Sampler(SamplingParams(temperature=2.0, top_k=1, seed=0))
    assert all(s(logits) == int(np.argmax(logits)) for _ in range(20))


def test_a_temperature_so_small_the_scores_overflow_is_greedy():
    # 5e-324 divides every logit into infinities: the mass goes to the best
    # token (the limit), masked tokens keep none, and the mask is obeyed
    rng = np.random.default_rng(4)
    logits = rng.standard_normal(300).astype(np.float32)
    for t in (5e-324, 1e-310):
        probs = apply_warpers(logits, SamplingParams(temperature=t))
        assert probs[int(np.argmax(logits))] == 1.0 and probs.sum() == 1.0
        masked = np.where(np.arange(300) % 7 == 0, logits, -np.inf).astype(np.float32)
        assert Sampler(SamplingParams(temperature=t, seed=1))(masked) == int(np.argmax(masked))
        negative = logits - 100
        assert Sampler(SamplingParams(temperature=t, seed=1))(negative) == int(np.argmax(negative))
    probs = apply_warpers(np.array([2.0, 2.0, 1.0], np.float32), SamplingParams(temperature=5e-324))
    assert probs.tolist() == [0.5, 0.5, 0.0]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(top_k=2.5), dict(min_p=2), dict(repetition_penalty=0),
                                 dict(temperature=float("nan")), dict(repeat_last_n=-2), dict(seed=1.5),
                                 dict(seed=-1), dict(seed=2**64), dict(temperature=float("inf")),
                                 dict(repetition_penalty=float("inf")), dict(repetition_penalty=1e308),
                                 dict(frequency_penalty=2.5), dict(presence_penalty=float("nan")),
                                 dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 101}),
                                 dict(logit_bias={3: float("inf")}), dict(logit_bias={"3": 1.0}),
                                 dict(logit_bias=5)])
def test_bad_parameters_are_refused_when_made(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams().replace(**bad)


def test_seeds_are_those_numpy_takes():
    for seed in (0, 2**64 - 1):
        Sampler(SamplingParams(temperature=1.0, seed=seed))(np.zeros(4, np.float32), position=2**40)


def test_frequency_and_presence_penalties_count_the_generated_tokens():
    """OpenAI's definition: logit - count * frequency_penalty - (count > 0) * presence_penalty,
    over the tokens this sampler chose (not the prompt)."""
    logits = np.array([3.0, 2.9, 2.8, 0.0], np.float32)
    s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.2))
    prompt = [1, 1, 1]   # the prompt's tokens are not penalized
    assert s(logits, prompt) == 0
    assert np.allclose(s.process(logits, prompt), [3.0 - 0.7, 2.9, 2.8, 0.0])
    assert s(logits, prompt) == 1          # 2.3 < 2.9
    assert s(logits, prompt) == 2          # 2.3, 2.2 < 2.8
    assert s(logits, prompt) == 0          # 2.3 > 2.2, 2.1
    assert np.allclose(s.process(logits, prompt), [3.0 - 1.2, 2.2, 2.1, 0.0])
    plain = Sampler(SamplingParams())
    assert [plain(logits) for _ in range(3)] == [0, 0, 0]


def test_logit_bias_is_added_before_the_draw():
    logits = np.array([1.0, 0.0, -1.0], np.float32)
    s = Sampler(SamplingParams(logit_bias={2: 5.0, 0: -100}))
    assert np.allclose(s.process(logits), [-99.0, 0.0, 4.0])
    assert s(logits) == 2
    with pytest.raises(ValueError, match="logit_bias: token id 3 is outside"):
        SamplingParams(logit_bias={3: 1.0}).check_vocabulary(3)
    assert SamplingParams(logit_bias={1: 2}).logit_bias == ((1, 2.0),)
