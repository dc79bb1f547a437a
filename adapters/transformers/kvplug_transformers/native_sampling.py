"""What a request may ask of ``kvplug serve --kv-backend native``'s sampling (issue 29 item 2).

transformers' continuous batching samples every request with the one generation config its
worker started with (the checkpoint's ``generation_config.json``); only kvplug's cache samples
per request. So on the native cache a request's OpenAI / vLLM sampling fields are checked against
that config *before* transformers translates them (its ``frequency_penalty`` becomes a
``repetition_penalty``, which is why the refusal must speak of the field the client sent): a field
that asks for what the server does anyway is served (and vLLM's extras, unknown to transformers'
handler, dropped from the body), any other is a 400 naming the field, the server's setting and the
way out. ``worker_watch.ServerSampling`` stays the check of record at the worker.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvplug_transformers.request_limits import RequestRefused

EXTRAS = ("top_k", "min_p", "repetition_penalty")  # vLLM's fields transformers' handler does not know
WAY_OUT = "serve with --kv-backend kvplug (the default), which samples each request its own way"


class NativeSampling(NamedTuple):
    """The worker's one sampling setting. ``greedy``: argmax, the other fields play no part."""

    greedy: bool
    temperature: float
    top_p: float
    top_k: int  # 0: none
    min_p: float  # 0.0: none
    repetition_penalty: float  # 1.0: none

    @classmethod
    def of(cls, config: Any) -> "NativeSampling":
        def value(name: str, off: float) -> float:
            found = getattr(config, name, None)
            return off if found is None else found

        temperature = float(value("temperature", 1.0))
        return cls(not getattr(config, "do_sample", False) or temperature == 0, temperature, float(value("top_p", 1.0)),
                   max(int(value("top_k", 0)), 0), float(value("min_p", 0.0)), float(value("repetition_penalty", 1.0)))

    def describe(self) -> str:
        shown = ["greedy"] if self.greedy else [f"temperature {self.temperature:g}", f"top_p {self.top_p:g}"]
        if not self.greedy and self.top_k:
            shown.append(f"top_k {self.top_k}")
        if not self.greedy and self.min_p:
            shown.append(f"min_p {self.min_p:g}")
        if self.repetition_penalty != 1.0:
            shown.append(f"repetition_penalty {self.repetition_penalty:g}")
        return ", ".join(shown)

    def check(self, body: dict) -> None:
        """Raise ``RequestRefused`` (400, ``param`` the field) for sampling this worker would not
        apply; drop from ``body`` the vLLM extras it does apply (they equal its setting)."""
        greedy_request = body.get("temperature") == 0
        if self.greedy and not greedy_request:
            # temperature unset means 1 in OpenAI's API: top_p / top_k / min_p then ask for sampling
            self._expect(body, "temperature", None, "send temperature 0 or leave it out")
            for name, off in (("top_p", 1.0), ("top_k", None), ("min_p", None)):
                self._expect(body, name, off, f"leave {name} out (or send it with temperature 0)")
        elif greedy_request and not self.greedy:
            self._refuse("temperature", 0, f"send temperature {self.temperature:g} or leave it out")
        elif not greedy_request:
            for name, served in (("temperature", self.temperature), ("top_p", self.top_p),
                                 ("top_k", self.top_k or None), ("min_p", self.min_p or None)):
                shown = "off" if served is None else f"{served:g}"
                self._expect(body, name, served, f"send {name} {shown} or leave it out")
            if body.get("seed") is not None:
                self._refuse("seed", body["seed"], "leave seed out (transformers' worker draws from one random stream)")
        self._expect(body, "repetition_penalty", self.repetition_penalty,
                     f"send repetition_penalty {self.repetition_penalty:g} or leave it out")
        for name in ("frequency_penalty", "presence_penalty"):
            self._expect(body, name, 0.0, f"send {name} 0 or leave it out")
        for name in ("stop", "logit_bias"):
            if body.get(name):
                self._refuse(name, body[name], f"leave {name} out")
        for name in EXTRAS:
            body.pop(name, None)
        if body.get("frequency_penalty") == 0:
            body.pop("frequency_penalty")  # transformers would make it repetition_penalty 1, overriding the server's

    def _expect(self, body: dict, name: str, served: float | None, remedy: str) -> None:
        """Refuse ``body[name]`` unless unset or ``served`` (``None``: off, which top_k / min_p
        spell -1 or 0 in vLLM's API)."""
        value = body.get(name)
        if value is None or _same(value, served) or (served is None and name in ("top_k", "min_p") and value in (-1, 0)):
            return
        self._refuse(name, value, remedy)

    def _refuse(self, name: str, value: Any, remedy: str) -> None:
        raise RequestRefused(
            f"{name} {value!r} cannot be applied with --kv-backend native: transformers' continuous batching samples "
            f"every request as the model's generation_config.json says ({self.describe()}); {remedy}, or {WAY_OUT}",
            param=name,
        )


def _same(value: Any, served: float | None) -> bool:
    if served is None:
        return False
    try:
        return abs(float(value) - float(served)) <= 1e-6 * max(1.0, abs(float(served)))
    except (TypeError, ValueError):
        return False
