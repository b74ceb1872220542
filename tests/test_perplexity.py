"""fastllm perplexity against figures computed independently with
transformers in float64 on the same chunks (llama.cpp's scoring: the second
half of each chunk), and the bundled corpus.

Bounds: fastllm's logits are within 1e-4 of the float64 reference (see
test_tiny_models.py), so a per-token NLL or KL term moves by a few 1e-4 at
most; the means are held to 1e-4.
"""
import math

import numpy as np
import pytest

from fastllm import Model
from fastllm.cli import perplexity
from fastllm.cli.main import main
from oracles.hf_reference import hf_logits, load_hf
from test_cli import write_byte_tokenizer

CTX = 64
KIND = "llama-gqa"


def random_ids(vocab, n, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def reference_chunks(ids, ctx, bos=None):
    """The chunks llama.cpp scores, built here without fastllm's code."""
    out = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        chunk = list(ids[start:start + ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def reference_log_probs(ref, chunk):
    """float64 log-probs at the scored positions ctx/2 .. ctx-2, by torch."""
    import torch
    first = len(chunk) // 2
    logits = torch.from_numpy(hf_logits(ref, chunk)[first:len(chunk) - 1])
    return torch.log_softmax(logits, dim=-1).numpy(), np.array(chunk[first + 1:])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return Model.from_pretrained(tiny_model_dir(KIND), n_ctx=CTX, threads=2)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    from oracles.tiny_models import make_tiny_model
    return make_tiny_model(KIND, tmp_path_factory.mktemp("other") / KIND, seed=1)


@pytest.mark.parametrize("bos", [None, 7])
def test_ppl_is_exp_mean_nll_of_transformers(tiny, tiny_model_dir, bos):
    ids = random_ids(tiny.config.vocab_size, 3 * CTX + 10)
    ref = load_hf(tiny_model_dir(KIND))
    nll = []
    for chunk in reference_chunks(ids, CTX, bos):
        logp, want = reference_log_probs(ref, chunk)
        nll.append(-logp[np.arange(len(want)), want])
    nll = np.concatenate(nll)

    got = perplexity.evaluate(tiny, ids, CTX, bos=bos)
    assert (got.chunks, got.tokens) == (3, 3 * (CTX - 1 - CTX // 2))
    assert abs(math.log(got.ppl.value) - nll.mean()) < 1e-4
    # llama.cpp's error: PPL times the standard error of the mean NLL.
    error = got.ppl.value * math.sqrt(np.var(nll) / (nll.size - 1))
    assert got.ppl.error == pytest.approx(error, rel=1e-3)
    # The chunk count limits what is scored.
    one = perplexity.evaluate(tiny, ids, CTX, chunks=1, bos=bos)
    assert one.chunks == 1 and abs(math.log(one.ppl.value) - nll[:one.tokens].mean()) < 1e-4


def test_kl_of_a_model_against_itself_is_zero(tiny):
    ids = random_ids(tiny.config.vocab_size, 2 * CTX, seed=1)
    got = perplexity.evaluate(tiny, ids, CTX, base=tiny)
    kl = got.kl
    assert kl.kld.value == 0 and kl.kld_max == 0 and kl.same_top.value == 1
    assert kl.ln_ppl_ratio.value == 0 and kl.rms_dp.value == 0
    assert kl.ppl_base == got.ppl


def test_kl_against_another_model_matches_float64(tiny, tiny_model_dir, other_dir):
    ids = random_ids(tiny.config.vocab_size, 4 * CTX, seed=2)
    base = Model.from_pretrained(other_dir, n_ctx=CTX, threads=2)
    ref_model, ref_base = load_hf(tiny_model_dir(KIND)), load_hf(other_dir)
    kld, same, near_ties, nll, nll_base = [], [], 0, [], []
    for chunk in reference_chunks(ids, CTX):
        logq, want = reference_log_probs(ref_model, chunk)
        logp, _ = reference_log_probs(ref_base, chunk)
        kld.append(np.sum(np.exp(logp) * (logp - logq), axis=1))
        same.append(logq.argmax(axis=1) == logp.argmax(axis=1))
        for lp in (logq, logp):   # a top-1 that float32 may order either way
            top2 = np.sort(lp, axis=1)[:, -2:]
            near_ties += int(np.sum(top2[:, 1] - top2[:, 0] < 1e-3))
        rows = np.arange(len(want))
        nll.append(-logq[rows, want])
        nll_base.append(-logp[rows, want])
    kld, same = np.concatenate(kld), np.concatenate(same)
    nll, nll_base = np.concatenate(nll), np.concatenate(nll_base)
    assert kld.mean() > 0.05, "the two models must differ for the test to mean anything"

    kl = perplexity.evaluate(tiny, ids, CTX, base=base).kl
    assert abs(kl.kld.value - kld.mean()) < 1e-4
    assert abs(kl.kld_median - np.median(kld)) < 1e-4
    assert abs(kl.kld_99 - np.percentile(kld, 99)) < 1e-4
    assert abs(kl.kld_max - kld.max()) < 1e-4
    assert kl.kld.error == pytest.approx(math.sqrt(np.var(kld) / (kld.size - 1)), rel=1e-2)
    assert abs(kl.same_top.value * same.size - same.sum()) <= near_ties
    assert abs(kl.ln_ppl_ratio.value - (nll.mean() - nll_base.mean())) < 1e-4
    assert abs(math.log(kl.ppl_base.value) - nll_base.mean()) < 1e-4
    rms = math.sqrt(np.mean((np.exp(-nll) - np.exp(-nll_base)) ** 2))
    assert abs(kl.rms_dp.value - rms) < 1e-4


def test_bad_arguments_are_refused(tiny, tiny_model_dir):
    ids = random_ids(tiny.config.vocab_size, CTX)
    with pytest.raises(ValueError, match="at least one chunk"):
        perplexity.evaluate(tiny, ids[:CTX - 1], CTX)
    with pytest.raises(ValueError, match="ctx must be"):
        perplexity.evaluate(tiny, ids, 2)
    with pytest.raises(ValueError, match="less than ctx=128"):
        perplexity.evaluate(tiny, ids + ids, 128)
    other = Model.from_pretrained(tiny_model_dir("llama-headdim-bias"), n_ctx=CTX, threads=1)
    with pytest.raises(ValueError, match="vocabulary"):
        perplexity.evaluate(tiny, ids, CTX, base=other)


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_model_dir, tmp_path_factory):
    import shutil
    d = tmp_path_factory.mktemp("ppl-cli") / "tiny"
    shutil.copytree(tiny_model_dir(KIND), d)
    write_byte_tokenizer(d, Model.from_pretrained(d, n_ctx=CTX).config.vocab_size)
    return d


def test_cli_prints_the_figures(tiny_with_tokenizer, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8, encoding="utf-8")  # 360 bytes
    model = Model.from_pretrained(tiny_with_tokenizer, n_ctx=CTX, threads=1)
    ids = perplexity.tokenize(model, text.read_text())
    want = perplexity.evaluate(model, ids, CTX, bos=perplexity.chunk_bos(model))
    common = ["perplexity", str(text), "--model", str(tiny_with_tokenizer), "--ctx", str(CTX), "--threads", "1"]

    assert main(common) == 0
    out = capsys.readouterr()
    assert f"{want.chunks} chunks of {CTX} tokens, {want.tokens} tokens scored" in out.out
    assert f"Final estimate: PPL = {want.ppl.value:.4f} +/- {want.ppl.error:.5f}" in out.out
    assert f"[{want.chunks}/{want.chunks}]" in out.err

    assert main(common + ["--chunks", "2", "--kl-divergence-base", str(tiny_with_tokenizer)]) == 0
    out = capsys.readouterr().out
    assert "2 chunks of" in out and "Mean    KLD:   0.000000" in out and "Same top p: 100.000" in out

    assert main(common[:1] + [str(tmp_path / "missing.txt")] + common[2:]) == 1
    assert "missing.txt" in capsys.readouterr().err


def test_the_corpus_holds_enough_english(smollm2_dir):
    from fastllm.tokenizer import Tokenizer
    text = perplexity.corpus_text()
    assert text.isascii() and "the" in text.split()
    assert len(Tokenizer.from_pretrained(smollm2_dir).encode(text)) >= 20_000


def test_a_missing_corpus_says_what_to_install(monkeypatch):
    monkeypatch.setattr(perplexity, "CORPUS_PACKAGE", "no_such_package_fastllm")
    with pytest.raises(perplexity.CorpusMissingError, match="pip install gensim"):
        perplexity.corpus_path()
