"""Bad calls, bad config values and interrupts: each gets a clear error or
leaves the model consistent, never a crash, a hang or a silent wrong answer."""
import json
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model, ResourceLimitWarning, SamplingParams
from fastllm.core import _core
from fastllm.spec.config import ModelConfig
from fastllm.spec.errors import ModelFileError
from oracles import tiny_models
from fastllm import generate_tokens_batch

ROOT_TINY = Path(__file__).parent / "data" / "tiny-llama"
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

    def __getattr__(self, name):   # the rest of the state as it is
        return getattr(self.state, name)

    def run(self, *args, **kwargs):
        out = self.state.run(*args, **kwargs)
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


def interrupted_after(seconds, body) -> bool:
    """Run body with a KeyboardInterrupt raised by a timer signal after
    seconds, as Ctrl-C would; whether it came before body returned."""
    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGALRM, raise_interrupt)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            body()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        return True
    finally:
        signal.signal(signal.SIGALRM, old)
    return False


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
        interrupted += interrupted_after(delay, lambda: got.extend(
            token for token in model.generate_tokens(prompt, n, session=session)))
        held = session.tokens
        assert list(held) == (prompt + got)[:len(held)]
        mid_prefill += 0 < len(held) < len(prompt)
        assert got + continue_after(model, session, prompt, got, n) == want, delay
    assert interrupted > 0
    if session.can_rewind:
        # a recurrent state restarts after an interrupt; an attention cache
        # keeps the chunks that ran
        assert mid_prefill > 0


def test_an_interrupt_as_a_generation_takes_its_session_leaves_it_free(small_batch_model):
    """A Ctrl-C that lands just after a generation marked the session as
    held, as the session's lock is given back: the session is not left held
    by a generation that no longer exists (the timer test above hits this
    moment only now and then)."""
    model = small_batch_model
    want = fresh(model, PROMPT, N_NEW)
    session = model.new_session()
    release = session._use

    @contextmanager
    def interrupted_as_released():
        with release():
            yield
        raise KeyboardInterrupt

    session._use = interrupted_as_released
    with pytest.raises(KeyboardInterrupt):
        list(model.generate_tokens(PROMPT, N_NEW, session=session))
    del session._use
    assert list(model.generate_tokens(PROMPT, N_NEW, session=session)) == want


def test_a_timer_interrupt_on_the_default_session_leaves_it_usable(small_batch_model):
    """The default session's lock is released whatever the interrupt hits."""
    model = small_batch_model
    prompt = PROMPT * 6
    want = fresh(model, prompt, N_NEW)
    for delay in np.geomspace(1e-5, 2e-2, 20):
        got = []
        model._session.reset()
        interrupted_after(delay, lambda: got.extend(token for token in model.generate_tokens(prompt, N_NEW)))
        assert model._owner is None
        assert got + list(model.generate_tokens(prompt + got, N_NEW - len(got))) == want, delay


def test_long_prompts_go_to_c_in_chunks(small_batch_model):
    model = small_batch_model
    session = model.new_session()
    real, sizes = session._state, []

    class Spy:
        def run(self, ids, *args, **kwargs):
            sizes.append(len(ids))
            return real.run(ids, *args, **kwargs)
    session._state = Spy()
    logits = session.logits(PROMPT)
    session._state = real
    assert sizes == [4, 4, 3]
    # The same bits as the whole prompt in one call.
    whole = Model.from_pretrained(model.path, threads=1, n_ctx=256)
    assert np.array_equal(logits, whole.new_session().logits(PROMPT))


# ------------------------------------------------ threads, ids, positions

def test_two_threads_on_one_model_match_sequential_results(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=96)
    prompts = [PROMPT, PROMPT[:4] + [40, 41]]
    want = [list(model.generate_tokens(p, N_NEW)) for p in prompts]
    got = [None, None]

    def run(i):
        for _ in range(5):
            got[i] = list(model.generate_tokens(prompts[i], N_NEW))
    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert got == want
    assert list(model.generate_tokens(prompts[0], N_NEW)) == want[0]


def test_positions_are_checked_in_64_bits(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=96)
    state = model.new_session()._state
    ids = np.array([5, 6], np.int32)
    for pos in (2**31 - 1, 2**31 - 2, 95, -1):
        with pytest.raises(ValueError, match="do not fit the context"):
            state.run(ids, pos)
    with pytest.raises(OverflowError):
        state.run(ids, 2**63)


