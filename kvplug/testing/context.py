"""What every conformance check receives: the factory, the settings, and small tensor helpers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvplug.interface import BaseCacheHandle, BasePrefixCache, PrefixCacheConfig

PrefixCacheFactory = Callable[[PrefixCacheConfig], BasePrefixCache]


@dataclass(frozen=True)
class CheckContext:
    """Settings of one check run.

    Attributes:
        factory: builds the cache under test from a ``PrefixCacheConfig``.
        page_size: the page size the caches are built with.
        device: device of every tensor passed to and expected from the cache.
        keeps_entries: ``False`` for a cache that keeps nothing (like ``naive``).
        lru: check least-recently-used eviction order (``False`` for other policies).
        slow: run the randomised check longer.
        shrink: let hypothesis shrink a failing random example to a minimal one (slower to fail).
    """

    factory: PrefixCacheFactory
    page_size: int
    device: torch.device
    keeps_entries: bool = True
    lru: bool = True
    slow: bool = False
    shrink: bool = True

    def new_cache(self) -> BasePrefixCache:
        config = PrefixCacheConfig(device=self.device, page_size=self.page_size)
        cache = self.factory(config)
        assert isinstance(cache, BasePrefixCache), (
            f"the factory must return a kvplug.BasePrefixCache, got {type(cache).__name__}"
        )
        assert tuple(cache.size_info) == (0, 0), f"a new cache must be empty, got {cache.size_info}"
        return cache

    def page_tokens(self, symbol: int) -> list[int]:
        """Token ids of one page. Symbols >= 0 fill the page with ``symbol + 1``; ``-s`` is the page
        of ``s`` with its last token changed (so the two differ only at the end of the page)."""
        if symbol >= 0:
            return [symbol + 1] * self.page_size
        return [-symbol + 1] * (self.page_size - 1) + [1000 - symbol]

    def tokens(self, pages: Sequence[int], tail: int = 0) -> list[int]:
        """The token ids of ``pages`` followed by ``tail`` tokens of a partial page."""
        tokens = [token for symbol in pages for token in self.page_tokens(symbol)]
        return tokens + [7] * tail

    def tensor(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as shape ``[n]``, int32, on the check's device."""
        return torch.tensor(list(values), dtype=torch.int32, device=self.device)

    def indices_of(self, handle: BaseCacheHandle, what: str) -> list[int]:
        """``handle.get_matched_indices()`` as a list, after checking its type, dtype, device and length."""
        indices = handle.get_matched_indices()
        check_location_tensor(indices, self.device, f"{what}: get_matched_indices()")
        assert indices.shape[0] == handle.cached_len, (
            f"{what}: get_matched_indices() has {indices.shape[0]} locations for cached_len {handle.cached_len}"
        )
        return indices.tolist()


def check_location_tensor(tensor: object, device: torch.device, what: str) -> None:
    """``tensor`` must be shape ``[m]``, int32, on ``device``."""
    assert isinstance(tensor, torch.Tensor), f"{what} must return a torch.Tensor, got {type(tensor).__name__}"
    assert tensor.dim() == 1, f"{what} must be 1-D, got shape {tuple(tensor.shape)}"
    assert tensor.dtype == torch.int32, f"{what} must be int32, got {tensor.dtype}"
    assert tensor.device.type == device.type, f"{what} must be on {device}, got {tensor.device}"


def check_equal(actual: object, expected: object, what: str) -> None:
    assert actual == expected, f"{what}: expected {expected!r}, got {actual!r}"


def check_sizes(cache: BasePrefixCache, evictable: int, protected: int, what: str) -> None:
    info = cache.size_info
    actual = (info.evictable_size, info.protected_size)
    assert actual == (evictable, protected), (
        f"{what}: expected size_info evictable={evictable} protected={protected}, "
        f"got evictable={actual[0]} protected={actual[1]}"
    )


def expect_rejected(call: Callable[[], object], what: str) -> None:
    """``call`` must raise an error (not ``AssertionError``, which would hide a broken invariant)."""
    try:
        call()
    except AssertionError:
        raise
    except Exception:
        return
    raise AssertionError(f"{what} must raise an error, but it returned normally")
