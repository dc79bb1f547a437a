"""Token-id prompts on ``/v1/completions`` (``"prompt": [1, 2, 3]``, as benchmark clients send):
transformers' completion handler takes text only, so it is handed a processor whose tokenizer
call returns the request's ids as they are, instead of tokenising its (empty) prompt."""

from __future__ import annotations

from typing import Any

from kvplug_transformers.request_limits import RequestRefused


class TokenIdsProcessor:
    """The served tokenizer, except that calling it returns ``ids`` (a ``list[int]``) unchanged."""

    def __init__(self, real: Any, ids: list[int]) -> None:
        tokenizer = getattr(real, "tokenizer", real)
        vocab_size = len(tokenizer)
        bad = [token for token in ids if not 0 <= token < vocab_size]
        if bad:
            raise RequestRefused(f"'prompt' holds token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                                 param="prompt")
        self._real = tokenizer
        self._ids = list(ids)

    @property
    def __class__(self) -> type:  # isinstance(processor, PreTrainedTokenizerBase) still holds
        return self._real.__class__

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return {"input_ids": list(self._ids), "attention_mask": [1] * len(self._ids)}