@pytest.mark.parametrize("bad", [2**32 + 5, -2**32 + 5, 2**63, -1, 1.5, True])
def test_ids_are_checked_at_their_own_width(tiny_model_dir, bad):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=96)
    for call in (lambda: model.logits([5, bad]), lambda: list(model.generate_tokens([5, bad], 2)),
                 lambda: model.logits(np.array([5, bad], dtype=object))):
        with pytest.raises(ValueError, match="token id|integers"):
            call()


def test_threads_are_capped_at_the_cpus_available(tiny_model_dir):
    import os
    cpus = len(os.sched_getaffinity(0))
    with pytest.warns(ResourceLimitWarning, match=f"may use {cpus} CPUs"):
        model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1000, n_ctx=32)
    assert model.threads == cpus
    model.threads = 1
    with pytest.warns(ResourceLimitWarning, match=f"may use {cpus} CPUs"):
        model.threads = 1000
    assert model.threads == cpus
    for bad in (0, -3, 2.5, "4", True):
        with pytest.raises(ValueError, match="threads must be a whole number"):
            model.threads = bad
        with pytest.raises(ValueError, match="threads must be a whole number"):
            Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=bad)
    assert model.threads == cpus
    assert model.logits(PROMPT).shape == (len(PROMPT), model.config.vocab_size)


# ------------------------------------------------------- config values

def with_config(tiny_model_dir, tmp_path, kind="llama-gqa", **changes):
    """A copy of a tiny model whose config.json has changes (None deletes a key)."""
    return tiny_models.with_config(tiny_model_dir(kind), tmp_path / "model", **changes)


BAD_CONFIGS = [
    (dict(rope_scaling={"rope_type": "linear", "factor": 0}), "rope_scaling 'factor'"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling 'factor'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": -2}), "rope_scaling 'factor'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 1,
                        "original_max_position_embeddings": 64}), "must differ"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8}), "low_freq_factor|original_max"),
    (dict(rope_scaling="linear"), "rope_scaling must be an object"),
    (dict(rope_scaling={"rope_type": "ntk", "factor": 2}), "'ntk' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn"}), "rope_scaling 'factor'"),
    (dict(rope_theta=0, rope_parameters=None), "rope_theta"),
    (dict(rope_theta=-10000.0, rope_parameters=None), "rope_theta"),
    (dict(rope_theta="1e4", rope_parameters=None), "rope_theta"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}), "rope_theta"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "rope_scaling 'factor'"),
    (dict(rms_norm_eps=-1e-5), "rms_norm_eps"),
    (dict(rms_norm_eps="small"), "rms_norm_eps"),
    (dict(eos_token_id={"id": 2}), "eos_token_id"),
    (dict(eos_token_id=[2, -1]), "eos_token_id"),
    (dict(bos_token_id="<s>"), "bos_token_id"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings"),
    (dict(partial_rotary_factor="half"), "partial_rotary_factor"),
    (dict(hidden_size=2**40), "'hidden_size' must be a positive integer"),
    (dict(num_hidden_layers=2.0), "'num_hidden_layers' must be a positive integer"),
]


@pytest.mark.parametrize("changes,problem", BAD_CONFIGS, ids=[str(c) for c, _ in BAD_CONFIGS])
def test_bad_config_values_are_refused_naming_file_and_field(tiny_model_dir, tmp_path, changes, problem):
    folder = with_config(tiny_model_dir, tmp_path, **changes)
    with pytest.raises(ModelFileError, match=problem) as e:
        Model.from_pretrained(folder)
    assert e.value.path == folder / "config.json"


@pytest.mark.parametrize("interval", [0, -4, 1.5, "4"])
def test_full_attention_interval_is_checked(tiny_model_dir, tmp_path, interval):
    folder = with_config(tiny_model_dir, tmp_path, "qwen3_5-text", layer_types=None,
                         full_attention_interval=interval)
    with pytest.raises(ModelFileError, match="full_attention_interval") as e:
        Model.from_pretrained(folder)
    assert e.value.path == folder / "config.json"


# --------------------------------------------- memory, before allocating

