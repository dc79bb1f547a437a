"""transformers' endpoint handlers, with kvplug's checks in front (on the instances; transformers'
classes are untouched).

``GuardedHandler.handle`` takes a body already parsed and checked (``generation_routes``) and
the server's own request id; the model may be named by the served name or not at all, and
responses name the served model; a prompt whose text cannot fit is refused before tokenising; the
chat template and the tokenizer run off the event loop (``OffLoopTokenizer``); an error the chat
template raises for the messages is the client's (400), not a 500.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

from kvplug_transformers.prompt_tokens import OffLoopTokenizer
from kvplug_transformers.request_bodies import check_chat_completion, check_completion, check_response
from kvplug_transformers.request_limits import RequestLimits, RequestRefused
from kvplug_transformers.request_sampling import RequestSampling
from kvplug_transformers.sampling_fields import request_params
from kvplug_transformers.sse_chunks import ChatChunkBuilder
from kvplug_transformers.stats_routes import ServedModel
from kvplug_transformers.token_id_prompts import TokenIdsProcessor

PROMPT_FIELDS = ("messages", "input", "instructions", "prompt", "suffix", "tools")
SAMPLING_KEY = "__kvplug_sampling__"  # a checked body's SamplingParams, until handle() registers them


class GuardedHandler:
    """One of transformers' handlers (chat, completions, responses) behind kvplug's checks.

    Args:
        handler: transformers' handler; its ``_resolve_model`` is wrapped on the instance.
        check: the body check of its route (``request_bodies``).
        served: the model this server serves.
        limits: what one request may hold.
        bytes_per_token: the most text bytes one token of the tokenizer covers.
        tokenizer: where prompts are tokenised.
        trust_request_chat_template: ``--trust-request-chat-template``.
        sampling: where each request's sampling goes (``RequestSampling`` on the kvplug cache,
            ``native_sampling.NativeRequestSampling`` on transformers' own); ``None``: the fields go
            to transformers' handler as they are (a library caller's choice, not ``kvplug serve``'s).
    """

    def __init__(
        self, handler: Any, check: Callable[..., None], served: ServedModel, limits: RequestLimits,
        bytes_per_token: int, tokenizer: OffLoopTokenizer, trust_request_chat_template: bool,
        sampling: RequestSampling | None = None,
    ) -> None:
        self._handler = handler
        self._check = check
        self._served = served
        self._limits = limits
        self._bytes_per_token = bytes_per_token
        self._tokenizer = tokenizer
        self._trusted = trust_request_chat_template
        self._sampling = sampling
        self._processor: contextvars.ContextVar = contextvars.ContextVar("kvplug_processor", default=None)
        self._resolve_model = handler._resolve_model
        handler._resolve_model = self._named_resolve_model

    def check(self, body: dict) -> None:
        """The route's body checks (may normalise ``body``); cheap, thread-safe."""
        self._check(body, trust_request_chat_template=self._trusted)
        requested = body.get("model")
        if not self._served.accepts(requested):
            raise RequestRefused(
                f"The model '{requested}' does not exist; this server serves '{self._served.name}' (or omit 'model')",
                status=404, param="model",
            )
        body.pop("model", None)  # transformers then takes the model it was started with
        if self._sampling is not None:
            self._take_sampling(body)
            self._refuse_unknown_fields(body)
        self._limits.check_text_size(prompt_bytes(body), self._bytes_per_token)

    def _take_sampling(self, body: dict) -> None:
        """Move the request's sampling fields out of ``body`` into its ``SamplingParams`` (under
        ``SAMPLING_KEY``): transformers' handler never sees them, the batching worker's sampler
        applies them (``stop``: ``stop_strings``); on transformers' own cache only a request that asks
        for other sampling than the checkpoint's registers (``NativeRequestSampling.admit``)."""
        params = request_params(body, self._sampling.defaults, self._sampling.vocab_size)
        body[SAMPLING_KEY] = self._sampling.admit(params)

    def _refuse_unknown_fields(self, body: dict) -> None:
        """Fields transformers' handler would answer with a 422 in its own shape are a 400 in
        OpenAI's (vLLM's sampling extras were taken out of ``body`` before)."""
        params = getattr(self._handler, "_valid_params_class", None)
        known = getattr(params, "__mutable_keys__", None)
        if not known:
            return
        for name in [name for name in body if name not in known and name != SAMPLING_KEY]:
            raise RequestRefused(f"unknown field {name!r} for this endpoint", param=name)

    async def handle(self, first: dict, second: dict, request_id: str) -> Any:
        """Answer a checked body; ``first`` and ``second`` are two copies of it (the handler runs
        twice, see ``prompt_tokens``)."""
        params = first.pop(SAMPLING_KEY, None)
        second.pop(SAMPLING_KEY, None)
        if params is None or self._sampling is None:
            return await self._handle(first, second, request_id)
        self._sampling.register(request_id, params)
        try:
            return await self._handle(first, second, request_id)
        except BaseException:
            self._sampling.discard(request_id)  # never submitted, or failed: the worker will not take them
            raise

    async def _handle(self, first: dict, second: dict, request_id: str) -> Any:
        _, _, processor = self._resolve_model({})
        if isinstance(first.get("prompt"), list):  # token ids (check_completion let them through): nothing to tokenise
            ids_processor = TokenIdsProcessor(processor, first["prompt"])
            first["prompt"] = ""
            token = self._processor.set(ids_processor)
            try:
                return await self._handler.handle_request(first, request_id)
            finally:
                self._processor.reset(token)
        bodies = iter((first, second))

        async def run(capturing: Any) -> Any:
            token = self._processor.set(capturing)
            try:
                return await self._handler.handle_request(next(bodies), request_id)
            finally:
                self._processor.reset(token)

        try:
            return await self._tokenizer.run(
                run, processor, lambda size: self._limits.check_text_size(size, self._bytes_per_token)
            )
        except Exception as error:
            if _is_template_error(error):
                raise RequestRefused(
                    f"the model's chat template refused these messages: {type(error).__name__}: {error}",
                    param="messages",
                ) from error
            raise

    def _named_resolve_model(self, body: dict) -> tuple[str, Any, Any]:
        _, model, processor = self._resolve_model(body)
        capturing = self._processor.get()
        return self._served.name, model, processor if capturing is None else capturing


def guard_handlers(
    chat: Any, completion: Any, response: Any, served: ServedModel, limits: RequestLimits, bytes_per_token: int,
    tokenizer: OffLoopTokenizer, trust_request_chat_template: bool, sampling: RequestSampling | None = None,
) -> dict[str, GuardedHandler]:
    """The guarded handlers by route path."""
    guarded = {}
    for path, handler, check in (
        ("/v1/chat/completions", chat, check_chat_completion),
        ("/v1/completions", completion, check_completion),
        ("/v1/responses", response, check_response),
    ):
        guarded[path] = GuardedHandler(
            handler, check, served, limits, bytes_per_token, tokenizer, trust_request_chat_template, sampling
        )
    chat._build_chunk_sse = ChatChunkBuilder(chat._build_chunk_sse)  # the per-token chunks without pydantic
    return guarded


def prompt_bytes(body: dict) -> int:
    """UTF-8 bytes of every string in the fields that become the prompt."""
    total = 0
    stack = [body.get(name) for name in PROMPT_FIELDS]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value.encode("utf-8"))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return total


def _is_template_error(error: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers' chat templates need jinja2
        return False
    return isinstance(error, TemplateError)
