"""The shared KV store under the radix tree's host tier (issue 30): what goes down, what comes up.

Writes: through from the host tier. When ``evict`` has queued the copy of evicted pages into host
memory (``HostTier.finish_evict``), the same pages go to the store: their bytes are on the host
then, so the write reads no GPU memory, and every prefix that leaves the device reaches the fleet
(writing only when the host tier drops pages would keep hot prefixes from the other servers until
both tiers of one server had filled). A node loaded back keeps its host copy, so evicting it
again writes nothing. The write itself is the ``StoreWriter``'s: the serving thread computes the
keys' tokens, pins the node's host pages (``HostPagePins``) and hands both over with the copy's
ticket; on a CUDA pool a writer thread waits for the copy (the serving thread never waits for the
device) and for the store, on a CPU pool the write is made at once (``StoreWriter``).

Reads: at admission, after the device and host tiers matched what they hold, the rest of the
prompt's whole pages come from the store; they are copied into free host pages (the matched path
locked meanwhile) and hung below the match as a host-resident leaf, so the host tier's own loads
(overlapped, as for any host hit) bring them to the device. Where the bytes come from:

- *Prefetched* (``prefetch``, called by the host when the request was queued): the
  ``StoreReader``'s thread looked the pages up and got them meanwhile, so the admission makes no
  network call: it copies the staged pages. A prefetch still running is waited for at most
  ``timeout_s`` (``remote_kv_prefetch_timeout_s``), then the prompt is a miss for the store (never
  a second, blocking read: that would add the network to the wait).
- *Not prefetched* (no ``prefetch`` of this prompt, or its prefetch was dropped to bound memory):
  the lookup and the get are made at admission, blocking network calls on the serving thread (the
  one blocking path, counted ``remote_blocking_reads``). Kept rather than made a miss because a
  store read costs far less than the prefill it saves (BENCHMARKS.md, "Shared KV store"), and
  hosts that never prefetch (version-1 hosts, ``lookup`` / ``cached_prefix_len`` callers) keep
  their store hits; a host that prefetches every prompt reaches it only for dropped prefetches.

The copy to the device is the host tier's, asynchronous. On CUDA the host pages filled from the
CPU must not be touched by a copy still running: when one is (``HostKVPool.pages_busy``, which
never waits), the store's pages are not used for that prompt (a miss).

A store fault is a miss or a dropped write (``RemoteKV``); the tree only ever holds pages that
arrived intact.
"""

from __future__ import annotations

import numpy as np

from kvplug.kv_store.host_pages import fill_host_pages
from kvplug.kv_store.remote import RemoteKV
from kvplug.prefix_cache.radix_keys import BYTES_PER_TOKEN
from kvplug.prefix_cache.radix_node import RadixNode
from kvplug.prefix_cache.store_reader import NONE, READY, TIMED_OUT, StoreReader
from kvplug.prefix_cache.store_writer import StoreWrite, StoreWriter