def test_a_huge_hidden_size_is_refused_by_the_checkpoint_before_allocating(tiny_model_dir, tmp_path):
    folder = with_config(tiny_model_dir, tmp_path, hidden_size=10**9, head_dim=16)
    with pytest.raises(ModelFileError, match="has shape .* config.json implies"):
        Model.from_pretrained(folder, n_ctx=32)
    # without head_dim, hidden_size / num_attention_heads is the head's width: refused by itself
    folder = with_config(tiny_model_dir, tmp_path / "b", hidden_size=10**9, head_dim=None)
    with pytest.raises(ModelFileError, match="head_dim must be a positive even integer of at most 8192, "
                                             "got 250000000"):
        Model.from_pretrained(folder, n_ctx=32)


def test_a_huge_context_is_refused_or_capped_before_allocating(tiny_model_dir, tmp_path, monkeypatch):
    folder = with_config(tiny_model_dir, tmp_path, max_position_embeddings=10**9)
    with pytest.raises(ValueError, match="n_ctx=1000000000 needs .* GiB .* choose a smaller n_ctx"):
        Model.from_pretrained(folder, n_ctx=10**9)
    # the default context, max_position_embeddings, is capped to half the RAM
    import fastllm.generate.model
    monkeypatch.setattr(fastllm.generate.model, "physical_memory", lambda: 64 << 20)
    with pytest.warns(ResourceLimitWarning, match="max_position_embeddings is 1000000000.*capped at"):
        model = Model.from_pretrained(folder, threads=1)
    assert 0 < model.n_ctx and model.config.context_bytes(model.n_ctx, "f32", 1) <= 32 << 20
    assert model.logits(PROMPT).shape == (len(PROMPT), model.config.vocab_size)


@pytest.mark.parametrize("n_ctx", [2.7, 2.0, "64", 0, -5, True, 2**31])
def test_n_ctx_must_be_a_whole_number(tiny_model_dir, n_ctx):
    with pytest.raises(ValueError, match="n_ctx must be a whole number"):
        Model.from_pretrained(tiny_model_dir("llama-gqa"), n_ctx=n_ctx)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    from fastllm.tokenizer import Tokenizer
    model.tokenizer = Tokenizer.from_pretrained(ROOT_TINY)
    calls = []
    encode = model.tokenizer.encode
    model.tokenizer.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    with pytest.raises(ValueError, match="characters: more tokens than the context"):
        model.generate("a" * (20 << 20))
    with pytest.raises(ValueError, match="characters: more tokens than the context"):
        model.chat([{"role": "user", "content": "a" * (20 << 20)}])
    assert calls == []
    # a prompt under the bound is tokenized and then checked in tokens
    with pytest.raises(ValueError, match="tokens: no room left"):
        model.generate(" a" * 64)
    assert calls


def test_config_json_is_read_with_a_bound(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    with pytest.raises(ModelFileError, match="not a regular file"):
        Model.from_pretrained(folder)
    (folder / "config.json").unlink()
    (folder / "config.json").write_bytes(b" " * (5 << 20))
    with pytest.raises(ModelFileError, match="more than the .* bytes such a file may have"):
        Model.from_pretrained(folder)


# ---------------------------------------------------------- text calls

def test_empty_stop_strings_are_refused_alike(tiny_model_dir):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    from fastllm.tokenizer import Tokenizer
    model.tokenizer = Tokenizer.from_pretrained(ROOT_TINY)
    for stop in ("", [""], ["x", ""]):
        with pytest.raises(ValueError, match="stop strings must not be empty"):
            model.generate("hello", 4, stop=stop)
        with pytest.raises(ValueError, match="stop strings must not be empty"):
            model.stream("hello", 4, stop=stop)   # at the call, not at the first piece
    with pytest.raises(TypeError, match="stop must be a string or a list of strings"):
        model.generate("hello", 4, stop=[3])
    assert model.generate("hello", 4, stop=[]) == model.generate("hello", 4)


@pytest.mark.parametrize("bad", [dict(top_k=1.5), dict(seed="abc"), dict(temperature="hot"),
                                 dict(top_p=0), dict(repetition_penalty=-1)])
def test_bad_sampling_settings_name_the_setting(bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=f"{key} must be"):
        SamplingParams(**bad)
    with pytest.raises(ValueError, match=f"{key} must be"):
        SamplingParams().replace(**bad)


@pytest.mark.parametrize("bad", [2.5, -1, "3"])
def test_max_new_tokens_is_checked(tiny_model_dir, bad):
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        model.generate_tokens(PROMPT, bad)   # at the call, not at the first token


# ------------------------------------------------------- chat templates

EXPLOSIVE_TEMPLATES = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses"),
    ("{{ 'a' * 10**10 }}", "value of"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "value of"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "value of"),
    ("{{ ''|center(10**10) }}", "larger than allowed"),
    ("{{ 'x'.ljust(10**10) }}", "larger than allowed"),
    ("{{ '%1000000000d' % 1 }}", "width"),
    ("{{ '%*d' % (1000000000, 1) }}", "width"),
    ("{{ '{:1000000000}'.format(1) }}", "width"),
    ("{{ ('a' * 10**7)|replace('a', 'a' * 1000) }}", "value of"),
    ("{{ range(10000)|join('x' * 10**5) }}", "value of"),
    ("{{ range(10000)|map('string')|join('x' * 10**5) }}", "value of"),
    ("{{ ('x' * 10**5).join(range(10000)|map('string')) }}", "value of"),
    ("{{ (10 ** 100000) }}", "too large"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = '{0}{0}'.format(ns.s) %}"
     "{% endfor %}", "value of"),
    ("{% for i in range(100000) %}{{ messages[0].content * 1000 }}{% endfor %}", "more than"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{{ messages[0].content|int / 0 }}", "ZeroDivisionError"),
    ("{{ range(10**9) }}", "OverflowError"),
    # Found by fuzzing: jinja's code generation takes time cubic in the
    # nesting (300 unary minus signs: minutes), and Python refuses the code
    # of deeper nestings with a SyntaxError.
    ("{% for m in messages %}{{ m.content" + "-" * 300 + "1 }}{% endfor %}", "nested more than 64"),
    ("{{ 'a'" + "|trim" * 200 + " }}", "nested more than 64"),
    ("{% if true %}" * 120 + "{% endif %}" * 120, "nested more than 64"),
    ("{% for m in messages %}" * 21 + "{% endfor %}" * 21, "too deeply nested"),
]


