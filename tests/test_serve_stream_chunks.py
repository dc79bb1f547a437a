"""Issue 28: the HTTP process's per-token work when streaming.

``ChatChunkBuilder`` writes byte for byte what transformers' ``_build_chunk_sse`` writes (compared
over many strings and every code point of the BMP), and leaves every other chunk to it;
``CoalescedQueue`` joins only the plain text pieces already waiting, keeps every other item in
its place, and never waits for more; ``send_within`` times out a send that blocks.
"""

from __future__ import annotations

import asyncio
import random

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openai")

from transformers.cli.serving.chat_completion import ChatCompletionHandler  # noqa: E402
from transformers.cli.serving.utils import ReasoningText, ToolCall, _StreamError  # noqa: E402

from kvplug_transformers.coalesced_stream import CoalescedQueue  # noqa: E402
from kvplug_transformers.http_guards import send_within  # noqa: E402
from kvplug_transformers.sse_chunks import ChatChunkBuilder  # noqa: E402


@pytest.fixture
def builders(monkeypatch):
    import time

    monkeypatch.setattr(time, "time", lambda: 1796303031.75)  # both builders read the clock once per chunk
    handler = ChatCompletionHandler.__new__(ChatCompletionHandler)
    return handler._build_chunk_sse, ChatChunkBuilder(handler._build_chunk_sse)


