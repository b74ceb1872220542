"""What the batch engine's slots held, kept beyond them: in RAM, and
optionally in files (the server's --cache-ram and --cache-dir).

An agent sends the same long system prompt and tools with every request,
and each turn of a conversation extends the last. Before a slot takes a
request that keeps little of what it holds, its sequence (keys and values,
recurrent states and checkpoints) is copied into the cache, so that a
later request that lands on another slot, comes back after other
conversations used the slots, or comes to a server started later (the
files), still skips the prefix it shares with it.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import sys
import threading
from pathlib import Path

from ..generate import session_file
from ..generate.session import common_prefix
from ..load import pack_cache
from ..spec.errors import ModelFileError


def _say(message: str):
    sys.stderr.write(f"fastllm: {message}\n")


def reusable(tokens, checkpoints, can_rewind: bool, prompt) -> int:
    """How many of prompt's first tokens a session that loaded a file of
    tokens (with checkpoints at those positions) would not run again: as
    Session.reusable says of it (a loaded session goes back before its end
    only to a checkpoint, unless its caches can go back anywhere)."""
    n = min(common_prefix(tokens, prompt), len(prompt) - 1)
    if can_rewind or n >= len(tokens):
        return n
    return max((p for p in checkpoints if p <= n), default=0)


class PromptCache:
    """Sequences the slots held, least recently used first out: in RAM up
    to budget_bytes, and where folder is given, also in files there up to
    disk_bytes (written by a thread of their own, so that the slots keep
    decoding; read back when one holds more of a prompt than RAM does)."""

    # Sequences shorter than this are cheaper to run again than to keep.
    MIN_TOKENS = 64

    def __init__(self, model, budget_bytes: int, folder=None, disk_bytes: int = 8 << 30):
        self.model, self.budget = model, budget_bytes
        self._entries = []   # sessions, least recently used first
        self.hits = self.saved = 0
        self.disk = DiskCache(model, folder, disk_bytes) if folder is not None else None

    @property
    def nbytes(self) -> int:
        return sum(e.memory_bytes for e in self._entries)

    def __len__(self):
        return len(self._entries)

    def best(self, prompt_ids):
        """(entry, tokens it lets prompt_ids skip), the most of any entry
        (a file's, read now, where one holds more than RAM does)."""
        best = max(self._entries, key=lambda e: e.reusable(prompt_ids), default=None)
        most = best.reusable(prompt_ids) if best is not None else 0
        if self.disk is not None:
            loaded = self.disk.load(prompt_ids, most, self._new_entry)
            if loaded is not None:
                self._keep(loaded)
                best, most = loaded, loaded.reusable(prompt_ids)
        return best, most

    def touch(self, entry):
        if entry in self._entries:
            self._entries.remove(entry)
            self._entries.append(entry)
        self.hits += 1

    def save(self, session):
        """Keep a copy of what session holds (unless an entry already holds
        it all, or it is short, or alone over the budgets)."""
        held = session.tokens
        to_disk = self.disk is not None and session.memory_bytes <= self.disk.budget
        if len(held) < self.MIN_TOKENS or session.memory_bytes > self.budget and not to_disk:
            return
        for e in self._entries:
            if e.tokens[:len(held)] == held:
                self.touch(e)
                return
        entry = self._new_entry()
        entry.max_checkpoints = session.max_checkpoints
        entry.copy_prefix(session, len(held))
        self.saved += 1
        if session.memory_bytes <= self.budget:
            self._keep(entry)
        if to_disk:
            self.disk.put(entry)

    def _new_entry(self):
        return self.model.new_session(1)

    def _keep(self, entry):
        held = entry.tokens
        # entries that hold a prefix of it are superseded
        self._entries = [e for e in self._entries if held[:e.position] != e.tokens] + [entry]
        while self.nbytes > self.budget:
            self._entries.pop(0)

    def close(self):
        """Finish writing the files queued (see DiskCache.close)."""
        if self.disk is not None:
            self.disk.close()


class DiskCache:
    """Sequences of one model in files under folder (Session.save_file),
    at most budget bytes of them (every session file there counts, this
    model's or not: the least recently used go first). A file is used only
    when it was made for this model, build and settings and is whole;
    a damaged one is deleted, and one of another model is left alone."""

    def __init__(self, model, folder, budget: int):
        self.folder, self.budget = Path(folder), budget
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--cache-dir {folder}: cannot make the folder ({e.strerror or e})") from None
        if not os.access(self.folder, os.W_OK | os.X_OK):
            raise ValueError(f"--cache-dir {folder}: the folder is not writable")
        probe = model.new_session(1)
        self.key = probe.file_key()            # ValueError for a model not read from files
        self._can_rewind = probe.can_rewind
        self._stem = hashlib.blake2b(json.dumps(self.key, sort_keys=True).encode(), digest_size=8).hexdigest()
        self._lock = threading.Lock()
        self._index = {}   # path -> (tokens, checkpoints) of this model's files
        self.loaded = self.written = 0
        self._warned = False
        for path in sorted(self.folder.glob("*" + session_file.SUFFIX)):
            self._read_header(path)
        self._queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="fastllm-cache-writer", daemon=True)
        self._writer.start()

    def _read_header(self, path: Path):
        try:
            want, tokens, points = session_file.header(path)
        except pack_cache.CacheInvalid as e:
            _say(f"the prompt cache file {path} cannot be used ({e}); deleting it")
            _unlink(path)
            return
        except OSError:
            return
        if want == self.key:
            self._index[path] = (tokens, points)

    @property
    def files(self) -> int:
        with self._lock:
            return len(self._index)

    def path_for(self, tokens) -> Path:
        h = hashlib.blake2b(self._stem.encode(), digest_size=16)
        h.update(json.dumps(list(tokens)).encode())
        return self.folder / f"{self._stem}-{h.hexdigest()}{session_file.SUFFIX}"

    def load(self, prompt_ids, more_than: int, new_session):
        """A session loaded from the file that lets prompt_ids skip the
        most tokens, where that is more than more_than (and a file holds
        at least MIN_TOKENS of them); else None."""
        with self._lock:
            scored = [(reusable(t, c, self._can_rewind, prompt_ids), p) for p, (t, c) in self._index.items()]
        for n, path in sorted(scored, key=lambda x: -x[0]):
            if n <= more_than or n < PromptCache.MIN_TOKENS:
                return None
            session = new_session()
            try:
                session.load_file(path, self.key)
            except ModelFileError as e:
                _say(f"{e}; deleting it")
                self._forget(path)
                _unlink(path)
                continue
            except OSError:
                self._forget(path)
                continue
            try:
                os.utime(path)   # recently used
            except OSError:
                pass
            self.loaded += 1
            return session
        return None

    def put(self, session):
        """Write what session holds into a file, soon (by the writer
        thread); session must not change from now on."""
        self._queue.put(session)

    def _forget(self, path):
        with self._lock:
            self._index.pop(path, None)

    def _write_loop(self):
        while True:
            session = self._queue.get()
            try:
                if session is None:
                    return
                self._write(session)
            except Exception as e:   # a full disk, a folder gone: the cache stays in RAM
                if not self._warned:
                    _say(f"cannot write the prompt cache into {self.folder} ({e}); going on without "
                         f"those files")
                    self._warned = True
            finally:
                self._queue.task_done()

    def _write(self, session):
        tokens = session.tokens
        path = self.path_for(tokens)
        if not path.exists():
            session.save_file(path, self.key)
            self.written += 1
        with self._lock:
            self._index[path] = (tuple(tokens), session.checkpoints)
            # files holding a prefix of it are superseded
            gone = [p for p, (t, _) in self._index.items() if p != path and tokens[:len(t)] == t]
            for p in gone:
                del self._index[p]
        for p in gone:
            _unlink(p)
        self._trim(keep=path)

    def _trim(self, keep: Path):
        """Delete the least recently used session files past the budget."""
        files = []
        for p in self.folder.glob("*" + session_file.SUFFIX):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.budget:
                break
            if p != keep:
                self._forget(p)
                _unlink(p)
                total -= size

    def flush(self):
        """Wait for the files queued so far to be written."""
        self._queue.join()

    def close(self):
        """Write the files queued, then stop the writer."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()


def _unlink(p: Path):
    try:
        p.unlink()
    except OSError:
        pass
