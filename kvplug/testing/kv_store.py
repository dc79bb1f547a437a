"""Conformance kit for shared KV stores (issue 30): the checks the built-in ``redis`` and ``memory`` pass.

A store author runs it against a factory returning a store (connected to a live server)::

    from kvplug.testing import check_kv_store
    check_kv_store(lambda: MyStore(kvplug.KVStoreConfig("mystore://127.0.0.1:1234")))

or one pytest test per check (``parametrize_kv_store_checks``). Every check writes under fresh
random keys, so a store holding other data (a shared server) is fine. ``shared=True`` (default)
also checks that a second store built by the factory reads what the first wrote, the property a
fleet relies on; pass ``shared=False`` for a store that lives in one object.
"""

from __future__ import annotations

import random
import uuid
from typing import Callable, NamedTuple

from kvplug.interface.errors import InvalidArgumentError
from kvplug.interface.kv_store import BaseKVStore

KVStoreFactory = Callable[[], BaseKVStore]


def _keys(count: int) -> list[str]:
    run = uuid.uuid4().hex
    return [f"kvplug-kit:{run}:{index}" for index in range(count)]


def _pages(count: int, rng: random.Random, size: int = 300) -> list[bytes]:
    # every byte value, CR/LF and NUL included: a text protocol must not mangle them
    return [bytes(rng.randrange(256) for _ in range(rng.randrange(1, size))) + b"\r\n\0" for _ in range(count)]


def _built(factory: KVStoreFactory) -> BaseKVStore:
    store = factory()
    assert isinstance(store, BaseKVStore), f"the factory returned {type(store).__name__}, not a kvplug.BaseKVStore"
    return store


def round_trip_is_byte_identical(factory: KVStoreFactory) -> None:
    """Pages come back from ``get`` exactly as ``put`` stored them, in key order."""
    store, keys = _built(factory), _keys(8)
    pages = _pages(8, random.Random(1))
    assert store.put(keys, pages) == 8
    got = store.get(keys)
    assert [bytes(page) for page in got] == pages, "get returned different bytes than put stored"
    assert store.get(list(reversed(keys))) == list(reversed(got)), "get must answer in the order of its keys"


def missing_keys_get_none(factory: KVStoreFactory) -> None:
    """A key never stored is ``None`` in ``get``, between stored ones too."""
    store, keys = _built(factory), _keys(3)
    page = _pages(1, random.Random(2))[0]
    assert store.put([keys[1]], [page]) == 1
    assert store.get(keys) == [None, page, None]


def exists_counts_the_stored_prefix(factory: KVStoreFactory) -> None:
    """``exists`` is the number of keys stored from the first on, stopping at the first gap."""
    store, keys = _built(factory), _keys(6)
    pages = _pages(6, random.Random(3))
    store.put([keys[0], keys[1], keys[3]], [pages[0], pages[1], pages[3]])
    assert store.exists(keys) == 2
    assert store.exists(keys[:2]) == 2
    assert store.exists(keys[2:]) == 0
    assert store.exists(keys[3:4]) == 1
    assert store.exists([]) == 0


def empty_batches_do_nothing(factory: KVStoreFactory) -> None:
    """Empty batches answer 0 / 0 / [] and change nothing."""
    store = _built(factory)
    assert store.put([], []) == 0
    assert store.get([]) == []
    assert store.exists([]) == 0


def put_overwrites(factory: KVStoreFactory) -> None:
    """A second ``put`` of a key replaces its value (a page recomputed after a corrupt read)."""
    store, keys = _built(factory), _keys(1)
    first, second = _pages(2, random.Random(4))
    store.put(keys, [first])
    store.put(keys, [second])
    assert store.get(keys) == [second]


def bad_batches_are_rejected(factory: KVStoreFactory) -> None:
    """Mismatched lengths, non-bytes or empty pages and non-str keys raise ``InvalidArgumentError``
    and store nothing."""
    store, keys = _built(factory), _keys(2)
    page = _pages(1, random.Random(5))[0]
    for bad_keys, bad_pages in ((keys, [page]), (keys, [page, "text"]), (keys, [page, b""]), ([keys[0], 7], [page, page])):
        _expect_invalid(lambda: store.put(bad_keys, bad_pages), "put of a malformed batch")
    assert store.exists(keys) == 0 and store.get(keys) == [None, None], "a rejected put stored something"
    _expect_invalid(lambda: store.get(keys[0]), "get of one str (not a batch of keys)")


def _expect_invalid(call: Callable[[], object], what: str) -> None:
    try:
        call()
    except InvalidArgumentError:
        return
    raise AssertionError(f"{what} did not raise kvplug.InvalidArgumentError")


