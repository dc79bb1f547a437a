"""Tokenising off the event loop: transformers' handlers render the chat template and tokenise
inline in their ``async`` code, so one long prompt (or an expensive template) would stall every
route. ``OffLoopTokenizer`` runs a handler twice: the first pass stops at the tokenising call
(``Tokenise`` raised), the call then runs in a worker thread, and the second pass gets its result.

The handler's work before that call (body checks, model lookup) is cheap and repeatable; nothing
is submitted to the batching worker before the tokens exist.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

TOKENISING_THREADS = 2  # prompts tokenised at once; more wait their turn instead of taking the GIL from the loop


class Tokenise(Exception):
    """Raised by a ``CapturingProcessor`` at the tokenising call: the call to make off the loop.

    Attributes:
        function, args, kwargs: the call.
        templated: whether it is ``apply_chat_template`` (whose rendered text can be checked first).
    """

    def __init__(self, function: Callable[..., Any], args: tuple, kwargs: dict, templated: bool) -> None:
        super().__init__("tokenise off the event loop")
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.templated = templated

    def run(self, check_text: Callable[[int], None] | None) -> Any:
        """Make the call; a chat template is rendered to text first and ``check_text(bytes)``
        may refuse it before the (costlier) tokenising."""
        if self.templated and check_text is not None:
            kwargs = {key: value for key, value in self.kwargs.items() if key not in ("return_tensors", "return_dict")}
            text = self.function(*self.args, **{**kwargs, "tokenize": False})
            if isinstance(text, str):
                check_text(len(text))  # characters: no more than its UTF-8 bytes, and free to count
        return self.function(*self.args, **self.kwargs)


class CapturingProcessor:
    """Stands for transformers' processor (a tokenizer) in a handler: ``apply_chat_template`` and
    calling it raise ``Tokenise`` on the first pass and return ``result`` on the second; all other
    attributes are the real processor's."""

    _TOKENISING = ("apply_chat_template",)

    def __init__(self, real: Any, result: Any = None, has_result: bool = False) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_result", result)
        object.__setattr__(self, "_has_result", has_result)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(processor, PreTrainedTokenizerBase) still holds
        return type(self._real)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if name in self._TOKENISING:
            return self._tokenising(value)
        if name == "tokenizer" and value is not self._real:
            return CapturingProcessor(value, self._result, self._has_result)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenising(self._real, templated=False)(*args, **kwargs)

    def _tokenising(self, function: Callable[..., Any], templated: bool = True) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._has_result:
                return self._result
            raise Tokenise(function, args, kwargs, templated)

        return call


class OffLoopTokenizer:
    """Runs handlers with their tokenising, and other per-request work too heavy for the event
    loop, in ``TOKENISING_THREADS`` worker threads."""

    def __init__(self, threads: int = TOKENISING_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvplug-tokenise")

    async def run(
        self, handle: Callable[[Any], Awaitable[Any]], processor: Any, check_text: Callable[[int], None] | None = None
    ) -> Any:
        """``handle(processor)`` with ``processor`` a ``CapturingProcessor`` of the real one;
        ``check_text(bytes)`` may refuse a rendered chat template before it is tokenised."""
        try:
            return await handle(CapturingProcessor(processor))
        except Tokenise as captured:
            pending = captured
        result = await asyncio.get_running_loop().run_in_executor(self._pool, pending.run, check_text)
        return await handle(CapturingProcessor(processor, result, has_result=True))

    async def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` in one of the worker threads (body parsing and checks)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: function(*args))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
