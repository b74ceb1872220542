"""The models one server serves, each under its name with a BatchEngine of
its own, and the request's `model` field that picks one.

A server of one model answers whatever name a request gives (clients
written for another service send their own model names) and says in its
replies which model answered. A server of several refuses a name it does
not serve, with a 404 that lists those it does; a request without a name
goes to the first.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

from .openai_api import APIError


@dataclass(eq=False)
class ServedModel:
    name: str
    model: object
    engine: object      # a serving.BatchEngine
    completions: object = None   # server.Completions, set by the app
    # Embeddings run on a session of their own, one request at a time (an
    # asyncio lock, so that waiting requests hold no worker thread).
    embed_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    _embed_session: object = field(default=None, repr=False)

    @property
    def embed_session(self):
        if self._embed_session is None:
            self._embed_session = self.model.new_session()
        return self._embed_session


class ModelSet:
    """ServedModels by name, in the order given (the first is the default)."""

    def __init__(self, served):
        self.served = list(served)
        if not self.served:
            raise ValueError("a server needs at least one model")
        self.by_name = {}
        for s in self.served:
            if not isinstance(s.name, str) or not s.name:
                raise ValueError(f"a served model's name must be a non-empty string, got {s.name!r}")
            if s.name in self.by_name:
                raise ValueError(f"two models are served as {s.name!r}: give them names of their own")
            self.by_name[s.name] = s

    def pick(self, name) -> ServedModel:
        """The model a request's `model` field names (APIError 400 when it
        is not a string, 404 when several are served and it is none of them)."""
        if name is not None and not isinstance(name, str):
            raise APIError(400, "'model' must be a string", param="model")
        if len(self.served) == 1 or name is None:
            return self.served[0]
        found = self.by_name.get(name)
        if found is None:
            raise APIError(404, f"the model {name[:100]!r} is not served here; the models are: "
                                f"{', '.join(self.by_name)}", type="not_found_error", param="model",
                           code="model_not_found")
        return found

    def listing(self) -> list:
        """/v1/models' data."""
        return [{"id": s.name, "object": "model", "created": 0, "owned_by": "fastllm"} for s in self.served]

    # The engines together, as /health and /metrics report one.

    @property
    def alive(self) -> bool:
        return all(s.engine.alive for s in self.served)

    def _total(self, counter: str) -> int:
        return sum(getattr(s.engine, counter) for s in self.served)

    active = property(lambda self: self._total("active"))
    queue_depth = property(lambda self: self._total("queue_depth"))
    drafted = property(lambda self: self._total("drafted"))
    accepted = property(lambda self: self._total("accepted"))

    @property
    def cache(self):
        """The engines' prompt caches together (None where none has one)."""
        caches = [s.engine.cache for s in self.served if getattr(s.engine, "cache", None) is not None]
        if not caches:
            return None
        disks = [c.disk for c in caches if c.disk is not None]
        disk = SimpleNamespace(files=sum(d.files for d in disks), loaded=sum(d.loaded for d in disks))
        return SimpleNamespace(nbytes=sum(c.nbytes for c in caches), hits=sum(c.hits for c in caches),
                               disk=disk if disks else None)

    def close(self):
        for s in self.served:
            s.engine.close()
