"""A stream that is behind sends what it has in one chunk, as vLLM and SGLang do.

transformers' streaming handlers read a request's queue of text pieces and build one SSE chunk
per piece. When the HTTP process falls behind the engine (many streams, one interpreter), pieces
pile up in the queue and every one costs a chunk. ``CoalescedQueue`` hands the handler the plain
text pieces that are already waiting as one piece: the text is the same, the token count
(``usage``, counted by transformers' streamer) is the same, and nothing waits for more: the first
piece, and any piece that finds the queue empty, goes out at once. vLLM's output collector
merges the deltas of a request its client has not taken yet in the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any

_NOTHING = object()


class CoalescedQueue:
    """transformers' stream queue (``get`` and ``get_nowait`` only, as the handlers read it) whose
    consecutive plain ``str`` pieces waiting together come out joined; any other item (the end,
    an error, a tool call, reasoning text) keeps its place and is never merged."""

    __slots__ = ("_inner", "_next")

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._next: Any = _NOTHING  # an item taken while joining, handed out next

    async def get(self) -> Any:
        if self._next is not _NOTHING:
            return self._join(self._take())
        return self._join(await self._inner.get())

    def get_nowait(self) -> Any:
        if self._next is not _NOTHING:
            return self._join(self._take())
        return self._join(self._inner.get_nowait())  # asyncio.QueueEmpty when nothing more has come

    def _take(self) -> Any:
        item, self._next = self._next, _NOTHING
        return item

    def _join(self, item: Any) -> Any:
        if type(item) is not str:
            return item
        pieces = None
        while True:
            try:
                following = self._inner.get_nowait()
            except asyncio.QueueEmpty:
                break
            if type(following) is not str:
                self._next = following
                break
            if pieces is None:
                pieces = [item]
            pieces.append(following)
        return item if pieces is None else "".join(pieces)