def _strings(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    special = [
        0x00,
        0x08,
        0x09,
        0x0A,
        0x0C,
        0x0D,
        0x1F,
        0x20,
        0x22,
        0x2F,
        0x5C,
        0x7F,
        0x80,
        0xA0,
        0x2028,
        0x2029,
        0xFEFF,
        0xFFFD,
        0x1F600,
    ]
    strings = ["", "hello", "a\nb", '"quoted"', "back\\slash", "</script>", "é", "日本語"]
    for _ in range(count):
        length = rng.randrange(0, 8)
        strings.append(
            "".join(
                chr(
                    rng.choice(
                        [
                            rng.randrange(0x00, 0x80),
                            rng.randrange(0x80, 0xD800),
                            rng.randrange(0xE000, 0x110000),
                            rng.choice(special),
                        ]
                    )
                )
                for _ in range(length)
            )
        )
    return strings


def test_the_per_token_chunks_are_byte_identical_to_transformers(builders):
    theirs, ours = builders
    strings = _strings(3000)
    for index, text in enumerate(strings):
        request_id, model = f"kvplug-{strings[index - 1]}", f"model/{strings[index - 2]}"
        for fields in ({"content": text}, {"reasoning_content": ReasoningText(text)}, {"role": "assistant"}):
            assert ours(request_id, model=model, **fields) == theirs(request_id, model=model, **fields), fields
    for point in range(0x10000):
        if 0xD800 <= point < 0xE000:
            continue  # no lone surrogates in decoded text
        assert ours("id", content=chr(point), model="m") == theirs("id", content=chr(point), model="m"), hex(point)


def test_other_chunks_are_transformers_own(builders):
    from openai.types import CompletionUsage

    theirs, ours = builders
    usage = CompletionUsage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    assert ours("id", finish_reason="length", model="m", usage=usage) == theirs(
        "id", finish_reason="length", model="m", usage=usage
    )
    calls = [{"index": 0, "type": "function", "id": "id_tool_call_0", "function": {"name": "f", "arguments": "{}"}}]
    from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall

    tool_calls = [ChoiceDeltaToolCall(**calls[0])]
    assert ours("id", model="m", tool_calls=tool_calls) == theirs("id", model="m", tool_calls=tool_calls)
    for builder in (ours, theirs):
        with pytest.raises(Exception):  # a chunk must name its model: both refuse
            builder("id", model=None, content="x")
    assert ours("id", model="m", content="x", role="assistant") == theirs(
        "id", model="m", content="x", role="assistant"
    )
    with pytest.raises(Exception):  # pydantic refuses a role it does not know: so does the builder
        ours("id", model="m", role="narrator")
    calls_made = []
    builder = ChatChunkBuilder(lambda *args, **kwargs: calls_made.append((args, kwargs)) or "theirs")
    assert builder("id", model="m", content="x").startswith('data: {"id":"id"') and not calls_made
    assert builder("id", model="m", finish_reason="stop") == "theirs" and len(calls_made) == 1


def _queue(items: list) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_waiting_text_pieces_come_out_joined_and_nothing_else_moves():
    async def scenario() -> None:
        tool = ToolCall(name="f", arguments="{}")
        error = _StreamError("boom")
        items = ["a", "b", "c", ReasoningText("r1"), ReasoningText("r2"), "d", tool, "e", "f", error, "g", None]
        stream = CoalescedQueue(_queue(items))
        seen = [await stream.get()]
        while True:
            try:
                seen.append(stream.get_nowait())
            except asyncio.QueueEmpty:
                break
        assert seen == ["abc", "r1", "r2", "d", tool, "ef", error, "g", None]
        assert [type(item) for item in seen[1:3]] == [ReasoningText, ReasoningText]  # reasoning is never merged

    asyncio.run(scenario())


def test_a_piece_goes_out_at_once_and_later_ones_are_not_waited_for():
    async def scenario() -> None:
        inner: asyncio.Queue = asyncio.Queue()
        stream = CoalescedQueue(inner)
        getter = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        inner.put_nowait("first")
        assert await asyncio.wait_for(getter, 1) == "first"  # the first token is not held back
        with pytest.raises(asyncio.QueueEmpty):
            stream.get_nowait()
        inner.put_nowait("x")
        inner.put_nowait("y")
        assert await stream.get() == "xy"
        inner.put_nowait(None)
        assert await stream.get() is None

    asyncio.run(scenario())


def test_send_within_times_out_a_blocked_send_and_passes_a_quick_one():
    async def scenario() -> None:
        sent = []

        async def quick(message: dict) -> None:
            sent.append(message)

        async def blocked(message: dict) -> None:
            await asyncio.sleep(10)

        await send_within(quick, {"n": 1}, 1.0)
        assert sent == [{"n": 1}]
        with pytest.raises(asyncio.TimeoutError):
            await send_within(blocked, {"n": 2}, 0.05)

    asyncio.run(scenario())


class _Output:
    def __init__(self, request_id: str, tokens: list[int], finished: bool = False) -> None:
        self.request_id, self.generated_tokens, self.error, self._finished = request_id, tokens, None, finished

    def is_finished(self) -> bool:
        return self._finished


def test_the_engine_sends_the_first_token_at_once_then_n_at_a_time_and_the_end():
    from kvplug_transformers.engine_process import _OutputSender

    sender = _OutputSender(manager=None, links=None, interval=3)
    sent = []
    for count in range(0, 9):
        item = sender._delta(_Output("r", list(range(count))))
        sent.append(None if item is None else item.new_tokens)
    assert sent == [[], [0], None, None, [1, 2, 3], None, None, [4, 5, 6], None]
    last = sender._delta(_Output("r", list(range(9)), finished=True))
    assert last.new_tokens == [7, 8] and last.finished  # the end is never held back
    every = _OutputSender(manager=None, links=None)
    assert [every._delta(_Output("s", list(range(n)))).new_tokens for n in (1, 2, 3)] == [[0], [1], [2]]


def test_stream_interval_is_checked_and_needs_the_engine_process():
    from kvplug_transformers.serve_options import InvalidArgumentError, ServeOptions

    assert ServeOptions(engine_process=True, stream_interval=4).stream_interval == 4
    for bad in (0, -1, 2.0, True, 100_000):
        with pytest.raises(InvalidArgumentError, match="--stream-interval must be an int"):
            ServeOptions(engine_process=True, stream_interval=bad)
    with pytest.raises(InvalidArgumentError, match="needs --engine-process"):
        ServeOptions(stream_interval=2)
