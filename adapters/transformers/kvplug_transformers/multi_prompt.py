"""Several prompts in one ``POST /v1/completions`` (``"prompt": ["a", "b"]`` or ``[[1, 2], [3]]``),
as OpenAI and vLLM answer them: one choice per prompt, its ``index`` the prompt's position,
``usage`` summed over the prompts; streamed, every chunk names its choice's ``index`` and one last
chunk (no choices) carries the summed usage.

transformers' completion handler answers one prompt: each prompt is answered as a request of its
own (its own server request id ``<id>-<index>``, all in the batch together) and the answers are
merged here. A prompt that fails fails the request (the others are cancelled).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
EVENT_END = "\n\n"
DATA = "data: "


def split_bodies(body: dict, prompts: list) -> list[dict]:
    """One body per prompt (each a copy of ``body`` with that prompt)."""
    bodies = []
    for prompt in prompts:
        one = copy.deepcopy({key: value for key, value in body.items() if key != "prompt"})
        one["prompt"] = prompt
        bodies.append(one)
    return bodies


async def answer_all(
    prompts: list, answer: Callable[[int], Awaitable[Any]], request_id: str,
) -> Any:
    """``answer(index)`` for every prompt, concurrently, merged into one response: the first that
    is not a success is the answer (the others are cancelled, their streams closed)."""
    from fastapi.responses import JSONResponse

    tasks = [asyncio.ensure_future(answer(index)) for index in range(len(prompts))]
    try:
        responses = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await _close(task.result())
        raise
    failed = next((response for response in responses if getattr(response, "status_code", 200) != 200), None)
    if failed is not None:
        for response in responses:
            if response is not failed:
                await _close(response)
        return failed
    if all(getattr(response, "body_iterator", None) is None for response in responses):
        return JSONResponse(merge_completions([json.loads(response.body) for response in responses], request_id))
    from fastapi.responses import StreamingResponse

    return StreamingResponse(merge_streams([response.body_iterator for response in responses], request_id),
                             media_type="text/event-stream")


def merge_completions(replies: list[dict], request_id: str) -> dict:
    """One ``text_completion`` from each prompt's: their choices in prompt order, usage summed."""
    merged = dict(replies[0], id=request_id, choices=[])
    for index, reply in enumerate(replies):
        for choice in reply["choices"]:
            merged["choices"].append(dict(choice, index=index))
    merged["usage"] = _summed(reply.get("usage") for reply in replies)
    return merged


async def merge_streams(streams: list[AsyncIterator], request_id: str) -> AsyncIterator[str]:
    """The prompts' SSE streams as one: chunks as they come, each choice's ``index`` its prompt's,
    usage taken off them and sent summed in a last chunk; an error event ends the stream."""
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async for part in stream:
                await queue.put((index, part))
        finally:
            await queue.put((index, finished))

    tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    usages: list[dict | None] = [None] * len(streams)
    last: dict = {"id": request_id, "object": "text_completion", "created": int(time.time())}
    running = len(streams)
    try:
        while running:
            index, part = await queue.get()
            if part is finished:
                running -= 1
                continue
            events, failed = [], False
            for chunk in _events(part):
                if "error" in chunk:
                    events.append(chunk)
                    failed = True
                    break
                usage = chunk.pop("usage", None)
                if usage is not None:
                    usages[index] = usage
                chunk["id"] = request_id
                for choice in chunk.get("choices", ()):
                    choice["index"] = index
                last.update(created=chunk.get("created", last["created"]), model=chunk.get("model"))
                events.append(chunk)
            if events:
                yield "".join(f"{DATA}{json.dumps(event)}{EVENT_END}" for event in events)
            if failed:
                return
        yield f"{DATA}{json.dumps(dict(last, choices=[], usage=_summed(usages)))}{EVENT_END}"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await _close_iterator(stream)


def _events(part: Any) -> list[dict]:
    """The ``data:`` events of one piece of a stream (transformers yields one or more at a time)."""
    text = part.decode() if isinstance(part, bytes) else part
    events = []
    for event in text.split(EVENT_END):
        event = event.strip()
        if event.startswith(DATA) and event[len(DATA):].strip() != "[DONE]":
            events.append(json.loads(event[len(DATA):]))
    return events


def _summed(usages: Any) -> dict:
    total = dict.fromkeys(USAGE_FIELDS, 0)
    for usage in usages:
        for name in USAGE_FIELDS:
            total[name] += int((usage or {}).get(name) or 0)
    return total


async def _close(response: Any) -> None:
    await _close_iterator(getattr(response, "body_iterator", None))


async def _close_iterator(stream: Any) -> None:
    """Close a stream nobody will read (its generation is cancelled by its own generator)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # already closed, or failing as it closes: nothing left to free
            pass
