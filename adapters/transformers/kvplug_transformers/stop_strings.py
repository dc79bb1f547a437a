"""A request's ``stop`` strings: generation ends where one appears, the text returned stops before it.

Two halves, as in vLLM: the batching worker ends the request (``StopStrings.check``, called by the
kvplug cache each time transformers appended a token to a request), and the response is cut
(``cut_at_stop`` for a whole text, ``StopStringQueue`` for a stream, which holds back a tail that
could still become a stop string). transformers' continuous batching has no stop strings of its
own (a request's ``stop_strings`` never reaches its worker).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable, Sequence

TAIL_SLACK = 8  # tokens decoded beyond the longest stop string's length (special / partial-byte tokens)


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in ``text`` begins, or ``None``."""
    found = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return min(found) if found else None


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    index = find_stop(text, stops)
    return text if index is None else text[:index]


def undecided_tail(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string (it may still become one)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class StopStrings:
    """The worker's half: ends a request whose output text now holds one of its stop strings.

    Args:
        stops_of: a request id's stop strings (empty: none).
        decode: token ids to text (the tokenizer's ``decode``, special tokens skipped).
    """

    def __init__(self, stops_of: Callable[[str], tuple[str, ...]], decode: Callable[[list[int]], str]) -> None:
        self._stops_of = stops_of
        self._decode = decode

    def check(self, state: Any) -> bool:
        """After transformers appended a token to ``state`` (its ``RequestState``): when the text of
        its last tokens holds a stop string, let it take one more token at most (one may be in
        flight already) so that it finishes at the next update. Returns whether it matched."""
        stops = self._stops_of(state.request_id)
        if not stops:
            return False
        tokens = state.generated_tokens
        tail = tokens[-(max(map(len, stops)) + TAIL_SLACK):]
        if find_stop(self._decode(list(tail)), stops) is None:
            return False
        limit = len(tokens) + 1
        if state._new_tokens_limit > limit:
            state._new_tokens_limit = limit
            state.max_new_tokens = limit
        return True


class StopStringQueue:
    """transformers' stream queue (``asyncio.Queue`` of text pieces, ``ToolCall`` /
    ``ReasoningText`` items, errors, ``None`` at the end) with its text cut at the first stop
    string: text that could still begin one is held back, and the stream ends (``None``) at a stop.
    The handlers read it through ``get`` and ``get_nowait`` only."""

    def __init__(self, inner: asyncio.Queue, stops: Sequence[str]) -> None:
        self._inner = inner
        self._stops = tuple(stops)
        self._ready: deque = deque()
        self._held = ""
        self._ended = False

    async def get(self) -> Any:
        while not self._ready:
            self._take(await self._inner.get())
        return self._ready.popleft()

    def get_nowait(self) -> Any:
        while not self._ready:
            self._take(self._inner.get_nowait())  # asyncio.QueueEmpty when nothing more has come
        return self._ready.popleft()

    def _take(self, item: Any) -> None:
        if self._ended:
            return  # past the stop (or the end): what the worker still sends is dropped
        if type(item) is not str:  # the end, an error, a tool call, reasoning text: flush, pass on
            if self._held:
                self._ready.append(self._held)
                self._held = ""
            self._ready.append(item)
            self._ended = item is None
            return
        text = self._held + item
        index = find_stop(text, self._stops)
        if index is not None:
            if index:
                self._ready.append(text[:index])
            self._ready.append(None)
            self._held, self._ended = "", True
            return
        keep = undecided_tail(text, self._stops)
        ready, self._held = (text[:-keep], text[-keep:]) if keep else (text, "")
        if ready:
            self._ready.append(ready)
