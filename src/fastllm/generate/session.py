"""Session: one sequence on a loaded model.

A Session owns the run state of one sequence (its KV cache, and the
recurrent state of Gated DeltaNet layers) and knows which tokens that state
holds. Sessions of one Model share its weights, so a program can keep one
per conversation, or per thread, and a server can multiplex them.
"""
from __future__ import annotations

import threading
from contextlib import ExitStack, contextmanager

import numpy as np

from ..core import _core
from ..spec.errors import ModelFileError
from ..spec.schema import LINEAR
from . import session_file


_IN_USE = ("this Session is in use by another thread: a Session serves one thread at a time "
           "(give each thread its own, model.new_session())")

# Recurrent states are saved (checkpoints) every this many tokens of a long
# prompt, and this many tokens before a prompt's end, where the next turn's
# rendering of a conversation may already differ (a chat template that
# renders the previous reply otherwise: Qwen3.5 drops its thinking).
CHECKPOINT_EVERY = 2048
CHECKPOINT_BEFORE_END = 4
# A session that goes back this many positions or more from the furthest
# it has written gives the cache pages past its new end back to the system
# (a slot that held a long conversation and now holds a short one).
RELEASE_AFTER = 1024


def common_prefix(a, b) -> int:
    """The length of the prefix two token sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Session:
    """One sequence's state on a Model, sharing the model's weights.

        session = model.new_session()
        logits = session.prefill(prompt_ids)   # reuses what it already holds
        logits = session.step(token)           # one more token

    Token ids are checked once, on the way in. A Session serves one thread
    at a time: give each thread its own. Using one from a second thread
    while it runs, or while a generation holds it, raises RuntimeError
    rather than mixing the two sequences. Layers with a recurrent state
    (Gated DeltaNet) cannot forget their last tokens, and sliding-window
    layers keep only their window and one pass (a ring), so a session of
    such a model cannot go back anywhere (can_rewind is False; see
    can_rewind_to: a ring goes back as far as it still holds the window
    before); instead it saves those states at a few positions (checkpoints:
    where a prompt ends and a reply ends, CHECKPOINT_BEFORE_END tokens
    before a prompt's end and every CHECKPOINT_EVERY tokens of a long one),
    at most max_checkpoints of them, and a prompt that shares only part of
    what it holds resumes from the nearest checkpoint inside the shared part.

    Interrupts: tokens go to C in chunks of max_batch, so Ctrl-C returns
    within one chunk. A KeyboardInterrupt can land after C has run a chunk
    and before the session has listed it; the chunk is therefore marked
    unsettled while it runs. The next call then keeps only what the state
    surely holds: an attention cache keeps the tokens listed (the unlisted
    positions are overwritten later), a recurrent state, which may have
    absorbed the chunk, starts afresh from position 0.
    """

    def __init__(self, model, max_batch: int | None = None):
        weights = self._weights = model._weights   # whose sessions may share keys and values with this one
        self._weight_files = getattr(model, "weight_files", None)   # what identifies them in a file
        self.max_batch = model.max_batch if max_batch is None else max_batch
        self._state = _core.State(weights, self.max_batch)
        self.vocab_size = weights.vocab_size
        self.n_ctx = weights.seq_len
        config = weights.config
        self._recurrent = any(config.layer_kind(i) == LINEAR for i in range(config.num_hidden_layers))
        # Rings (sliding-window layers that hold only their window and one
        # pass) can go back this many tokens from the furthest position
        # written, and passes then run at most one pass's tokens at a time.
        self._ring_room = self._state.rewind_room
        self.can_rewind = not self._recurrent and self._ring_room is None
        self._chunk = self.max_batch if self._ring_room is None else min(self.max_batch, weights.max_pass)
        self._touched = 0   # the furthest position written since pages were last given back
        self._written = 0   # rings: the furthest position written since the state started at 0,
        self._floor = 0     # and the first they surely hold (a checkpoint put back holds none before)
        # LongRoPE: past this many tokens a sequence is rotated with the long tables.
        self._long_rope_after = (config.rope_scaling["original_max_position_embeddings"]
                                 if config.longrope else None)
        self._tokens = []
        self.max_checkpoints = 8
        self._checkpoints = []   # (position, State.save_position there), by position
        # (start, n): the last pass ran n tokens from position start as a
        # draft (verify), and any prefix of them may still be kept.
        self._verified = None
        self._unsettled = False   # a chunk may have run without being listed
        self._guard = threading.Lock()  # guards _busy_by and _holder (see _use)
        self._busy_by = None            # (thread, call) while C runs this session
        self._holder = None             # the thread whose generation holds it (see held)
        self._hold = None               # and that generation's own mark

    @contextmanager
    def held(self):
        """Hold the session for one generation (a generator between its
        tokens): another thread's use, or a second generation, raises."""
        # The hold is taken inside the try, and given back only by the
        # generation that took it: a Ctrl-C that lands between taking it
        # and the yield (as _use gives the session back) must not leave the
        # session held by a generation that no longer exists.
        hold = object()
        try:
            with self._use():
                if self._holder is not None:
                    raise RuntimeError("this Session is already used by a generation that has not "
                                       "finished: finish or close it first, or use another session")
                self._holder, self._hold = threading.get_ident(), hold
            yield self
        finally:
            if self._hold is hold:
                self._holder = self._hold = None

    @contextmanager
    def _use(self):
        """The session for one call: RuntimeError if another thread runs it
        now or a generation of another thread holds it."""
        me = threading.get_ident()
        call = object()
        # The session is taken by setting _busy_by under a lock that is
        # only ever held in a `with` of a few lines: a Ctrl-C (or any
        # signal's exception) cannot leave that lock taken, while it can
        # cut off a call anywhere between taking the session and giving it
        # back. A session left taken by a call of this very thread, which
        # will never run again, is this thread's to take over, not another
        # thread's use.
        with self._guard:
            if self._busy_by is not None and self._busy_by[0] != me:
                raise RuntimeError(_IN_USE)
            if self._holder not in (None, me):
                raise RuntimeError(_IN_USE)
            self._busy_by = (me, call)
        try:
            yield
        finally:
            # only the latest call gives the session back: an abandoned one
            # closed later (by the garbage collector) must not free it
            with self._guard:
                if self._busy_by is not None and self._busy_by[1] is call:
                    self._busy_by = None

    def _settle(self):
        """After an interrupted run: keep only what the state surely holds."""
        if self._unsettled:
            if self._recurrent or len(self._tokens) < self._reach():
                self._tokens = []
                self._checkpoints = [c for c in self._checkpoints if c[0] <= len(self._tokens)]
            self._unsettled = False
            self._verified = None

    def _reach(self) -> int:
        """The first position the state can go back to without a checkpoint:
        any for plain attention caches, none before all it holds for
        recurrent states, and for rings the first whose window before they
        still hold."""
        if self._recurrent:
            return len(self._tokens)
        if self._ring_room is None:
            return 0
        return max(self._floor, self._written - self._ring_room)

    def _writes(self, start: int, n: int):
        """The state is about to write positions start .. start+n-1."""
        if start == 0:
            self._floor = self._written = 0
        self._written = max(self._written, start + n)
        self._touched = max(self._touched, start + n)

    def _give_back(self, n: int):
        """The state holds n positions from now on: where it had written
        RELEASE_AFTER or more past them, their cache pages go back to the
        system."""
        if self._touched - n >= RELEASE_AFTER:
            self._state.release(n)
            self._touched = n

    def can_rewind_to(self, position: int) -> bool:
        """Whether rewind(position) goes back without a checkpoint: always
        for plain attention caches, within a ring's reach, or (recurrent
        states) to all the session holds or to nothing."""
        self._settle()
        return position == 0 or self._reach() <= position <= len(self._tokens)

    @property
    def tokens(self) -> tuple:
        """The tokens whose keys/values (or recurrent state) the session holds."""
        self._settle()
        return tuple(self._tokens)

    @property
    def position(self) -> int:
        """Where the next token goes: the number of tokens held."""
        self._settle()
        return len(self._tokens)

    def check(self, token_ids) -> np.ndarray:
        """token_ids as an int32 array, once they are ids of the vocabulary
        that fit the context; else ValueError."""
        n = len(token_ids) if hasattr(token_ids, "__len__") else None
        ids = None if n is not None and n > self.n_ctx else _core.check_token_ids(token_ids, self.vocab_size)
        if ids is None or ids.size > self.n_ctx:   # refused before a long list is converted
            raise ValueError(f"{n if ids is None else ids.size} tokens do not fit the context of "
                             f"{self.n_ctx} (load the model with a larger n_ctx)")
        return ids

    def _run(self, ids: np.ndarray, all_logits=False, hidden_states=False, hidden=False):
        with self._use():
            return self._run_held(ids, all_logits, hidden_states, hidden)

    def _run_held(self, ids, all_logits, hidden_states, hidden=False):
        self._settle()
        self._match_rope(len(self._tokens) + ids.size)
        return self._run_chunks(ids, all_logits, hidden_states, hidden)

    def _match_rope(self, total: int):
        """LongRoPE rotates every position of a sequence with the short
        factors while it fits the original context, with the long ones once
        it is longer (so transformers computes a sequence of `total` tokens,
        and its generate() recomputes the cache at the crossing): the tokens
        held are run again whenever the choice changes."""
        if self._long_rope_after is None:
            return
        long = total > self._long_rope_after
        if long == self._state.rope_long:
            return
        held = np.asarray(self._tokens, np.int32)
        self._state.rope_long = long
        self._tokens = []
        if held.size:
            self._run_chunks(held, False, False)

    def _run_chunks(self, ids, all_logits, hidden_states, hidden=False):
        self._verified = None
        logits, traces, normed = [], [], []
        for start in range(0, ids.size, self._chunk):
            chunk = ids[start:start + self._chunk]
            self._unsettled = True
            self._writes(len(self._tokens), chunk.size)
            out = self._state.run(chunk, len(self._tokens), all_logits, hidden_states, hidden=hidden)
            self._tokens += chunk.tolist()
            self._unsettled = False
            if hidden_states:
                out, trace = out
                traces.append(trace)
            if hidden:
                out, rows = out
                normed.append(rows)
            logits.append(out)
        if not all_logits:
            logits = logits[-1:]
        out = logits[0] if len(logits) == 1 else np.concatenate(logits)
        if hidden_states:
            return out, traces[0] if len(traces) == 1 else np.concatenate(traces, axis=1)
        if hidden:
            return out, normed[0] if len(normed) == 1 else np.concatenate(normed)
        return out

    def shared(self, token_ids) -> int:
        """The length of the prefix token_ids share with the tokens held."""
        return common_prefix(self._tokens, token_ids)

    def reusable(self, token_ids) -> int:
        """How many of token_ids' first tokens a prefill would not run again:
        the prefix it shares with the tokens held, where the state can go
        back there (for a recurrent state only when token_ids extend all it
        holds, for a ring within its reach), else the nearest checkpoint
        inside the shared prefix; always one token less than them all (a
        prefill runs at least one, for the logits)."""
        self._settle()
        n = min(self.shared(token_ids), len(token_ids) - 1)
        if n >= self._reach():
            return n
        return max((p for p, _ in self._checkpoints if p <= n), default=0)

    def resume(self, token_ids) -> int:
        """Hold the first reusable(token_ids) tokens of token_ids (forgetting
        the rest, or going back to a checkpoint); returns how many."""
        with self._use():
            self._settle()
            n = self.reusable(token_ids)
            self._go_back(n)
            self._verified = None
            return n

    def _go_back(self, n: int):
        """Hold the first n tokens held: directly where the state reaches
        back there, else from the checkpoint at n (which must exist)."""
        if n == 0:
            self._floor = self._written = 0
        elif n < self._reach():
            self._state.restore_position(n, dict(self._checkpoints)[n])
            self._floor = self._written = n
        del self._tokens[n:]
        self._checkpoints = [c for c in self._checkpoints if c[0] <= n]
        self._give_back(n)

    def checkpoint(self):
        """Save what the session needs to come back where it is now (the
        recurrent states, the windows its rings hold; nothing for a model
        whose caches can go back anywhere), keeping the latest
        max_checkpoints."""
        with self._use():
            self._settle()
            p = len(self._tokens)
            if self.can_rewind or p == 0 or self.max_checkpoints <= 0:
                return
            kept = [c for c in self._checkpoints if c[0] != p] + [(p, self._state.save_position(p))]
            self._checkpoints = kept[-self.max_checkpoints:]

    @property
    def checkpoints(self) -> tuple:
        """The positions of the checkpoints saved (see checkpoint)."""
        return tuple(p for p, _ in self._checkpoints)

    @property
    def checkpoint_bytes(self) -> int:
        """Memory the checkpoints take."""
        return sum(states.nbytes for _, states in self._checkpoints)

    @property
    def memory_bytes(self) -> int:
        """Memory what the session holds takes: the keys and values of its
        positions, its recurrent states and checkpoints."""
        return self._state.kv_bytes(self.position) + self._state.recurrent_bytes + self.checkpoint_bytes

    def cut_points(self, start: int, end: int, branch: int = 0) -> list:
        """Where a prompt run from start to end stops to save a checkpoint
        (none for a model that can rewind), the end included. branch: where
        the prompt parts from a sequence known before (what the session
        held, another slot's): the next prompt that shares that much, such
        as another conversation under the same system prompt, resumes there
        (or a few tokens before: the next one may share a token less)."""
        if self.can_rewind or self.max_checkpoints <= 0:
            return []
        points = set(range((start // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY, end, CHECKPOINT_EVERY))
        points.update((end - CHECKPOINT_BEFORE_END, branch, branch - CHECKPOINT_BEFORE_END))
        return sorted(p for p in points if start < p < end) + [end]

    def prefill(self, token_ids, hidden: bool = False) -> np.ndarray:
        """Logits after token_ids, (vocab_size,) float32. What reusable()
        says is kept (the keys/values of the longest common prefix with the
        tokens held; for recurrent states, a checkpoint or all they hold),
        and the rest runs, saving checkpoints on the way (see Session).
        hidden: (logits, the final-normed hidden states of the tokens run,
        the last ones of token_ids)."""
        ids = self.check(token_ids)
        branch = self.shared(ids)
        start = self.resume(ids)
        cuts = self.cut_points(start, ids.size, branch)
        if not cuts:
            return self._run(ids[start:], hidden=hidden)
        outs = []
        for end in cuts:
            outs.append(self._run(ids[start:end], hidden=hidden))
            self.checkpoint()
            start = end
        if hidden:
            return outs[-1][0], np.concatenate([out[1] for out in outs])
        return outs[-1]

    def step(self, token: int, hidden: bool = False) -> np.ndarray:
        """Logits after one more token (hidden: and its final-normed hidden
        state, (1, dim))."""
        return self._run(_core.check_token_ids((token,), self.vocab_size), hidden=hidden)

    def extend(self, token_ids, all_logits: bool = False) -> np.ndarray:
        """Run token_ids after the tokens held: the logits of the last one,
        or of every one, shape (n, vocab_size), with all_logits."""
        return self._run(self.check(token_ids), all_logits)

    def logits(self, token_ids, hidden_states: bool = False):
        """Logits of every position of token_ids run from position 0, shape
        (n, vocab_size); with hidden_states also each layer's output,
        (n_layers, n, dim)."""
        ids = self.check(token_ids)
        self.reset()
        return self._run(ids, True, hidden_states)

    def hidden(self, token_ids) -> np.ndarray:
        """The final-normed hidden state of every position of token_ids run
        from position 0 (what the LM head reads, and what embedding models
        pool), shape (n, dim) float32."""
        ids = self.check(token_ids)
        self.reset()
        with self._use():
            self._match_rope(ids.size)
            out = []
            for start in range(0, ids.size, self.max_batch):
                chunk = ids[start:start + self.max_batch]
                self._unsettled = True
                out.append(self._state.hidden(chunk, len(self._tokens)))
                self._tokens += chunk.tolist()
                self._unsettled = False
        return out[0] if len(out) == 1 else np.concatenate(out)

    def pass_room(self) -> int:
        """The most tokens a verify() may run now: one pass of max_batch, and
        under LongRoPE, whose tables are those of the sequence's length,
        not past the original context when it starts within it (each
        token's logits would otherwise be those of a longer sequence)."""
        room = self._chunk
        position = self.position
        if self._long_rope_after is not None and position < self._long_rope_after:
            room = min(room, self._long_rope_after - position)
        return room

    def verify(self, token_ids, hidden: bool = False) -> np.ndarray:
        """Run token_ids after the tokens held, in one pass, as a draft to
        check (speculative decoding): the logits of every one, shape (n,
        vocab_size). keep() then holds only a prefix of them, recurrent
        layers included, bit for bit as if only that prefix had run.
        At most pass_room() tokens. hidden: (logits, final-normed hidden
        states), both (n, ...)."""
        ids = self.check(token_ids)
        if ids.size > self.pass_room():
            raise ValueError(f"a draft of {ids.size} tokens does not fit one pass of this session "
                             f"(at most {self.pass_room()} now)")
        with self._use():
            self._settle()
            self._match_rope(len(self._tokens) + ids.size)
            if self._recurrent:
                self._state.enable_rollback(ids.size)
            start = len(self._tokens)
            self._unsettled = True
            self._writes(start, ids.size)
            out = self._state.run(ids, start, True, False, True, hidden)
            self._tokens += ids.tolist()
            self._unsettled = False
            self._verified = (start, ids.size)
            return out

    def keep(self, n: int, work: "Session | None" = None):
        """Hold only the first n tokens of the last verify() (or of this
        session's part of the last extend_together with keep): what it
        holds is then exactly what running those n alone would have left.
        work: a session whose buffers hold n tokens, for a session whose
        own max_batch is smaller (a recurrent state's last n steps run
        again there)."""
        with self._use():
            self._settle()
            if self._verified is None or len(self._tokens) != sum(self._verified):
                raise ValueError("keep() follows a verify() pass: the session has run other tokens since")
            start, size = self._verified
            if not 0 <= n <= size:
                raise ValueError(f"the last pass ran {size} tokens: cannot keep {n}")
            if self._recurrent:
                self._state.rollback(n, None if work is None else work._state)
            del self._tokens[start + n:]
            self._verified = (start, n)
            self._match_rope(len(self._tokens))

    def save_recurrent(self):
        """What the session needs to come back where it is now besides its
        attention caches (recurrent states, the windows its rings hold; None
        where it needs nothing), and the tokens it holds: restore_recurrent
        returns the session there (any tokens held since are forgotten)."""
        with self._use():
            self._settle()
            return tuple(self._tokens), self._state.save_position(len(self._tokens))

    def restore_recurrent(self, saved):
        tokens, states = saved
        with self._use():
            self._settle()
            if tuple(self._tokens[:len(tokens)]) != tokens:
                raise ValueError("the session no longer holds the tokens it held when saved")
            self._state.restore_position(len(tokens), states)
            if not self.can_rewind:
                self._floor = self._written = len(tokens)
            del self._tokens[len(tokens):]
            self._checkpoints = [c for c in self._checkpoints if c[0] <= len(tokens)]
            self._verified = None

    def rewind(self, position: int):
        """Forget the tokens from position on."""
        with self._use():
            self._rewind(position)

    def _rewind(self, position: int):
        self._settle()
        if not 0 <= position <= len(self._tokens):
            raise ValueError(f"cannot rewind to {position}: the session holds {len(self._tokens)} tokens")
        if position < self._reach() and position != 0 and position not in self.checkpoints:
            what = ("this model's recurrent layers cannot forget their last tokens" if self._recurrent else
                    f"this model's sliding-window layers hold only their window: the session can go back "
                    f"to position {self._reach()} at the earliest")
            raise ValueError(f"{what}: reset() the session instead, or rewind to a checkpoint "
                             f"({', '.join(map(str, self.checkpoints)) or 'none saved'})")
        self._go_back(position)

    def reset(self):
        """Forget every token: the next one goes to position 0."""
        self.rewind(0)

    def copy_prefix(self, other: "Session", n: int):
        """Hold other's first n tokens, copied rather than run again (a
        shared system prompt is then prefilled once). A recurrent state holds
        all it has seen, so with Gated DeltaNet layers n must be all of
        other's tokens or one of its checkpoints (whose states come along
        with the keys and values; so do its checkpoints up to n)."""
        if other._weights is not self._weights:
            raise ValueError("the other session belongs to another model: keys and values are copied "
                             "between sessions of one model")
        if not 0 <= n <= other.position:
            raise ValueError(f"the other session holds {other.position} tokens, not {n}")
        direct = n >= other._reach()
        if not direct and n not in other.checkpoints:
            raise ValueError("a recurrent state can only be copied whole, or at a checkpoint" if other._recurrent
                             else f"the other session's sliding-window layers hold only their window: it can "
                                  f"be copied from position {other._reach()} on, or at a checkpoint")
        with self._use():
            self._state.copy_from(other._state, n, direct and n == other.position)
            if direct:
                self._written, self._floor = other._written, other._floor
            else:
                self._state.restore_position(n, dict(other._checkpoints)[n])
                self._written = self._floor = n
        self._tokens = list(other.tokens[:n])
        self._checkpoints = [c for c in other._checkpoints if c[0] <= n]
        self._unsettled = False
        self._verified = None
        self._touched = max(self._touched, n)
        self._give_back(n)

    def file_key(self) -> dict:
        """What a session file of this model records about the weights,
        kernels and settings its keys and values were computed with
        (fastllm.generate.session_file); ValueError for weights built in
        memory."""
        return session_file.key(self._weights, self._weight_files)

    def save_file(self, path, key: dict | None = None):
        """Write what the session holds (the keys and values of its tokens,
        its recurrent states and checkpoints) to the file at path, whole or
        not at all, so that load_file gives another session of this model,
        here or in a later process, those tokens without running them.
        key: file_key(), where the caller has it already."""
        with self._use():
            self._settle()
            n = len(self._tokens)
            if n == 0:
                raise ValueError("the session holds no tokens: there is nothing to save")
            session_file.write(path, key or self.file_key(), self._tokens, self._state.save_prefix(n),
                               self._state.save_position(n), self._checkpoints, self._state.rope_long)

    def load_file(self, path, key: dict | None = None):
        """Hold what save_file wrote at path (forgetting what the session
        held): ModelFileError naming the file where it was saved from
        another model, file, build, machine or settings, or is damaged (the
        session then holds what it held, or nothing where the file failed
        only once its states were being put back)."""
        data = session_file.read(path, key or self.file_key(), self.vocab_size, self.n_ctx)
        n, at = len(data["tokens"]), data["at"]
        if any(a is None or at is None or a.size != at.size for _, a in data["checkpoints"]):
            raise ModelFileError(path, "its checkpoints do not fit its states")
        with self._use():
            self._tokens, self._checkpoints = [], []
            self._floor = self._written = 0
            self._verified, self._unsettled = None, False
            try:
                self._state.rope_long = data["rope_long"]
                self._state.load_prefix(n, data["prefix"])
                self._state.restore_position(n, at)
            except ValueError as e:
                raise ModelFileError(path, f"does not fit this model's caches ({e})") from None
            self._tokens = list(data["tokens"])
            self._written = self._floor = n
            self._checkpoints = [(p, np.array(a)) for p, a in data["checkpoints"]]
            self._touched = max(self._touched, n)
            self._give_back(n)

    def __repr__(self):
        return f"Session(position={self.position}, n_ctx={self.n_ctx}, can_rewind={self.can_rewind})"


def extend_together(sessions, token_ids, work: Session | None = None, verify=None,
                    all_logits=None) -> np.ndarray:
    """Run token_ids[k] after the tokens sessions[k] holds, for every k, in
    one pass over the model's weights: the logits of each one's last token,
    (len(sessions), vocab_size). Decoding is bound by reading the weights,
    so a step for several sessions costs little more than a step for one.
    Each session's results are the same, bit for bit, as its own extend():
    nothing a token computes depends on the other tokens of the pass.
    The pass runs in the work buffers of work (a Session whose max_batch
    holds all the tokens), else of the first session.
    verify[k] true: sessions[k]'s tokens are a draft, as in Session.verify:
    the logits of each of them come back (rows in order, sequence after
    sequence) and keep() may follow. all_logits[k] true: the logits of
    each of sessions[k]'s tokens come back too, and nothing is kept for a
    keep() (a prompt scored as it runs)."""
    ids = [s.check(t) for s, t in zip(sessions, token_ids, strict=True)]
    if any(s._weights is not sessions[0]._weights for s in sessions):
        raise ValueError("a session of another model is in this batch: one pass runs one model's weights")
    if len({id(s) for s in sessions}) < len(sessions):
        # before the sessions are taken for this call, which would read as
        # another thread holding the repeated one
        raise ValueError("a session appears twice in one batch")
    verify = [False] * len(sessions) if verify is None else [bool(v) for v in verify]
    every = verify if all_logits is None else [bool(v or a) for v, a in zip(verify, all_logits, strict=True)]
    positions = [s.position for s in sessions]   # settles any interrupted run first
    with ExitStack() as using:
        for s in sessions:
            using.enter_context(s._use())
        for s, i in zip(sessions, ids):
            s._match_rope(s.position + i.size)
        for s, i, v, p in zip(sessions, ids, verify, positions):
            if v and s._recurrent:
                s._state.enable_rollback(i.size)
            s._unsettled = True
            s._writes(p, i.size)
            s._verified = None
        out = _core.run_batch([s._state for s in sessions], ids, positions,
                              None if work is None else work._state,
                              [i.size if v else 1 for i, v in zip(ids, every)], verify)
        for s, i, v, p in zip(sessions, ids, verify, positions):
            s._tokens += i.tolist()
            s._unsettled = False
            if v:
                s._verified = (p, i.size)
    return out
