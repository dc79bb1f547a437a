"""Sizing the host-memory tier at start-up: at least one page, and no more than the machine has free.

A tier below one KV page holds nothing, and one beyond free host memory either fails its first
allocation or, with memory overcommit, is granted and later kills the process when its pages are
touched; both are start-up errors naming the sizes involved, raised before a server reports healthy
(``kvplug serve`` sizes the tier while planning the pool, ``HostKVPool`` checks again before it
allocates).
"""

from __future__ import annotations

import os

from kvplug.interface import InvalidArgumentError, OutOfMemoryError


def available_host_memory() -> int:
    """Bytes of host memory available to a new allocation now (psutil, else ``/proc/meminfo``, else
    the free physical pages sysconf reports)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_host_tier_fits(tier_bytes: int, available: int | None = None, *, also_needed: int = 0) -> None:
    """``OutOfMemoryError`` naming both sizes when ``tier_bytes`` (plus ``also_needed`` bytes that
    will be taken from host memory next to it, e.g. a KV pool on the CPU) exceeds ``available``
    (default: ``available_host_memory()``)."""
    available = available_host_memory() if available is None else available
    if tier_bytes + also_needed > available:
        extra = f" plus {also_needed:,} bytes of KV pool in host memory" if also_needed else ""
        raise OutOfMemoryError(
            f"the host-memory tier needs {tier_bytes:,} bytes ({tier_bytes / 2**30:.1f} GiB){extra}, but only "
            f"{available:,} bytes ({available / 2**30:.1f} GiB) of host memory are available; lower --host-memory "
            "(host_memory)"
        )


def host_tier_pages(host_memory: int, page_bytes: int, *, available: int | None = None, also_needed: int = 0) -> int:
    """Pages a tier of ``host_memory`` bytes holds (``host_memory // page_bytes``), checked: at least
    one (else ``InvalidArgumentError`` naming both sizes) and within free host memory."""
    pages = host_memory // page_bytes
    if pages < 1:
        raise InvalidArgumentError(
            f"host_memory={host_memory:,} bytes holds no KV page of {page_bytes:,} bytes (one page of every layer's "
            "K and V): give at least one page"
        )
    check_host_tier_fits(pages * page_bytes, available, also_needed=also_needed)
    return pages
