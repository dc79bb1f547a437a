"""The shared KV store under the radix tree's host tier (issue 30): what goes down, what comes up.

Writes: through from the host tier. When ``evict`` has copied evicted pages into host memory
(``HostTier.finish_evict``), the same pages go to the store: their bytes are on the host then, so
the write reads no GPU memory, and every prefix that leaves the device reaches the fleet (writing
only when the host tier drops pages would keep hot prefixes from the other servers until both
tiers of one server had filled). A node loaded back keeps its host copy, so evicting it again
writes nothing. Reads: at admission, after the device and host tiers matched what they hold, the
rest of the prompt's whole pages are looked up in the store; the pages found are copied into free
host pages (the matched path locked meanwhile) and hung below the match as a host-resident leaf,
so the host tier's own loads (overlapped, as for any host hit) bring them to the device.

A store fault is a miss or a dropped write (``RemoteKV``); the tree only ever holds pages that
arrived intact. CPU pools only for now: on CUDA the write-back's copy is asynchronous and the
store write would have to wait for it (not on the serving thread: next step).
"""

from __future__ import annotations

import numpy as np

from kvplug.kv_store.host_pages import fill_host_pages, host_page_payloads
from kvplug.kv_store.remote import RemoteKV
from kvplug.prefix_cache.radix_keys import BYTES_PER_TOKEN
from kvplug.prefix_cache.radix_node import RadixNode


class RemoteTierLink:
    """Moves pages between one host tier (``HostTier``) and one ``RemoteKV``."""

    def __init__(self, host_tier, remote: RemoteKV) -> None:
        self.host_tier = host_tier
        self.remote = remote
        self.fetched_tokens = 0  # tokens hung into the tree from the store

    def counters(self) -> dict[str, int]:
        """The ``remote_*`` fields of ``TierStats``."""
        stats = self.remote.stats
        errors = (stats.errors_unavailable + stats.errors_timeout + stats.errors_full + stats.errors_auth
                  + stats.errors_protocol + stats.errors_other)
        return dict(remote_hit_tokens=self.fetched_tokens, remote_written_pages=stats.written_pages,
                    remote_dropped_pages=stats.dropped_pages, remote_corrupt_pages=stats.corrupt_pages,
                    remote_errors=errors)

    def write_back(self, written: list[tuple[RadixNode, np.ndarray]]) -> None:
        """``written``: nodes just copied to host memory, with their host pages: store them."""
        tree = self.host_tier.tree
        page_size = tree.page_size
        for node, host_pages in written:
            if node.parent is None:  # dropped meanwhile
                continue
            tokens = _path_tokens(node)
            start_page = (node.cached_len - node.num_tokens) // page_size
            self.remote.store_pages(tokens, host_page_payloads(self.host_tier.pool, host_pages), start_page)

    def fetch(self, node: RadixNode, prompt: np.ndarray) -> RadixNode:
        """Extend the match ``node`` of ``prompt`` (int32 token ids) with the pages the store holds
        after it; the deepest node of the match then (``node`` when the store has nothing)."""
        tier, tree = self.host_tier, self.host_tier.tree
        page_size = tree.page_size
        usable = prompt[: prompt.shape[0] - prompt.shape[0] % page_size]
        start_page = node.cached_len // page_size
        if node.cached_len >= usable.shape[0]:
            return node
        count = self.remote.lookup(usable, start_page)
        if count == 0:
            return node
        tree.lock_handle(node)  # reserving host pages may drop host leaves: not this path
        try:
            pages = tier.reserve_host_pages(count)
            if pages is None:
                return node
            payloads = self.remote.load(usable, start_page, count)
            filled = fill_host_pages(tier.pool, pages[: len(payloads)], payloads) if payloads else 0
            if filled < len(pages):
                tier.pool.release(pages[filled:])
            if filled == 0:
                return node
            begin, end = node.cached_len, node.cached_len + filled * page_size
            host_locations = (pages[:filled, None] * page_size + np.arange(page_size)).astype(np.int32).reshape(-1)
            leaf = tree.add_host_leaf(node, usable[begin:end].tobytes(), host_locations.tobytes(), end)
            self.fetched_tokens += end - begin
            return leaf
        finally:
            tree.lock_handle(node, unlock=True)


def _path_tokens(node: RadixNode) -> np.ndarray:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    keys.reverse()
    return np.frombuffer(b"".join(keys), dtype=np.int32) if keys else np.empty(0, dtype=np.int32)


assert BYTES_PER_TOKEN == 4  # keys are int32 token ids
