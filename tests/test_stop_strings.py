"""``stop`` strings (``kvplug_transformers.stop_strings``): a stream cut at the first stop string must
give, whatever the pieces it arrives in, exactly the whole text cut there; the worker's check ends a
request one token after its text holds a stop string. Pure Python, no model."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvplug_transformers.stop_strings import StopStringQueue, StopStrings, cut_at_stop, find_stop, undecided_tail


def test_find_cut_and_undecided_tail():
    assert find_stop("hello world", ["wor", "lo"]) == 3 and find_stop("abc", ["x"]) is None
    assert cut_at_stop("hello world", ["wor"]) == "hello " and cut_at_stop("abc", ["x"]) == "abc"
    assert undecided_tail("abc<|e", ["<|end|>"]) == 3 and undecided_tail("abc", ["<|end|>"]) == 0
    assert undecided_tail("aab", ["abc", "bx"]) == 2


def _stream(pieces: list, stops: list[str]) -> list:
    async def run() -> list:
        inner: asyncio.Queue = asyncio.Queue()
        for piece in pieces:
            inner.put_nowait(piece)
        queue, out = StopStringQueue(inner, stops), []
        while True:
            try:  # the handlers' pattern: one awaited get, then get_nowait until empty
                item = await queue.get()
                while True:
                    out.append(item)
                    if item is None:
                        return out
                    item = queue.get_nowait()
            except asyncio.QueueEmpty:
                continue

    return asyncio.run(run())


@pytest.mark.parametrize("seed", range(40))
def test_a_stream_in_any_pieces_is_the_text_cut_at_the_stop(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab\n<|>x") for _ in range(rng.randint(0, 40)))
    stops = [rng.choice(["ab", "\n\n", "<|x", "b<", "zzz"]) for _ in range(rng.randint(1, 3))]
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(0, 10))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out = _stream([*pieces, None, "after the end"], stops)
    assert out[-1] is None and all(isinstance(item, str) and item for item in out[:-1])
    assert "".join(out[:-1]) == cut_at_stop(text, stops)


def test_other_items_pass_through_after_the_held_text():
    class ToolCall:
        pass

    call = ToolCall()
    assert _stream(["ab<", call, "|x tail", None], ["<|x"]) == ["ab", "<", call, "|x tail", None]
    assert _stream(["ab<", "|x tail", call, None], ["<|x"]) == ["ab", None]


class _State:
    def __init__(self, tokens: list[int]) -> None:
        self.request_id = "r"
        self.generated_tokens = tokens
        self._new_tokens_limit = self.max_new_tokens = 100


def test_the_worker_check_ends_a_request_one_token_later():
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    check = StopStrings(lambda request_id: ("cd",), decode)
    state = _State([0, 1, 2])
    assert not check.check(state) and state._new_tokens_limit == 100
    state.generated_tokens.append(3)  # "abcd"
    assert check.check(state) and state._new_tokens_limit == state.max_new_tokens == 5
    assert not StopStrings(lambda request_id: (), decode).check(_State([2, 3]))
