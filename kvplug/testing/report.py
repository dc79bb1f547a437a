"""``KitReport``: what a conformance-kit run checked, returned when every check passed (a silent
pass said nothing of what ran: issue 29)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KitReport:
    """A passed run of ``check_prefix_cache`` / ``check_tiered_prefix_cache``.

    Attributes:
        suite: which suite ran (``"prefix cache"`` or ``"tiered prefix cache"``).
        cache: the factory checked, by name.
        page_sizes: the page sizes every check ran at.
        checks: the names of the checks that ran, in order.
        left_out: ``(check, why)`` for the checks the options left out.
        runs: check runs that passed (checks x page sizes, random seeds counted one each).
    """

    suite: str
    cache: str
    page_sizes: tuple[int, ...]
    checks: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...]
    runs: int

    def describe(self) -> str:
        sizes = ", ".join(str(size) for size in self.page_sizes)
        text = (f"kvplug conformance kit ({self.suite}): {self.cache} passed {len(self.checks)} checks at page sizes "
                f"{sizes} ({self.runs} runs): {', '.join(self.checks)}")
        if self.left_out:
            text += "; left out: " + ", ".join(f"{name} ({why})" for name, why in self.left_out)
        return text

    def __str__(self) -> str:
        return self.describe()


def factory_name(factory: object) -> str:
    """A factory as a person names it: its qualified name, or its type's."""
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    module = getattr(factory, "__module__", None)
    return f"{module}.{name}" if module and module != "__main__" else name
