"""A page-hash prefix cache: one entry per cached page, keyed by (parent entry id, page token ids)."""

from __future__ import annotations

import itertools

import torch

import kvplug


class PageEntry:
    """One cached page. ``locations``: shape [page_size], int32, cpu."""

    __slots__ = ("entry_id", "parent", "locations", "lock_count", "own_locks", "children", "last_access")

    def __init__(self, entry_id: int, parent: "PageEntry | None", locations: torch.Tensor, now: int) -> None:
        self.entry_id = entry_id
        self.parent = parent
        self.locations = locations
        self.lock_count = 0
        self.own_locks = 0
        self.children = 0
        self.last_access = now


class PageHashHandle(kvplug.BaseCacheHandle):
    def __init__(self, chain: list[PageEntry], page_size: int, device: torch.device) -> None:
        self.chain = chain
        self.cached_len = len(chain) * page_size
        self._device = device

    def get_matched_indices(self) -> torch.Tensor:
        if not self.chain:
            return torch.empty(0, dtype=torch.int32, device=self._device)
        return torch.cat([entry.locations for entry in self.chain]).to(self._device)


class PageHashPrefixCache(kvplug.BasePrefixCache):
    def __init__(self, config: kvplug.PrefixCacheConfig) -> None:
        if config.options:
            raise kvplug.InvalidArgumentError(f"page-hash takes no options, got {sorted(config.options)}")
        self.page_size = config.page_size
        self.device = config.device
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self._entries: dict[tuple, PageEntry] = {}

    def _pages(self, input_ids: torch.Tensor) -> list[tuple[int, ...]]:
        ids = input_ids.tolist()
        usable = len(ids) - len(ids) % self.page_size
        return [tuple(ids[start : start + self.page_size]) for start in range(0, usable, self.page_size)]

    def _walk(self, pages: list[tuple[int, ...]]) -> list[PageEntry]:
        chain: list[PageEntry] = []
        for page in pages:
            entry = self._entries.get((chain[-1].entry_id if chain else 0, page))
            if entry is None:
                break
            chain.append(entry)
        return chain

    def _check(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.dim() != 1 or tensor.dtype != torch.int32 or tensor.device != self.device:
            raise kvplug.InvalidArgumentError(
                f"{name} must be 1-D int32 on {self.device}, got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
            )

    def match_prefix(self, input_ids: torch.Tensor) -> kvplug.MatchResult:
        self._check(input_ids, "input_ids")
        chain = self._walk(self._pages(input_ids))
        now = next(self._clock)
        for entry in chain:
            entry.last_access = now
        return kvplug.MatchResult(PageHashHandle(chain, self.page_size, self.device))

    def lock_handle(self, handle: kvplug.BaseCacheHandle, unlock: bool = False) -> None:
        if not isinstance(handle, PageHashHandle) or not isinstance(unlock, bool):
            raise kvplug.InvalidArgumentError(f"expected a page-hash handle and a bool, got {handle!r}, {unlock!r}")
        if not handle.chain:
            return
        last = handle.chain[-1]
        # the last page counts the locks taken on handles ending there: a prefix of a locked handle
        # that was never locked itself has none to release
        if unlock and last.own_locks == 0:
            raise kvplug.InvalidArgumentError("unlock of a handle that is not locked")
        last.own_locks += -1 if unlock else 1
        for entry in handle.chain:
            entry.lock_count += -1 if unlock else 1

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> kvplug.InsertResult:
        self._check(input_ids, "input_ids")
        self._check(indices, "indices")
        if len(input_ids) != len(indices) or len(input_ids) % self.page_size:
            raise kvplug.InvalidArgumentError(
                f"expected equal lengths that are multiples of {self.page_size}, got {len(input_ids)} and {len(indices)}"
            )
        if len(indices) and (int(indices.min()) < 0 or indices.unique().numel() != len(indices)):
            raise kvplug.InvalidArgumentError(f"indices must be distinct non-negative locations, got {indices.tolist()}")
        pages = self._pages(input_ids)
        chain = self._walk(pages)
        cached_len = len(chain) * self.page_size
        now = next(self._clock)
        locations = indices.to("cpu")
        for number in range(len(chain), len(pages)):
            parent = chain[-1] if chain else None
            start = number * self.page_size
            entry = PageEntry(next(self._ids), parent, locations[start : start + self.page_size].clone(), now)
            self._entries[(parent.entry_id if parent else 0, pages[number])] = entry
            if parent is not None:
                parent.children += 1
            chain.append(entry)
        for entry in chain:
            entry.last_access = now
        return kvplug.InsertResult(cached_len, PageHashHandle(chain, self.page_size, self.device))

    def evict(self, size: int) -> torch.Tensor:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise kvplug.InvalidArgumentError(f"evict size must be an int >= 0, got {size!r}")
        if size > self.size_info.evictable_size:
            raise kvplug.InvalidArgumentError(
                f"cannot evict {size} tokens: only {self.size_info.evictable_size} are evictable"
            )
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < size:
            key, victim = min(
                ((key, entry) for key, entry in self._entries.items() if entry.children == 0 and entry.lock_count == 0),
                key=lambda item: item[1].last_access,
            )
            del self._entries[key]
            if victim.parent is not None:
                victim.parent.children -= 1
            freed.append(victim.locations)
            evicted += self.page_size
        if not freed:
            return torch.empty(0, dtype=torch.int32, device=self.device)
        return torch.cat(freed).to(self.device)

    @property
    def size_info(self) -> kvplug.SizeInfo:
        locked = sum(1 for entry in self._entries.values() if entry.lock_count > 0)
        return kvplug.SizeInfo(
            evictable_size=(len(self._entries) - locked) * self.page_size, protected_size=locked * self.page_size
        )

    def check_integrity(self) -> None:
        children: dict[int, int] = {}
        for entry in self._entries.values():
            assert entry.lock_count >= entry.own_locks >= 0, "negative lock count, or fewer than its own locks"
            assert entry.locations.numel() == self.page_size, "entry is not one page"
            if entry.parent is not None:
                children[entry.parent.entry_id] = children.get(entry.parent.entry_id, 0) + 1
                assert entry.parent.lock_count >= entry.lock_count, "child locked more than its parent"
        for entry in self._entries.values():
            assert children.get(entry.entry_id, 0) == entry.children, "child count out of date"
