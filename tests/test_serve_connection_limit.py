"""``--limit-concurrency`` and the file-descriptor limit (issue 33 item 3): the default cap leaves
descriptors for the process and for accepts in flight; a cap the limit cannot hold is refused."""

from __future__ import annotations

import contextlib
import resource

import pytest

from kvplug.interface import InvalidArgumentError


@contextlib.contextmanager
def _soft_limit(soft: int):
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_the_default_cap_follows_the_descriptor_limit():
    pytest.importorskip("torch")
    from kvplug_transformers.serve_options import ACCEPT_BACKLOG, DESCRIPTOR_RESERVE, ServeOptions

    with _soft_limit(400):
        assert ServeOptions().connection_limit() == 400 - DESCRIPTOR_RESERVE - ACCEPT_BACKLOG
        assert ServeOptions(limit_concurrency=50).connection_limit() == 50
        with pytest.raises(InvalidArgumentError, match="ulimit -n 400"):
            ServeOptions(limit_concurrency=1000).connection_limit()
    with _soft_limit(min(100_000, resource.getrlimit(resource.RLIMIT_NOFILE)[1])):
        assert ServeOptions().connection_limit() <= 4096


@pytest.mark.parametrize("field, value", [
    ("limit_concurrency", 0), ("limit_concurrency", True), ("timeout_header", float("nan")),
    ("timeout_body", 0), ("stream_stall_timeout", float("inf")), ("timeout_keep_alive", -1),
    ("stats_interval", float("nan")),
])
def test_bad_connection_options_are_refused(field, value):
    pytest.importorskip("torch")
    from kvplug_transformers.serve_options import ServeOptions

    with pytest.raises(InvalidArgumentError, match=field.split("_")[0]):
        ServeOptions(**{field: value})