@pytest.mark.parametrize("template,problem", EXPLOSIVE_TEMPLATES, ids=[t[:80] for t, _ in EXPLOSIVE_TEMPLATES])
def test_a_chat_template_that_explodes_is_bounded(template, problem):
    from fastllm.tokenizer.chat_template import TemplateError, render_chat
    with pytest.raises(TemplateError, match=problem):
        render_chat(template, [{"role": "user", "content": "hello"}])


def test_bounded_templates_still_render_what_real_ones_do():
    from fastllm.tokenizer.chat_template import render_chat
    t = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
         "{{ '%d' % ns.n ~ ': ' ~ m.content|trim|indent(2) ~ '-' * 3 }}\n{% endfor %}"
         "{{ messages|map(attribute='role')|join(', ') }}{{ ' {:>4}'.format(ns.n) }}")
    msgs = [{"role": "user", "content": " a\nb "}, {"role": "assistant", "content": "c"}]
    assert render_chat(t, msgs) == "1: a\n  b---\n2: c---\nuser, assistant    2"
    # Nesting within the bound: 20 loops in loops (Python's limit), a long
    # chain of + and of filters.
    assert render_chat("{% for m in messages %}" * 20 + "{{ m.role }}" + "{% endfor %}" * 20, msgs[1:]) == "assistant"
    assert render_chat("{{ messages[0].content" + " + 'x'" * 50 + " }}", msgs) == " a\nb " + "x" * 50
    assert render_chat("{{ messages[1].content" + "|trim" * 50 + " }}", msgs) == "c"


def test_a_normalizer_chain_that_multiplies_the_text_is_refused(tmp_path):
    """Found by fuzzing: Replace steps of "" (or feeding each other) multiply
    the text at every step, and encoding ran for minutes. Past a 64-fold
    growth the tokenizer.json is refused at encode."""
    from fastllm.tokenizer import Tokenizer, TokenizerError
    base = json.loads((Path(__file__).parent / "data" / "tiny-llama" / "tokenizer.json").read_text())
    base["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Replace", "pattern": {"String": ""}, "content": "ab" * 20}] * 6}
    (tmp_path / "tokenizer.json").write_text(json.dumps(base))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="cannot be used"):
        tok.encode("hello world")


# ------------------------------------------------ sessions, streams, engines

from test_reliability_files import _finishes as within  # noqa: E402  (fn() or what it raised, a hang failing)

