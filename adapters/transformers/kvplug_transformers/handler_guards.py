"""transformers' endpoint handlers, with kvplug's checks in front (on the instances; transformers'
classes are untouched).

Each ``handle_request`` first checks the body (``request_bodies``); the model may be named by the
served name, the checkpoint path, or not at all, and responses name the served model; an error
the chat template raises for the messages is the client's (400), not a 500.
"""

from __future__ import annotations

from typing import Any, Callable

from kvplug_transformers.request_bodies import check_chat_completion, check_completion, check_response
from kvplug_transformers.request_limits import RequestRefused
from kvplug_transformers.stats_routes import ServedModel


def guard_handlers(chat: Any, completion: Any, response: Any, served: ServedModel) -> None:
    for handler, check in ((chat, check_chat_completion), (completion, check_completion), (response, check_response)):
        if handler is not None:
            _guard(handler, check, served)


def _guard(handler: Any, check: Callable[[dict], None], served: ServedModel) -> None:
    handle_request = handler.handle_request
    resolve_model = handler._resolve_model

    async def checked_handle_request(body: dict, request_id: str) -> Any:
        check(body)
        requested = body.get("model")
        if not served.accepts(requested):
            raise RequestRefused(
                f"The model '{requested}' does not exist; this server serves '{served.name}' (or omit 'model')",
                status=404, param="model",
            )
        body.pop("model", None)  # transformers then takes the model it was started with
        try:
            return await handle_request(body, request_id)
        except Exception as error:
            if _is_template_error(error):
                raise RequestRefused(
                    f"the model's chat template refused these messages: {type(error).__name__}: {error}",
                    param="messages",
                ) from error
            raise

    def named_resolve_model(body: dict) -> tuple[str, Any, Any]:
        _, model, processor = resolve_model(body)
        return served.name, model, processor

    handler.handle_request = checked_handle_request
    handler._resolve_model = named_resolve_model


def _is_template_error(error: Exception) -> bool:
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers' chat templates need jinja2
        return False
    return isinstance(error, TemplateError)