def large_values_round_trip(factory: KVStoreFactory) -> None:
    """A multi-MiB page (a real page of a large model) round-trips intact."""
    store, keys = _built(factory), _keys(2)
    rng = random.Random(6)
    pages = [rng.randbytes(4 * 1024 * 1024 + 1), rng.randbytes(1024 * 1024)]
    assert store.put(keys, pages) == 2
    assert store.get(keys) == pages


def second_store_reads_what_the_first_wrote(factory: KVStoreFactory) -> None:
    """Two stores built by the factory share pages (another server reads them back)."""
    writer, reader, keys = _built(factory), _built(factory), _keys(4)
    pages = _pages(4, random.Random(7))
    writer.put(keys, pages)
    writer.close()
    assert reader.exists(keys) == 4 and reader.get(keys) == pages, "a second store did not read the first one's pages"


def corrupt_values_are_misses(factory: KVStoreFactory) -> None:
    """Through ``RemoteKV``, a value damaged in the store (flipped byte, truncated, another key's
    value) is a counted miss, never a loaded page."""
    from kvplug.kv_store import KVNamespace, RemoteKV

    store = _built(factory)
    remote = RemoteKV(store, KVNamespace(f"kit-{uuid.uuid4().hex}", "kit", 2, "int8"))
    prompt = list(range(8))
    payloads = _pages(4, random.Random(8))
    assert remote.store_pages(prompt, payloads) == 4
    assert [bytes(page) for page in remote.load(prompt, 0, 4)] == payloads
    keys = remote.keys(prompt)
    value = bytearray(store.get([keys[1]])[0])
    value[-1] ^= 0x40
    store.put([keys[1]], [bytes(value)])
    store.put([keys[3]], store.get([keys[2]]))  # a valid value under the wrong key
    assert [bytes(page) for page in remote.load(prompt, 0, 4)] == payloads[:1]
    assert [bytes(page) for page in remote.load(prompt, 2, 2)] == payloads[2:3]
    store.put([keys[0]], [store.get([keys[0]])[0][:-1]])  # truncated
    assert remote.load(prompt, 0, 4) == []
    assert remote.stats.corrupt_pages == 3


def randomised_differential(factory: KVStoreFactory) -> None:
    """300 random put / get / exists batches agree with a dict after each one (seeded)."""
    store, keys = _built(factory), _keys(24)
    rng = random.Random(9)
    model: dict[str, bytes] = {}
    for step in range(300):
        batch = rng.sample(keys, rng.randrange(0, 6))
        operation = rng.choice(("put", "get", "exists"))
        if operation == "put":
            pages = _pages(len(batch), rng, size=40)
            assert store.put(batch, pages) == len(batch), f"step {step}: put kept fewer pages than given"
            model.update(zip(batch, pages))
        elif operation == "get":
            assert store.get(batch) == [model.get(key) for key in batch], f"step {step}: get disagrees"
        else:
            expected = 0
            while expected < len(batch) and batch[expected] in model:
                expected += 1
            assert store.exists(batch) == expected, f"step {step}: exists disagrees"


class KVStoreCheck(NamedTuple):
    """One named check; ``run`` raises ``AssertionError`` naming it on failure."""

    name: str
    description: str
    function: Callable[[KVStoreFactory], None]

    def run(self, factory: KVStoreFactory) -> None:
        try:
            self.function(factory)
        except Exception as error:
            raise AssertionError(
                f"kv-store check {self.name!r} failed: "
                f"{type(error).__name__ + ': ' if not isinstance(error, AssertionError) else ''}{error}"
            ) from error

    def __repr__(self) -> str:
        return f"KVStoreCheck({self.name!r})"


_CATALOGUE = (
    round_trip_is_byte_identical,
    missing_keys_get_none,
    exists_counts_the_stored_prefix,
    empty_batches_do_nothing,
    put_overwrites,
    bad_batches_are_rejected,
    large_values_round_trip,
    corrupt_values_are_misses,
    randomised_differential,
)


def kv_store_checks(*, shared: bool = True) -> list[KVStoreCheck]:
    functions = _CATALOGUE + ((second_store_reads_what_the_first_wrote,) if shared else ())
    return [KVStoreCheck(f.__name__, (f.__doc__ or "").strip().splitlines()[0], f) for f in functions]


def check_kv_store(factory: KVStoreFactory, *, shared: bool = True) -> None:
    """Run every store check against stores built by ``factory``; the first failure raises."""
    for check in kv_store_checks(shared=shared):
        check.run(factory)


def parametrize_kv_store_checks(*, shared: bool = True):
    """``@pytest.mark.parametrize`` over the checks, as the argument ``kv_store_check``."""
    import pytest  # only test code calls this

    checks = kv_store_checks(shared=shared)
    return pytest.mark.parametrize("kv_store_check", checks, ids=[check.name for check in checks])
