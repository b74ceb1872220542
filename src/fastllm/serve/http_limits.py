"""What a connection may hold of `fastllm serve` before it is a request:
uvicorn arms no timer until a request head is complete, so a client that
sends its head a byte every few seconds would keep its connection for
ever, and uvicorn's concurrency limit counts such connections against the
clients that do send requests.

Here a connection must deliver a whole request head within head_timeout
seconds of opening, or of its previous answer ending, else it is closed;
and the limit counts requests in progress (head received, answer not yet
sent), so half-sent heads crowd out nobody. The number of sockets a host
may open is not bounded here: a server open to the internet belongs behind
a reverse proxy that bounds them.
"""
from __future__ import annotations

import json


def with_head_deadline(protocol_class, seconds: float):
    """A subclass of uvicorn's HTTP protocol_class whose connections are
    closed when a request head takes longer than seconds to arrive."""

    class HeadDeadline(protocol_class):
        _head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data):
            super().data_received(data)
            if not self._awaiting_head():
                self._disarm_head_timer()

        def on_response_complete(self):
            super().on_response_complete()
            if self._awaiting_head():   # not a pipelined request already begun
                self._arm_head_timer()

        def connection_lost(self, exc):
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_head_timer(self):
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(seconds, self._head_expired)

        def _disarm_head_timer(self):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_expired(self):
            self._head_timer = None
            if self._awaiting_head() and not self.transport.is_closing():
                self.transport.close()

    HeadDeadline.__name__ = f"HeadDeadline{protocol_class.__name__}"
    return HeadDeadline


class RequestLimit:
    """ASGI middleware: at most limit requests in progress; past that a 503
    in OpenAI's shape, with Retry-After. Paths in always (the health check)
    are answered whatever the load."""

    def __init__(self, app, limit: int, always=("/health",)):
        self.app, self.limit, self.always = app, limit, tuple(always)
        self.active = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.always:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            await _overloaded(send, self.limit)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


async def _overloaded(send, limit: int):
    body = json.dumps({"error": {"message": f"the server is handling {limit} requests, its limit "
                                            "(--max-connections): try again later",
                                 "type": "server_error", "param": None, "code": "overloaded"}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