def test_a_session_of_another_model_is_refused(tiny_model_dir):
    from fastllm.generate.session import extend_together
    ours = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    theirs = Model.from_pretrained(tiny_model_dir("qwen2"), threads=1, n_ctx=64)
    foreign = theirs.new_session()
    with pytest.raises(ValueError, match="another model"):
        list(ours.generate_tokens(PROMPT, 2, session=foreign))
    with pytest.raises(ValueError, match="another model"):
        ours.logits(PROMPT, session=foreign)
    mine = ours.new_session()
    mine.prefill(PROMPT)
    with pytest.raises(ValueError, match="another model"):
        foreign.copy_prefix(mine, 3)
    with pytest.raises(ValueError, match="another model"):
        extend_together([mine, foreign], [[5], [6]])
    assert mine.tokens == tuple(PROMPT) and foreign.tokens == ()
    # the same files loaded twice are two models too: their sessions do not mix
    twin = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    with pytest.raises(ValueError, match="another model"):
        list(ours.generate_tokens(PROMPT, 2, session=twin.new_session()))


def test_a_half_read_stream_does_not_block_other_threads(tiny_model_dir):
    """One thread reads a stream on the default session partly and stops;
    another thread's calls run meanwhile (on a session of their own) instead
    of waiting for ever."""
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    want = list(model.generate_tokens(PROMPT, N_NEW))
    stream = model.generate_tokens(PROMPT, N_NEW)
    first = next(stream)
    assert within(lambda: list(model.generate_tokens(PROMPT, N_NEW)), 30) == want
    assert within(lambda: model.logits(PROMPT), 30).shape == (len(PROMPT), model.config.vocab_size)
    assert [first] + list(stream) == want
    # the default session is the stream's no longer: the next call takes it
    assert list(model.generate_tokens(PROMPT, N_NEW)) == want
    assert model._session.tokens[:len(PROMPT)] == tuple(PROMPT)


class RulesOutEverything:
    """A constraint under which no token may come."""
    done = False

    def mask(self, logits):
        return np.full_like(logits, -np.inf)

    def accept(self, token):
        raise AssertionError(f"token {token} was chosen although none may come")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logits_with_no_token_left_raise_instead_of_choosing_one(tiny_model_dir, temperature):
    from fastllm.serve.serving import BatchEngine
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    sampling = SamplingParams(temperature=temperature, seed=1)
    for processor in (lambda tokens, logits: np.full_like(logits, -np.inf),
                      lambda tokens, logits: np.full_like(logits, np.nan)):
        with pytest.raises(ValueError, match="no token can be chosen"):
            list(model.generate_tokens(PROMPT, 3, sampling, logits_processors=[processor]))
    with pytest.raises(ValueError, match="every token is ruled out"):
        list(model.generate_tokens(PROMPT, 3, sampling, constraint=RulesOutEverything()))
    engine = BatchEngine(model, parallel=2)
    try:
        failing = engine.submit(PROMPT, 3, sampling, constraint=RulesOutEverything())
        fine = engine.submit(PROMPT, 3, sampling)
        with pytest.raises(ValueError, match="every token is ruled out"):
            list(failing)
        assert failing.finish_reason == "error"
        assert list(fine) == list(model.generate_tokens(PROMPT, 3, sampling, session=model.new_session()))
    finally:
        engine.close()


def test_a_batch_request_read_twice_and_an_engine_used_after_close(tiny_model_dir):
    import asyncio
    from fastllm.serve.serving import BatchEngine
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    engine = BatchEngine(model, parallel=1)
    request = engine.submit(PROMPT, 3)
    assert len(list(request)) == 3
    assert within(lambda: list(request), 10) == []   # ended: a second reading ends at once

    async def read(r):
        return [t async for t in r]
    again = engine.submit(PROMPT, 3)
    assert len(asyncio.run(read(again))) == 3
    assert within(lambda: asyncio.run(read(again)), 10) == []
    failing = engine.submit(PROMPT, 3, constraint=RulesOutEverything())
    for _ in range(2):
        assert isinstance(within(lambda: list(failing), 10), ValueError)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(PROMPT, 3)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_many(PROMPT, 3, [None, None])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, "greedy", 0.7])
def test_sampling_that_is_not_sampling_params_is_named(tiny_model_dir, sampling):
    from fastllm.serve.serving import BatchEngine
    model = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1, n_ctx=64)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        model.generate_tokens(PROMPT, 3, sampling)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        generate_tokens_batch(model, [PROMPT], 3, sampling)
    engine = BatchEngine(model, parallel=1)
    try:
        with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
            engine.submit(PROMPT, 3, sampling)
        assert engine.queue_depth == 0 and engine.active == 0
    finally:
        engine.close()
