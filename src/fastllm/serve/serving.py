"""Continuous batching: many requests on one model, each step one pass over
the weights for all of them.

A BatchEngine keeps `parallel` sessions (slots) and a bounded queue of
waiting requests. Its thread runs steps: requests join free slots between
steps, a prompt is prefilled in chunks beside the other requests' decoding
tokens, and every request's tokens go to its own queue as they come. A
request's tokens are exactly those of Model.generate_tokens alone, whatever
runs beside it (sessions run together give the same bits as alone, and each
request samples from its own generator).

With speculation (speculative="ngram" or a draft Model), a decoding request
feeds its last token and its guesses (fastllm.generate.speculative) in the same pass
as the other requests' tokens, and keeps the guesses its sampler takes: its
tokens are still exactly those of generating alone.

The engine thread outlives any request: an error while admitting,
running or sampling one request ends that request (its `error` says why,
and iterating it raises it), and the others go on.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ..core import _core
from ..spec.end_of_generation import finish_reason
from ..generate.sampling import Constraint, Sampler, SamplingParams, _whole, as_params
from ..generate.session import extend_together
from ..generate.speculative import (DraftModel, NgramDrafter, Speculation, check_same_vocabulary,
                                    draft_together)
from .prompt_cache import PromptCache


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full: try again later."""


@dataclass(eq=False)
class Request:
    """One generation: its prompt and settings, and (filled by the engine)
    its tokens as they come. Iterate it for the tokens; cancel() frees its
    slot at the next step."""
    prompt_ids: list
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: set
    top_logprobs: int | None = None   # with a number, logprobs gets one entry per token
    draft_max: int | None = None      # guesses a pass at most (None: the engine's; 0: no speculation)
    sampler: Sampler | None = field(default=None, repr=False)   # built by submit
    # A request of the same prompt submitted with this one (n choices): this
    # one copies its prompt's keys/values once that one has run the prompt.
    leader: "Request | None" = field(default=None, repr=False)
    generated: int = 0            # tokens given so far
    finish_reason: str = ""       # "stop", "length", "context", "cancelled" or "error"
    error: BaseException | None = None   # what ended it, with finish_reason "error"
    prompt_reused: int = 0        # prompt tokens whose keys/values a slot already held
    drafted: int = 0              # speculation: guesses run, and guesses kept
    accepted: int = 0
    # With a number, the prompt is scored as it runs (an echo of it, with
    # logprobs): prompt_logprob_entries gets, for every prompt token after
    # the first, the entry logprobs would have were it generated.
    prompt_logprobs: int | None = None
    prompt_logprob_entries: list = field(default_factory=list)
    # With top_logprobs, a request that an end-of-sequence token stopped:
    # (that token, its logprobs entry); it is not one of the tokens given.
    stop_logprobs: tuple | None = None
    # Per token, when top_logprobs is set: (its log-probability, [(id, log-probability)
    # of the top_logprobs most likely]), from the model's own distribution.
    logprobs: list = field(default_factory=list)
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None  # when the first token came (time.monotonic)
    _out: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    _wake: object = field(default=None, repr=False)   # set by an async reader

    def cancel(self):
        self._cancelled.set()

    def _put(self, token):
        """From the engine thread: a token, or None at the end."""
        self._out.put(token)
        wake = self._wake
        if wake is not None:
            try:
                wake()
            except RuntimeError:   # the reader's event loop has closed
                pass

    def __iter__(self):
        while (token := self._out.get()) is not None:
            yield token
        self._out.put(None)   # the end stays: reading again ends at once
        self._raise()

    def _raise(self):
        if self.error is not None:
            raise self.error

    async def __aiter__(self):
        """The tokens in an asyncio program: the engine wakes the event loop
        for each token, and no thread waits meanwhile."""
        import asyncio   # here: a script that never serves need not load asyncio (and ssl) at all
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        self._wake = lambda: loop.call_soon_threadsafe(ready.set)
        try:
            while True:
                try:
                    token = self._out.get_nowait()
                except queue.Empty:
                    await ready.wait()
                    ready.clear()
                    continue
                if token is None:
                    self._out.put(None)
                    self._raise()
                    return
                yield token
        finally:
            self._wake = None