class RemoteTierLink:
    """Moves pages between one host tier (``HostTier``) and one ``RemoteKV``.

    Args:
        writer: writes the pages (``StoreWriter`` over ``remote`` and the tier's host pool).
        reader: prefetches pages for queued prompts (``StoreReader`` over ``remote``).
        timeout_s: how long an admission waits for its prefetch still running.
    """

    def __init__(self, host_tier, remote: RemoteKV, writer: StoreWriter, reader: StoreReader,
                 timeout_s: float) -> None:
        self.host_tier = host_tier
        self.remote = remote
        self.writer = writer
        self.reader = reader
        self.timeout_s = float(timeout_s)
        self.fetched_tokens = 0  # tokens hung into the tree from the store
        self.prefetched_tokens = 0  # of those, tokens the reader had staged (no store call at admission)
        self.blocking_reads = 0  # admissions that read the store on the serving thread
        self.busy_skips = 0  # store reads not made: a copy was still using the host pages (CUDA)

    def counters(self) -> dict[str, int]:
        """The ``remote_*`` fields of ``TierStats``."""
        stats = self.remote.stats
        reads = self.reader.stats
        errors = (stats.errors_unavailable + stats.errors_timeout + stats.errors_full + stats.errors_auth
                  + stats.errors_protocol + stats.errors_other + reads.errors)
        return dict(remote_hit_tokens=self.fetched_tokens, remote_written_pages=stats.written_pages,
                    remote_dropped_pages=stats.dropped_pages + stats.unwritten_pages,
                    remote_corrupt_pages=stats.corrupt_pages, remote_errors=errors,
                    remote_queued_pages=stats.queued_pages, remote_prefetches=reads.prefetches,
                    remote_prefetch_hit_tokens=self.prefetched_tokens, remote_prefetch_timeouts=reads.timeouts,
                    remote_prefetch_dropped=reads.dropped, remote_prefetch_staged_bytes=reads.staged_bytes,
                    remote_blocking_reads=self.blocking_reads)

    def prefetch(self, prompt: np.ndarray) -> bool:
        """Start reading the store's pages of ``prompt`` (int32 token ids, host, as it will be
        admitted) for its admission; any thread, never waits, never touches the tree. ``False``:
        nothing started (no whole page, or already prefetched)."""
        return self.reader.submit(prompt)

    def write_back(self, written: list[tuple[RadixNode, np.ndarray]], ticket: int | None) -> None:
        """``written``: nodes whose copy to host memory was just queued (``ticket``, from
        ``HostKVPool.write``), with their host pages: hand them to the writer; never waits."""
        tier = self.host_tier
        page_size = tier.tree.page_size
        for node, host_pages in written:
            if node.parent is None:  # dropped meanwhile
                continue
            tokens = _path_tokens(node)
            start_page = (node.cached_len - node.num_tokens) // page_size
            self.writer.submit(StoreWrite(tokens, start_page, tier.pins.pin(host_pages), ticket))

    def fetch(self, node: RadixNode, prompt: np.ndarray) -> RadixNode:
        """Extend the match ``node`` of ``prompt`` (int32 token ids) with the pages the store holds
        after it; the deepest node of the match then (``node`` when the store has nothing)."""
        tier, tree = self.host_tier, self.host_tier.tree
        page_size = tree.page_size
        usable = prompt[: prompt.shape[0] - prompt.shape[0] % page_size]
        start_page = node.cached_len // page_size
        if node.cached_len >= usable.shape[0]:
            return node
        taken = self.reader.take(usable, start_page, self.timeout_s)
        if taken.status == TIMED_OUT:
            return node
        staged = taken.status == READY
        if staged:
            count = len(taken.payloads)
        else:
            assert taken.status == NONE
            self.blocking_reads += 1
            count = self.remote.lookup(usable, start_page)
        if count == 0:
            return node
        tree.lock_handle(node)  # reserving host pages may drop host leaves: not this path
        try:
            pages = tier.reserve_host_pages(count)
            if pages is None:
                return node
            if tier.pool.pages_busy(pages):  # CUDA: a copy still reads or writes them; never wait for it
                tier.pool.release(pages)
                self.busy_skips += 1
                return node
            payloads = taken.payloads if staged else self.remote.load(usable, start_page, count)
            filled = fill_host_pages(tier.pool, pages[: len(payloads)], payloads) if payloads else 0
            if filled < len(pages):
                tier.pool.release(pages[filled:])
            if filled == 0:
                return node
            begin, end = node.cached_len, node.cached_len + filled * page_size
            host_locations = (pages[:filled, None] * page_size + np.arange(page_size)).astype(np.int32).reshape(-1)
            leaf = tree.add_host_leaf(node, usable[begin:end].tobytes(), host_locations.tobytes(), end)
            self.fetched_tokens += end - begin
            if staged:
                self.prefetched_tokens += end - begin
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
