"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` on ``kvplug serve``: what
benchmark clients call to count tokens with the server's own tokenizer, answered in vLLM's shapes.

Bodies are parsed and tokenised off the event loop (``OffLoopTokenizer``); a bad field is a 400 in
OpenAI's error shape naming it.
"""

# no "from __future__ import annotations": FastAPI reads the routes' Request annotation at runtime
from typing import Any

from kvplug_transformers.prompt_tokens import OffLoopTokenizer
from kvplug_transformers.request_json import parse_body
from kvplug_transformers.request_limits import RequestLimits, RequestRefused
from kvplug_transformers.stats_routes import ServedModel


def add_token_routes(
    app: Any, processor: Any, pool: OffLoopTokenizer, served: ServedModel, limits: RequestLimits, version: str,
) -> None:
    """``processor``: the served model's tokenizer (or a processor holding one)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    tokenizer = getattr(processor, "tokenizer", processor)
    vocab_size = len(tokenizer)

    def check_model(body: dict) -> None:
        model = body.get("model")
        if model is not None and model != served.name:
            raise RequestRefused(
                f"The model '{model}' does not exist; this server serves '{served.name}'", status=404, param="model"
            )

    def tokenize(raw: bytes) -> dict:
        body = parse_body(raw)
        check_model(body)
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise RequestRefused(f"'add_special_tokens' must be a boolean, got {add_special!r}", param="add_special_tokens")
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise RequestRefused("'messages' must be a list of message objects", param="messages")
            add_generation_prompt = body.get("add_generation_prompt", True)
            if not isinstance(add_generation_prompt, bool):
                raise RequestRefused("'add_generation_prompt' must be a boolean", param="add_generation_prompt")
            try:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    tokenize=True, return_dict=True)["input_ids"]
            except Exception as error:  # a message the template cannot render
                raise RequestRefused(f"'messages' cannot be rendered by the model's chat template: {error}",
                                     param="messages") from error
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestRefused(f"'prompt' (or 'messages') must be a string, got {type(prompt).__name__}",
                                     param="prompt")
            ids = tokenizer(prompt, add_special_tokens=add_special)["input_ids"]
        ids = [int(token) for token in ids]
        return {"tokens": ids, "count": len(ids), "max_model_len": limits.max_context_len}

    def detokenize(raw: bytes) -> dict:
        body = parse_body(raw)
        check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise RequestRefused("'tokens' must be a list of token ids (ints)", param="tokens")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise RequestRefused(f"'tokens' holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                                 param="tokens")
        return {"prompt": tokenizer.decode(tokens)}

    async def tokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(await pool.call(tokenize, await request.body()))

    async def detokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(await pool.call(detokenize, await request.body()))

    def version_route() -> JSONResponse:
        return JSONResponse({"version": version})

    app.add_api_route("/tokenize", tokenize_route, methods=["POST"], response_model=None)
    app.add_api_route("/detokenize", detokenize_route, methods=["POST"], response_model=None)
    app.add_api_route("/version", version_route, methods=["GET"], response_model=None)