@dataclass(eq=False)
class _Running:
    request: Request
    session: object
    sampler: Sampler
    fed: int = 0          # prompt tokens run so far
    last: int | None = None   # the token to run next, once the prompt is in
    branch: int = 0       # where its prompt parts from the longest sequence known (a checkpoint goes there)
    spec: Speculation | None = None   # its guesses' drafter and policy
    guesses: list = field(default_factory=list)   # the guesses of the pass being run
    leader: "_Running | None" = None   # waits for it to run the prompt (see Request.leader)
    followers: list = field(default_factory=list)   # those waiting for this one


class BatchEngine:
    """Serve requests on model with `parallel` slots and at most max_queue
    waiting requests. prefill_chunk bounds the prompt tokens one step runs
    for one request, so that decoding streams keep flowing while a long
    prompt comes in."""

    def __init__(self, model, parallel: int = 4, max_queue: int = 64, prefill_chunk: int = 128,
                 speculative=None, draft_max: int = 16, cache_bytes: int = 0, checkpoints: int = 8,
                 cache_dir=None, cache_disk_bytes: int = 8 << 30):
        if parallel < 1 or max_queue < 1 or prefill_chunk < 1:
            raise ValueError("parallel, max_queue and prefill_chunk must be positive")
        if not 0 <= draft_max <= 64:
            raise ValueError(f"draft_max must be from 0 to 64, got {draft_max!r}")
        if speculative == "mtp":
            raise ValueError("the batch engine speculates with n-gram lookup or a draft model; a model's "
                             "multi-token-prediction block drafts in Model.generate only")
        if speculative not in (None, "ngram") and not hasattr(speculative, "new_session"):
            raise ValueError(f"speculative must be None, 'ngram' or a draft Model, got {speculative!r}")
        if hasattr(speculative, "new_session"):
            check_same_vocabulary(speculative, model)
        self.model = model
        # Guesses a pass: at most draft_max, and one prefill chunk with the last token.
        self.speculative = speculative
        self.draft_max = min(draft_max, prefill_chunk - 1) if speculative is not None else 0
        self.drafted = self.accepted = 0   # totals, for /metrics
        self._drafters = {}   # a slot's draft model session, kept with the slot
        # The slots hold caches only (their KV pages cost memory as they
        # fill); every step runs in the one work session's buffers.
        self._work = model.new_session(parallel * prefill_chunk)
        self._free = [model.new_session(1) for _ in range(parallel)]
        for slot in self._free:
            slot.max_checkpoints = checkpoints
        # What the slots held, kept beyond them in RAM (cache_bytes) and in
        # files under cache_dir (see PromptCache); None: off.
        self.cache = (PromptCache(model, cache_bytes, cache_dir, cache_disk_bytes)
                      if cache_bytes > 0 or cache_dir is not None else None)
        self._running: list[_Running] = []
        self._waiting: queue.Queue = queue.Queue(max_queue)
        self.prefill_chunk = prefill_chunk
        self._wake = threading.Event()
        self._submitting = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="fastllm-batch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ clients

    def submit(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
               stop_ids=None, top_logprobs: int | None = None,
               constraint: Constraint | None = None, draft_max: int | None = None) -> Request:
        """Queue a generation; QueueFull when no slot and no queue place is
        free. Everything is checked here, on the caller's thread, so a bad
        request raises (ValueError) rather than reaching the engine.
        constraint: constrained decoding (see sampling.Constraint); the
        request ends with "stop" once constraint.done. draft_max: at most
        this many guesses a pass for this request (0: no speculation)."""
        return self.submit_many(prompt_ids, max_new_tokens, [sampling], stop_ids, top_logprobs,
                                [constraint], draft_max)[0]

    def submit_many(self, prompt_ids, max_new_tokens: int, samplings, stop_ids=None,
                    top_logprobs: int | None = None, constraints=None, draft_max: int | None = None) -> list:
        """Queue one generation of the same prompt per entry of samplings
        (several choices of one request), all or none; the prompt is run
        once and its keys/values copied to the others where they run at once."""
        return self._queue(self._requests(prompt_ids, max_new_tokens, samplings, stop_ids, top_logprobs,
                                          constraints, draft_max))

    def submit_prompts(self, prompts, max_new_tokens: int, samplings, stop_ids=None,
                       top_logprobs: int | None = None, constraints=None, draft_max: int | None = None,
                       prompt_logprobs: int | None = None) -> list:
        """submit_many for each of several prompts (constraints: one per
        choice of each, prompt after prompt), all of them or none.
        prompt_logprobs: score every prompt as it runs (see Request)."""
        if prompt_logprobs is not None and (not _whole(prompt_logprobs) or prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be a whole number >= 0, got {prompt_logprobs!r}")
        n = len(samplings)
        constraints = list(constraints or [None] * (n * len(prompts)))
        if len(constraints) != n * len(prompts):
            raise ValueError("submit_prompts takes one constraint per choice of every prompt")
        requests = [r for k, prompt in enumerate(prompts) for r in self._requests(
            prompt, max_new_tokens, samplings, stop_ids, top_logprobs, constraints[k * n:(k + 1) * n],
            draft_max)]
        for request in requests:
            request.prompt_logprobs = prompt_logprobs
        return self._queue(requests)

    def _requests(self, prompt_ids, max_new_tokens, samplings, stop_ids, top_logprobs, constraints,
                  draft_max) -> list:
        """The checked Requests of submit_many, not yet queued."""
        ids = _core.check_token_ids(prompt_ids, self.model.config.vocab_size).tolist()
        if len(ids) >= self.model.n_ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens: no room left in the context of "
                             f"{self.model.n_ctx}")
        if not _whole(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        if top_logprobs is not None and (not _whole(top_logprobs) or top_logprobs < 0):
            raise ValueError(f"top_logprobs must be a whole number >= 0, got {top_logprobs!r}")
        if draft_max is not None and (not _whole(draft_max) or not 0 <= draft_max <= 64):
            raise ValueError(f"speculative.n_max must be a whole number from 0 to 64, got {draft_max!r}")
        constraints = list(constraints or [None] * len(samplings))
        if not samplings or len(constraints) != len(samplings):
            raise ValueError("submit_many takes one sampling (and constraint) per choice")
        stops = self.model.eos_token_ids if stop_ids is None else set(stop_ids)
        max_new_tokens = int(max_new_tokens)
        requests, leader = [], None
        for sampling, constraint in zip(samplings, constraints):
            sampling = as_params(sampling).check_vocabulary(self.model.config.vocab_size)
            request = Request(ids, max_new_tokens, sampling, stops, top_logprobs, draft_max,
                              Sampler(sampling, constraint=constraint), leader)
            leader = leader or request
            requests.append(request)
        return requests

    def _queue(self, requests) -> list:
        with self._submitting:   # all of them or none
            if self._stop:
                raise RuntimeError("this BatchEngine is closed: it takes no more requests")
            if self._waiting.maxsize - self._waiting.qsize() < len(requests):
                raise QueueFull("every slot is busy and the queue is full")
            for request in requests:
                self._waiting.put_nowait(request)
        self._wake.set()
        return requests

    @property
    def max_queue(self) -> int:
        """Requests that may wait for a slot."""
        return self._waiting.maxsize

    @property
    def alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread.is_alive() and not self._stop

    @property
    def queue_depth(self) -> int:
        return self._waiting.qsize()

    @property
    def active(self) -> int:
        return len(self._running)

    def close(self):
        """Stop the engine thread; running requests end as cancelled, and
        submitting more is a RuntimeError."""
        with self._submitting:   # a request queued from now on would never be served
            self._stop = True
        self._wake.set()
        self._thread.join()
        if self.cache is not None and self.cache.disk is not None:
            # what the slots hold goes into the files too: a server started
            # later resumes the conversations they held
            for slot in self._free:
                try:
                    if slot.position >= PromptCache.MIN_TOKENS:
                        self.cache.save(slot)
                except (RuntimeError, ValueError):   # a slot left taken by an interrupted call
                    pass
            self.cache.close()

    # ------------------------------------------------------------- engine

    def _admit(self):
        """Move waiting requests into free slots, each into the slot that
        already holds the longest prefix of its prompt."""
        while self._free and not self._waiting.empty():
            request = self._waiting.get_nowait()
            if request._cancelled.is_set():
                self._finish_waiting(request)
                continue
            slot = max(self._free, key=lambda s: s.reusable(request.prompt_ids))
            self._free.remove(slot)
            run = _Running(request, slot, request.sampler, spec=self._speculation(slot, request))
            self._running.append(run)
            self._place_or_fail(run)

    def _place(self, run: _Running):
        """Give run's slot the longest prefix of its prompt that it, or
        another slot, holds, or have it wait for its leader to run the prompt."""
        request, slot = run.request, run.session
        leader = next((r for r in self._running if r.request is request.leader), None)
        if leader is not None and leader.fed < len(request.prompt_ids):
            run.leader = leader
            leader.followers.append(run)
            return
        prompt = request.prompt_ids
        # A prompt to score (echo with logprobs) runs whole: of a prefix
        # held no logits are left.
        scored = request.prompt_logprobs is not None
        keep = slot.reusable(prompt) if not scored else 0
        # Another slot, running or free, may hold more of the prompt (a
        # system prompt shared by many requests), or the prompt cache: copy
        # it over.
        others = [r.session for r in self._running if r is not run] + self._free
        donor = max(others, key=lambda s: s.reusable(prompt), default=None)
        donated = donor.reusable(prompt) if donor is not None and not scored else 0
        cached, from_cache = self.cache.best(prompt) if self.cache is not None and not scored else (None, 0)
        run.branch = max([s.shared(prompt) for s in others + [slot]] + [e.shared(prompt) for e in (
            self.cache._entries if self.cache is not None else ())])
        if self.cache is not None and slot.position - keep >= PromptCache.MIN_TOKENS:
            self.cache.save(slot)   # what this slot held beyond the prompt, before it is lost
        if from_cache > max(keep, donated):
            self.cache.touch(cached)
            slot.copy_prefix(cached, from_cache)
            keep = from_cache
        elif donated > keep:
            slot.copy_prefix(donor, donated)
            keep = donated
        elif scored:
            slot.reset()
        else:
            keep = slot.resume(prompt)
        request.prompt_reused = run.fed = keep

    def _speculation(self, slot, request) -> Speculation | None:
        """The request's drafter: n-gram lookup over its own tokens, or the
        draft model's session that belongs to its slot (which then keeps
        what it ran for the slot's next request)."""
        limit = self.draft_max if request.draft_max is None else min(request.draft_max, self.draft_max)
        if limit <= 0:
            return None
        if self.speculative == "ngram":
            return Speculation(NgramDrafter(), limit)
        drafter = self._drafters.get(id(slot))
        if drafter is None:
            drafter = self._drafters[id(slot)] = DraftModel(self.speculative, self.model)
        return Speculation(drafter, limit)

    def _finish_waiting(self, request):
        request.finish_reason = "cancelled"
        request._put(None)

    def _release(self, run: _Running, reason: str, error: BaseException | None = None):
        if run.leader is not None:
            run.leader.followers.remove(run)
            run.leader = None
        run.request.finish_reason = reason
        run.request.error = error
        run.request._put(None)
        self._running.remove(run)
        if error is None:
            try:   # where its reply ends: the next turn of the conversation resumes there
                run.session.checkpoint()
            except Exception:
                run.session.reset()
        self._free.append(run.session)
        followers, run.followers = run.followers, []
        for follower in followers:   # they run the prompt themselves
            follower.leader = None
            self._place_or_fail(follower)

    def _place_or_fail(self, run: _Running):
        """_place, or (a failure of this request alone) end run with the error."""
        try:
            self._place(run)
        except Exception as e:
            self._release(run, "error", e)

    def _step(self):
        """One pass: the next prompt chunk or the last token of every request."""
        for run in [r for r in self._running if r.request._cancelled.is_set()]:
            self._release(run, "cancelled")
        batch, feeds = [], []
        decoding = [r for r in self._running if r.leader is None and r.fed >= len(r.request.prompt_ids)]
        self._draft(decoding)
        for run in self._running:
            prompt = run.request.prompt_ids
            if run.leader is not None:
                continue   # it copies the prompt from its leader
            if run.fed < len(prompt):
                end = min(run.fed + self.prefill_chunk, len(prompt))
                end = next(p for p in run.session.cut_points(run.fed, len(prompt), run.branch) + [end]
                           if p <= end)
                feeds.append(prompt[run.fed:end])
            else:
                feeds.append([run.last] + run.guesses)
            batch.append(run)
        if not batch:
            return
        t0 = time.perf_counter()
        try:
            verify = [bool(r.guesses) for r in batch]
            scored = [self._scores(r) for r in batch]
            rows = extend_together([r.session for r in batch], feeds, self._work, verify, scored)
        except Exception as e:
            # A pass failed as a whole: what the slots hold is unknown, so
            # every request in it ends; the engine goes on with the next ones.
            for run in batch:
                run.guesses = []
                run.session.reset()
                self._release(run, "error", e)
            return
        seconds = time.perf_counter() - t0
        at = 0
        for run, fed, score in zip(batch, feeds, scored):
            request = run.request
            if run.fed < len(request.prompt_ids):
                n = len(fed) if score else 1
                if score:
                    self._score_prompt(request, run.fed, rows[at:at + n])
                logits = rows[at + n - 1]
                at += n
                run.fed += len(fed)
                if run.fed in run.session.cut_points(run.fed - len(fed), len(request.prompt_ids), run.branch):
                    run.session.checkpoint()
                if run.fed < len(request.prompt_ids):
                    continue   # more of the prompt to come
                followers, run.followers = run.followers, []
                for follower in followers:   # the same prompt: copied, not run again
                    self._follow(follower, run, logits)
                self._next_token(run, logits)
            else:
                n = len(run.guesses) + 1
                self._decode(run, rows[at:at + n], seconds)
                at += n

    def _draft(self, runs):
        """Each decoding run's guesses for after its last token: as many as
        its policy chooses, that fit its max_new_tokens, the context and a
        chunk. A draft model's requests guess together, each step one pass
        over its weights for all of them."""
        jobs = []
        for run in runs:
            run.guesses = []
            if run.spec is None:
                continue
            request, held = run.request, run.session.position
            room = min(request.max_new_tokens - request.generated - 1, self.model.n_ctx - 1 - held - 1,
                       _long_rope_room(run.session, held) - 1)
            tokens = run.session.tokens + (run.last,)
            try:
                if isinstance(run.spec.drafter, DraftModel):
                    k = run.spec.plan(room)
                    if k > 0:
                        jobs.append((run, tokens, k))
                elif room > 0:
                    run.guesses = run.spec.draft(tokens, room)
            except Exception:   # a drafter's failure costs the guesses, not the request
                run.spec = None
        if not jobs:
            return
        t0 = time.perf_counter()
        try:
            outs = draft_together([(run.spec.drafter, tokens, k) for run, tokens, k in jobs])
        except Exception:
            for run, _, _ in jobs:
                run.spec = None
            return
        seconds = (time.perf_counter() - t0) / len(jobs)
        for (run, _, _), out in zip(jobs, outs):
            run.guesses = out
            run.spec.policy.guessed(len(out), seconds)

    def _decode(self, run: _Running, rows, seconds: float):
        """Sample run's next tokens from the logits of its last token and of
        its guesses, keeping the guesses while the sampler takes them."""
        guesses, run.guesses = run.guesses, []
        start = run.session.position - len(rows)    # where its last token went
        tokens = list(run.session.tokens[:start + 1])
        taken = 0
        for j, logits in enumerate(rows):
            token = self._next_token(run, logits, tokens)
            if token is None or j == len(guesses) or token != guesses[j]:
                break
            tokens.append(token)
            taken += 1
        if guesses:
            run.spec.verified(len(guesses), taken, seconds)
            run.request.drafted += len(guesses)
            run.request.accepted += taken
            self.drafted += len(guesses)
            self.accepted += taken
            if run in self._running:   # (a finished one's slot holds what it ran: still a valid state)
                try:
                    run.session.keep(1 + taken, self._work)
                except Exception as e:
                    run.session.reset()
                    self._release(run, "error", e)
        elif run.spec is not None:
            run.spec.plain_step(seconds)

    @staticmethod
    def _scores(run: _Running) -> bool:
        """Whether run's next pass is a chunk of a prompt it scores (echo
        with logprobs): that pass gives the logits of every token of it."""
        return run.request.prompt_logprobs is not None and run.fed < len(run.request.prompt_ids)

    @staticmethod
    def _score_prompt(request: Request, start: int, logits):
        """The entries of the prompt tokens that logits (those after the
        prompt's tokens start, start+1, ...) predict."""
        targets = request.prompt_ids[start + 1:start + 1 + len(logits)]
        request.prompt_logprob_entries += _logprob_rows(logits[:len(targets)], targets,
                                                        request.prompt_logprobs)

    def _follow(self, run: _Running, leader: _Running, logits):
        """run takes leader's prompt keys/values and its last logits."""
        run.request.prompt_logprob_entries = leader.request.prompt_logprob_entries
        run.leader = None
        try:
            run.session.copy_prefix(leader.session, len(leader.request.prompt_ids))
        except Exception as e:
            self._release(run, "error", e)
            return
        run.request.prompt_reused = run.fed = len(run.request.prompt_ids)
        self._next_token(run, logits)

    def _next_token(self, run: _Running, logits, tokens=None) -> int | None:
        """Sample run's next token from logits and hand it out: the token,
        or None when run ended. tokens: the sequence so far (default: what
        its session holds)."""
        request = run.request
        if request.max_new_tokens <= 0:
            self._release(run, "length")
            return None
        try:
            token = run.sampler(logits, run.session.tokens if tokens is None else tokens)
            entry = _logprobs(logits, token, request.top_logprobs) \
                if request.top_logprobs is not None else None
        except Exception as e:   # a processor or constraint of this request failed
            self._release(run, "error", e)
            return None
        if token in request.stop_ids:
            if entry is not None:
                request.stop_logprobs = (token, entry)
            self._release(run, "stop")
            return None
        request.generated += 1
        if entry is not None:
            request.logprobs.append(entry)
        if request.first_token is None:
            request.first_token = time.monotonic()
        request._put(token)
        held = run.session.position if tokens is None else len(tokens)
        reason = finish_reason(held + 1, self.model.n_ctx, run.sampler, request.generated,
                               request.max_new_tokens)
        if reason is not None:
            self._release(run, reason)
            return None
        run.last = token
        return token

    def _loop(self):
        while not self._stop:
            try:
                self._admit()
                if not self._running:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._step()
            except Exception as e:   # a fault of the engine itself: fail what runs, go on
                for run in list(self._running):
                    run.session.reset()
                    self._release(run, "error", e)
        for run in list(self._running):
            self._release(run, "cancelled")
        while not self._waiting.empty():
            self._finish_waiting(self._waiting.get_nowait())


def _logprobs(logits, token: int, top: int):
    """log-softmax of the model's logits (before any sampling setting):
    the token's, and the top most likely tokens' with theirs."""
    x = logits.astype(np.float64)
    x -= x.max()
    x -= np.log(np.exp(x).sum())
    best = np.argsort(-x, kind="stable")[:top]
    return float(x[token]), [(int(i), float(x[i])) for i in best]


def _long_rope_room(session, held: int) -> int:
    """Session.pass_room's LongRoPE bound for a slot, whose passes run in
    the engine's work buffers rather than its own."""
    after = session._long_rope_after
    return after - held if after is not None and held < after else 1 << 30


def _logprob_rows(logits, tokens, top: int) -> list:
    """_logprobs of each row of logits and the token it gave, at once: the
    same numbers (each row's sums in the same order) at the cost of a few
    vector operations rather than a sort of the vocabulary per row."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    picked = x[np.arange(len(tokens)), tokens]
    if top == 0:
        return [(float(v), []) for v in picked]
    # the top entries in _logprobs' order, by logprob then by id: the
    # top-th largest of each row, and every id at least that likely
    top = min(top, x.shape[1])
    least = -np.partition(-x, top - 1, axis=1)[:, top - 1]
    out = []
    for row, token_lp, bar in zip(x, picked, least):
        ids = np.flatnonzero(row >= bar)
        best = sorted(ids.tolist(), key=lambda i: (-row[i], i))[:top]
        out.append((float(token_lp), [(i, float(row[i])) for i in best]))
    return out

