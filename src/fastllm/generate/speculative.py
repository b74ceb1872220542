"""Speculative decoding that cannot change the text.

Decoding a token reads every weight once; a pass over k+1 tokens reads them
once too. So a drafter guesses the next k tokens, the model runs the last
token and the guesses in one pass (Session.verify), and the sampler picks
each next token from those logits exactly as plain decoding would, keeping
the guesses while they agree with its picks. The first disagreement is the
sampler's own token; what the pass ran past it is undone (Session.keep:
a KV cache forgets the positions, a recurrent state is rolled back). Since
fastllm's logits are the same bits however tokens are split into passes,
and a draw depends only on (seed, position) (sampling.uniform_at), the text
is the one plain decoding gives, greedy or sampled, token for token.

Drafters:
- NgramDrafter: the continuation of the longest earlier match of the
  text's last tokens, in the prompt or the reply (no second model): code
  edits, summaries, answers that quote their input.
- DraftModel: a smaller model with the same vocabulary, decoding greedily.
- MtpDrafter: the model's own multi-token-prediction block (Qwen3.5's MTP
  layer), which reads the model's last hidden state and the token it chose.

DraftPolicy chooses how many tokens to draft from the acceptance seen so
far and the measured cost of passes of each size, and drafts nothing when
guesses keep failing (trying again now and then), so that speculation
costs little where it does not pay.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
from .session import extend_together
from ..core import _core


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int) -> list:
        """Up to k tokens that may follow tokens (the sequence so far, its
        last token not yet run by the model); fewer, or none, when it has
        no good guess."""


class NgramDrafter:
    """Guesses from the sequence itself: finds the earlier place where the
    longest suffix of the tokens (at least n_min, at most n_max tokens)
    occurred last, and proposes what followed it there.

    Occurrences of every n_min-gram are indexed as tokens come (once per
    token, whatever the length of the sequence); each lookup extends at
    most `candidates` of the latest ones backwards to measure their match.
    A longer match is preferred to a later one: a rewrite of a function
    repeats short phrases everywhere, but its long runs come from the one
    place being copied."""

    def __init__(self, n_min: int = 2, n_max: int = 16, candidates: int = 32):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max, self.candidates = n_min, n_max, candidates
        self._seen: list = []             # the tokens indexed so far
        self._at: dict = {}               # n_min-gram -> end positions, oldest first

    def _index(self, tokens: Sequence[int]):
        """Bring the index up to tokens (a sequence that may have changed
        anywhere: then it is rebuilt from where they part)."""
        seen, n = self._seen, self.n_min
        common = 0
        limit = min(len(seen), len(tokens))
        if limit and seen[limit - 1] == tokens[limit - 1] and seen[:limit] == list(tokens[:limit]):
            common = limit
        else:
            while common < limit and seen[common] == tokens[common]:
                common += 1
        if common < len(seen):   # forget the n-grams that end past common
            for end in range(len(seen), max(common, n - 1), -1):
                key = tuple(seen[end - n:end])
                ends = self._at.get(key)
                if ends and ends[-1] == end:
                    ends.pop()
                    if not ends:
                        del self._at[key]
            del seen[common:]
        for end in range(len(seen) + 1, len(tokens) + 1):
            seen.append(tokens[end - 1])
            if end >= n:
                self._at.setdefault(tuple(seen[end - n:end]), []).append(end)

    def propose(self, tokens: Sequence[int], k: int) -> list:
        if k <= 0 or len(tokens) < self.n_min + 1:
            return []
        self._index(tokens)
        seen, n, last = self._seen, self.n_min, len(tokens)
        ends = self._at.get(tuple(seen[last - n:last]), ())
        best_len, best_end = 0, 0
        checked = 0
        for end in reversed(ends):
            if end >= last:
                continue   # the suffix itself
            if checked == self.candidates:
                break
            checked += 1
            m = n
            while m < self.n_max and end - m > 0 and seen[end - m - 1] == seen[last - m - 1]:
                m += 1
            if m > best_len:
                best_len, best_end = m, end
                if m == self.n_max:
                    break
        if not best_len:
            return []
        return seen[best_end:min(best_end + k, last)]


class DraftModel:
    """Guesses with a smaller model of the same vocabulary: k greedy steps
    on a session of its own, which keeps what it has run (its KV cache,
    or for recurrent layers a saved state) so that each proposal runs only
    the tokens accepted since the last one, and then its k guesses."""

    def __init__(self, model, target=None):
        if target is not None:
            check_same_vocabulary(model, target)
        self.model = model
        # Guesses are ids of the target's vocabulary (a draft's head may have more rows).
        self.vocab_size = min(model.config.vocab_size, (target or model).config.vocab_size)
        self.session = model.new_session()
        self._saved = None   # the recurrent state before the last guesses

    def propose(self, tokens: Sequence[int], k: int) -> list:
        return draft_together([(self, tokens, k)])[0]

    def _catch_up(self, tokens: Sequence[int]) -> np.ndarray:
        """Run what the session lacks of tokens (going back where it ran
        past them): the logits after them."""
        s = self.session
        held = s.tokens
        common = 0
        for a, b in zip(held, tokens):
            if a != b:
                break
            common += 1
        if common < len(held) and not s.can_rewind_to(common):
            if self._saved is not None and len(self._saved[0]) <= common:
                s.restore_recurrent(self._saved)
            else:
                s.reset()
        elif common < len(held):
            s.rewind(common)
        if s.position == len(tokens):   # it holds them all; their last logits are gone
            if s.can_rewind_to(len(tokens) - 1):
                s.rewind(len(tokens) - 1)
            else:
                s.reset()
        logits = s.extend(list(tokens[s.position:]))
        self._saved = s.save_recurrent() if not s.can_rewind else None
        return logits


def draft_together(jobs) -> list:
    """The guesses of several DraftModels of one draft model, jobs being
    (drafter, tokens, k): each catches up with its tokens, then each greedy
    step runs every drafter still guessing in one pass over the draft
    model's weights (a server's requests draft together)."""
    out = [[] for _ in jobs]
    logits = {i: d._catch_up(tokens) for i, (d, tokens, k) in enumerate(jobs)
              if k > 0 and len(tokens) + k <= d.session.n_ctx}
    while logits:
        live = []
        for i, row in logits.items():
            token = int(np.argmax(row))
            if token >= jobs[i][0].vocab_size:
                continue   # a row past the tokenizer's (padding): no guess, and no more
            out[i].append(token)
            if len(out[i]) < jobs[i][2]:
                live.append(i)
        if not live:
            break
        rows = extend_together([jobs[i][0].session for i in live], [[out[i][-1]] for i in live])
        logits = dict(zip(live, rows))
    return out


class MtpDrafter:
    """Guesses with the model's multi-token-prediction block: the pair (h_q,
    x_{q+1}) of the model's final-normed hidden state at position q and the
    token after it goes through the block at position q (its own KV cache),
    whose logits guess x_{q+2}; further guesses chain the block's own
    output hidden state with its last guess, as llama.cpp's draft-mtp does.

    The generation loop hands it the hidden states of the positions the
    model runs (observe); each proposal first runs the pairs whose second
    token has come since, then k greedy steps. Positions whose hidden state
    it never saw (a prefix another call left in the session) keep what its
    cache held: guesses suffer, never the text."""
    wants_hidden = True

    def __init__(self, model):
        if model._mtp is None:
            raise ValueError(f"{model.name} has no multi-token-prediction block to draft with (a Qwen3.5 "
                             "GGUF file converted with it, without --no-mtp, has one)")
        self._core = _core
        self.state = _core.State(model._mtp, model.max_batch)
        self.n_ctx = model.n_ctx
        self._pairs = []     # x_{q+1} of the pairs the block's cache holds at positions q
        self._h = None       # the model's hidden states not yet paired, from position _h_start
        self._h_start = 0

    def observe(self, start: int, rows: np.ndarray):
        """The model ran positions start .. start+len(rows)-1 (and keeps them):
        their final-normed hidden states."""
        if self._h is not None and self._h_start <= start <= self._h_start + len(self._h):
            self._h = np.concatenate([self._h[:start - self._h_start], rows])
        else:
            self._h, self._h_start = np.asarray(rows, np.float32), start

    def propose(self, tokens: Sequence[int], k: int) -> list:
        p = len(tokens) - 2     # the model has run positions .. p; tokens[p + 1] is its newest choice
        if k <= 0 or p < 0 or self._h is None or not self._h_start <= p < self._h_start + len(self._h):
            return []
        common = 0
        for a, b in zip(self._pairs, tokens[1:]):
            if a != b:
                break
            common += 1
        first = max(min(common, p), self._h_start)
        ids = np.asarray(tokens[first + 1:p + 2], np.int32)
        h = self._h[first - self._h_start:p + 1 - self._h_start]
        logits, out = self.state.run(ids, first, False, False, False, True, h)
        self._pairs = list(tokens[1:p + 2])
        self._h, self._h_start = self._h[p + 1 - self._h_start:], p + 1
        guesses = []
        for i in range(k):
            guesses.append(int(np.argmax(logits)))
            at = p + 1 + i
            if i + 1 == k or at + 1 >= self.n_ctx:
                break
            logits, out = self.state.run(np.asarray(guesses[-1:], np.int32), at, False, False, False, True,
                                         out[-1:])
        return guesses


def check_same_vocabulary(draft, target):
    """ValueError unless draft's tokenizer gives every token the id
    target's does (the embedding rows past the tokenizer may differ: some
    checkpoints pad them), naming the first token that differs."""
    a, b = draft.tokenizer, target.tokenizer
    if a is None or b is None:
        raise ValueError("a draft model and its target both need their tokenizers, to check that "
                         "they share one vocabulary")
    va, vb = a.get_vocab(), b.get_vocab()
    for token, i in sorted(vb.items(), key=lambda kv: kv[1]):
        if va.get(token) != i:
            j = va.get(token)
            raise ValueError(f"the draft model's vocabulary differs from the target's: token {token!r} "
                             f"is id {i} in the target's and "
                             f"{'missing' if j is None else f'id {j}'} in the draft's")
    extra = sorted(set(va.items()) - set(vb.items()), key=lambda kv: kv[1])
    if extra:
        token, i = extra[0]
        raise ValueError(f"the draft model's vocabulary differs from the target's: token {token!r} "
                         f"(id {i} in the draft's) is not in the target's")


@dataclass
class DraftPolicy:
    """How many tokens to draft before each pass.

    Acceptance is modelled as geometric: each guess is right with
    probability alpha, estimated from decayed counts of guesses kept and
    refused, so k guesses give (1 - alpha^(k+1)) / (1 - alpha) tokens a
    pass (the last one the sampler's own). A pass of n tokens costs
    cost(n), a line fitted to the measured times of the passes run (plain
    steps are passes of 1); a draft model's time per guess is added. The
    length chosen maximises tokens per second; 0 means a plain step. After
    a run of plain steps chosen so, one short draft probes whether guesses
    have become right again, at gaps that double while they stay wrong."""
    max_draft: int = 16
    decay: float = 0.9
    kept: float = 1.0          # decayed counts: guesses kept, refused
    refused: float = 1.0
    _times: dict = field(default_factory=dict)   # pass size -> (decayed seconds, decayed count)
    _line: tuple | None = None                    # cost()'s fit, until the next time measured
    _guess_seconds: float = 0.0                   # decayed per-guess seconds of a draft model
    _gap: int = 4
    _plain: int = 0

    def length(self) -> int:
        if self.max_draft <= 0:
            return 0
        alpha = self.kept / (self.kept + self.refused)
        base = self.cost(1)
        best, best_rate = 0, 1.0 / base
        for k in range(1, self.max_draft + 1):
            tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
            rate = tokens / (self.cost(k + 1) + k * self._guess_seconds)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0:
            self._plain += 1
            if self._plain >= self._gap:
                self._plain = 0
                self._gap = min(self._gap * 2, 256)
                return 1
        return best

    def cost(self, n: int) -> float:
        """Seconds of a pass of n tokens: the line through the measured
        sizes (least squares, weighted by their counts), or before two sizes
        are known, one step plus a tenth of a step per extra token."""
        if self._line is None:
            self._line = self._fit()
        one, slope = self._line
        return max(one + slope * (n - 1), 1e-9)

    def _fit(self) -> tuple:
        """(cost of 1 token, cost of each more) from the measured passes."""
        pts = [(size, t / c, c) for size, (t, c) in self._times.items() if c > 0]
        if not pts:
            return 1.0, 0.1
        if len(pts) == 1:
            size, t, _ = pts[0]
            one = t / (1 + 0.1 * (size - 1))
            return one, 0.1 * one
        w = sum(c for _, _, c in pts)
        xm = sum(c * x for x, _, c in pts) / w
        ym = sum(c * y for _, y, c in pts) / w
        var = sum(c * (x - xm) ** 2 for x, _, c in pts)
        slope = max(sum(c * (x - xm) * (y - ym) for x, y, c in pts) / var, 0.0) if var > 0 else 0.0
        return ym + slope * (1 - xm), slope

    def timed(self, n: int, seconds: float):
        t, c = self._times.get(n, (0.0, 0.0))
        self._times[n] = (t * self.decay + seconds, c * self.decay + 1.0)
        self._line = None

    def guessed(self, n: int, seconds: float):
        """A draft model took seconds to guess n tokens."""
        if n > 0:
            self._guess_seconds = 0.8 * self._guess_seconds + 0.2 * seconds / n

    def outcome(self, drafted: int, kept: int):
        self.kept = self.kept * self.decay ** drafted + kept
        self.refused = self.refused * self.decay ** drafted + (kept < drafted)
        if kept:
            self._gap, self._plain = 4, 0


@dataclass
class SpecStats:
    """Tokens drafted and kept, and passes run, over a generation."""
    drafted: int = 0
    accepted: int = 0
    passes: int = 0
    plain_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Speculation:
    """A drafter and the policy that sizes its drafts, for one generation
    at a time (its drafter keeps state: make one per concurrent stream,
    or let Model make them from a spec: see speculation())."""

    def __init__(self, drafter: Drafter, max_draft: int = 16):
        if not 0 <= max_draft <= 64:
            raise ValueError(f"max_draft must be from 0 to 64, got {max_draft}")
        self.drafter = drafter
        self.policy = DraftPolicy(max_draft)
        self.stats = SpecStats()

    def plan(self, limit: int) -> int:
        """How many guesses to draft now: what the policy chooses, at most limit."""
        return max(min(self.policy.length(), limit), 0)

    def draft(self, tokens: Sequence[int], limit: int) -> list:
        """The guesses for after tokens: at most limit of them."""
        k = self.plan(limit)
        if k <= 0:
            return []
        t0 = time.perf_counter()
        out = list(self.drafter.propose(tokens, k))[:k]
        if isinstance(self.drafter, (DraftModel, MtpDrafter)):
            self.policy.guessed(len(out), time.perf_counter() - t0)
        return out

    def verified(self, drafted: int, kept: int, seconds: float):
        self.policy.timed(drafted + 1, seconds)
        self.policy.outcome(drafted, kept)
        self.stats.drafted += drafted
        self.stats.accepted += kept
        self.stats.passes += 1

    def plain_step(self, seconds: float):
        self.policy.timed(1, seconds)
        self.stats.plain_steps += 1


SPEC_KINDS = ("ngram", "mtp")


def speculation(spec, target, max_draft: int = 16, drafters: dict | None = None) -> Speculation | None:
    """A Speculation from what a caller passes as speculative=: None or
    False (none), "ngram", "mtp" (the target's multi-token-prediction
    block), a draft Model (same vocabulary as target), or a Speculation
    (used as it is). drafters: where to keep the drafter for the next call
    on the same sequence (a draft model's session then reuses what it ran)."""
    if spec is None or spec is False:
        return None
    if isinstance(spec, Speculation):
        return spec
    if spec == "ngram":
        make = NgramDrafter
    elif spec == "mtp":
        make = lambda: MtpDrafter(target)   # noqa: E731
    elif hasattr(spec, "new_session") and hasattr(spec, "tokenizer"):
        make = lambda: DraftModel(spec, target)   # noqa: E731
    else:
        raise ValueError(f"speculative must be None, 'ngram', 'mtp', a draft Model or a Speculation, "
                         f"got {spec!r}")
    if drafters is None:
        return Speculation(make(), max_draft)
    key = spec if isinstance(spec, str) else id(spec)
    if key not in drafters:
        drafters[key] = make()
    return Speculation(drafters[key], max_draft)
