"""Two real SGLang 0.5.23 servers on the CPU sharing a password-protected ``redis-server`` through
``--kvplug-remote-kv`` (issue 30).

The first server (kvplug pool of 256 tokens, host tier) serves ten distinct 100-token prompts: the
pool's evictions go to its host tier and through it to the store; it stops. The second, started
fresh with the same store and served-model name, never computed anything: its first request for
the first prompt is answered from the store (``cached_tokens`` 99 of 100), with the first server's
greedy tokens. Neither server's log, nor SGLang's ``/server_info`` (the kept launch command),
holds the password.
"""

from __future__ import annotations

import pytest

from tests.redis_server import REDIS_SERVER, SKIP_REASON, redis_server
from tests.sglang_helpers import import_sglang

import_sglang()

from tests.sglang_models import build_model  # noqa: E402
from tests.sglang_server import Server  # noqa: E402

PASSWORD = "pw-sglang-server-30"
PROMPTS = [f"{number}: " + chr(ord("a") + number) * 97 for number in range(10)]  # 100 tokens each
MAX_NEW_TOKENS = 4
FLAGS = (
    "--kv-backend", "kvplug", "--kvplug-attention", "torch", "--max-total-tokens", "256",
    "--max-running-requests", "2", "--kvplug-host-memory", "16MiB", "--served-model-name", "tiny-llama",
)  # fmt: skip

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)


def server_info(server: Server) -> str:
    import requests

    for path in ("/server_info", "/get_server_info"):
        answer = requests.get(server.url + path, timeout=30)
        if answer.status_code == 200:
            return answer.text
    raise AssertionError("SGLang answered neither /server_info nor /get_server_info")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-remote-kv")
    model = build_model("llama", root / "llama")
    with redis_server("--requirepass", PASSWORD) as (port, _):
        url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
        first = Server(model, root / "first.log", *FLAGS, "--kvplug-remote-kv", url).start()
        try:
            first_answers = [first.generate(prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
            first_info = server_info(first)
        finally:
            first_status = first.stop()
        second = Server(model, root / "second.log", *FLAGS, "--kvplug-remote-kv", url).start()
        try:
            second_answer = second.generate(PROMPTS[0], MAX_NEW_TOKENS)
            second_info = server_info(second)
        finally:
            second_status = second.stop()
    return dict(first=(first, first_answers, first_info, first_status),
                second=(second, second_answer, second_info, second_status))


def test_the_second_server_loads_the_first_ones_prefix_from_the_store(runs):
    first_answers = runs["first"][1]
    second_answer = runs["second"][1]
    assert first_answers[0]["meta_info"]["cached_tokens"] < 10  # the first server computed it
    # the second server never saw the prompt: all but the last token (SGLang computes one) came from the store
    assert second_answer["meta_info"]["cached_tokens"] == len(PROMPTS[0]) - 1, runs["second"][0].log_tail()
    assert second_answer["output_ids"] == first_answers[0]["output_ids"]
    log = runs["second"][0].log.read_text(errors="replace")
    assert "kvplug-sglang: shared KV store redis://***@127.0.0.1:" in log, runs["second"][0].log_tail()


def test_the_password_is_in_no_log_and_not_in_server_info(runs):
    for name in ("first", "second"):
        server, _, info, status = runs[name]
        log = server.log.read_text(errors="replace")
        assert PASSWORD not in log and PASSWORD not in info, name
        assert "--kvplug-remote-kv" in info and "redis://***@127.0.0.1:" in info  # the kept command line, redacted
        assert "Traceback" not in log, server.log_tail()
        assert status == 0, f"{name}: exit status {status}"
