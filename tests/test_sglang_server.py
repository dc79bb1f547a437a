"""A real SGLang 0.5.23 server on the CPU with ``--kv-backend kvplug``: SGLang's own HTTP server,
tokenizer manager, scheduler and detokenizer processes, with kvplug's KV pool, req-to-token table,
allocator-facing prefix cache and torch attention inside, against native SGLang on the same tiny
random models (Llama and Qwen3 shapes, float32).

Each configuration starts one server and runs one request script through it (``run_script``):
greedy completions of shared-prefix prompts, repeats, the openai client on
``/v1/chat/completions`` (streaming and not), ``/flush_cache``, with a ZMQ subscriber reading its
KV events. Native SGLang runs the same script first and stops; every kvplug configuration must
give the same token ids. Each server ends with SIGTERM, which must stop it and its processes.

Runs in the SGLang test environment (``scripts/test-sglang-host.sh``); skipped elsewhere. About
four minutes on the 2-core machine, most of it six server starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.sglang_helpers import import_sglang

import_sglang()

from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from tests.sglang_models import build_model, build_tokenizer  # noqa: E402
from tests.sglang_server import EventSubscriber, Server  # noqa: E402

FAMILY_A = "The kv cache keeps keys and values of every token; "
FAMILY_B = "Radix trees share prefixes between requests that start alike, "
PROMPTS = [
    FAMILY_A + "pages hold them.",
    FAMILY_A + "pages hold them, sixteen at a time.",  # extends the previous prompt
    FAMILY_A + "a router reads events.",
    FAMILY_B + "so a second request computes less.",
    FAMILY_B + "so a second request computes less, and a third even less.",
    FAMILY_B + "and eviction frees the least recently used.",
    "hello",
    "Short and unrelated.",
    FAMILY_A,  # a prefix of three cached prompts
    "x" * 90,
]
REPEATED = [0, 3, 4]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": FAMILY_A + "What are pages?"}]
MAX_NEW_TOKENS = 8


@dataclass
class Record:
    """What one server answered to the script (compared between configurations)."""

    generated: list[list[int]] = field(default_factory=list)  # output ids per /generate, in order
    cached: list[int] = field(default_factory=list)  # meta_info.cached_tokens per /generate
    chat_text: str = ""
    chat_stream_text: str = ""
    chat_usage: Any = None
    flushed: bool = False
    events: list = field(default_factory=list)
    exit_status: int | None = None


def run_script(server: Server, subscriber: EventSubscriber | None) -> Record:
    record = Record()

    def generate(text: str) -> None:
        answer = server.generate(text, MAX_NEW_TOKENS)
        record.generated.append(answer["output_ids"])
        record.cached.append(answer["meta_info"]["cached_tokens"])

    if subscriber is not None:
        subscriber.connect()
    for prompt in PROMPTS:
        generate(prompt)
    for number in REPEATED:
        generate(PROMPTS[number])
    client = server.openai()
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_NEW_TOKENS, temperature=0)
    record.chat_text, record.chat_usage = reply.choices[0].message.content, reply.usage
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_NEW_TOKENS, temperature=0, stream=True
    )
    record.chat_stream_text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    response = server.post("/flush_cache")
    record.flushed = response.status_code == 200
    generate(PROMPTS[0])  # after the flush: nothing cached
    if subscriber is not None:
        record.events = subscriber.drain()
    return record


def serve_and_record(model: Path, log: Path, *flags: str, events: bool = False) -> tuple[Server, Record]:
    subscriber = EventSubscriber() if events else None
    if subscriber is not None:
        flags = (*flags, "--kv-events-config", subscriber.events_config())
    server = Server(model, log, *flags).start()
    try:
        return server, run_script(server, subscriber)
    except BaseException:
        server.kill()
        raise
    finally:
        if subscriber is not None:
            subscriber.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang-models")
    return {shape: build_model(shape, root / shape) for shape in ("llama", "qwen3")}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sglang-logs")


def native_record(models, logs, shape: str) -> Record:
    server, record = serve_and_record(models[shape], logs / f"native-{shape}.log", events=shape == "llama")
    record.exit_status = server.stop()
    return record


@pytest.fixture(scope="module")
def native_llama(models, logs) -> Record:
    return native_record(models, logs, "llama")


@pytest.fixture(scope="module")
def native_qwen3(models, logs) -> Record:
    return native_record(models, logs, "qwen3")


def kvplug_server(models, logs, shape: str, cache: str, events: bool = False):
    server, record = serve_and_record(
        models[shape],
        logs / f"kvplug-{cache}-{shape}.log",
        "--kv-backend", "kvplug", "--prefix-cache", cache, "--kvplug-attention", "torch",
        events=events,
    )  # fmt: skip
    log = server.log.read_text(errors="replace")
    for proof in ("kvplug-sglang: KV pool is kvplug 'mha'", "impl=KvplugPrefixCache", "'attention_backend': 'kvplug:torch'"):
        assert proof in log, f"the server did not run on kvplug ({proof!r} not logged):\n{server.log_tail()}"
    yield server, record
    if server.process is not None and server.process.poll() is None:
        server.kill()


def assert_same_tokens(record: Record, reference: Record) -> None:
    assert len(record.generated) == len(PROMPTS) + len(REPEATED) + 1
    for number, (got, expected) in enumerate(zip(record.generated, reference.generated)):
        assert got == expected, f"request {number}: kvplug {got} != native {expected}"
    assert all(len(ids) == MAX_NEW_TOKENS for ids in record.generated)  # random weights: no early EOS here


def assert_stopped_cleanly(server: Server, reference: Record) -> None:
    status = server.stop()
    assert status == reference.exit_status == 0, f"exit status {status} (native: {reference.exit_status})"
    log = server.log.read_text(errors="replace")
    assert "Traceback" not in log, server.log_tail()


def stored_pages(events: list) -> list[tuple[int, int | None, tuple]]:
    """Every stored page as (hash, parent hash, token ids), in order (coalescing undone)."""
    pages = []
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            size = event.block_size
            for number, block_hash in enumerate(event.block_hashes):
                pages.append((block_hash, parent, tuple(event.token_ids[number * size : (number + 1) * size])))
                parent = block_hash
    return pages


# ============================================================================ Llama, radix


class TestLlamaRadix:
    @pytest.fixture(scope="class")
    def kvplug(self, models, logs):
        yield from kvplug_server(models, logs, "llama", "radix", events=True)

    def test_greedy_completions_are_token_identical_to_native(self, kvplug, native_llama):
        assert_same_tokens(kvplug[1], native_llama)

    def test_repeated_and_shared_prefixes_are_served_from_the_cache(self, kvplug, native_llama):
        record = kvplug[1]
        repeats = record.cached[len(PROMPTS) : len(PROMPTS) + len(REPEATED)]
        assert min(repeats) > 0 and record.cached[1] > 0  # prompt 1 extends prompt 0
        assert record.cached == native_llama.cached  # the same hits as SGLang's own radix cache

    def test_openai_chat_completions_streaming_and_not(self, kvplug, native_llama):
        record = kvplug[1]
        assert record.chat_text and record.chat_stream_text == record.chat_text == native_llama.chat_text
        assert record.chat_usage.completion_tokens == MAX_NEW_TOKENS

    def test_flush_cache_empties_the_kvplug_cache(self, kvplug):
        record = kvplug[1]
        assert record.flushed and record.cached[-1] == 0 and record.generated[-1] == record.generated[0]

    def test_kv_events_reach_a_zmq_subscriber_as_native_sglang_publishes_them(self, kvplug, native_llama):
        events = kvplug[1].events
        pages = stored_pages(events)
        assert pages and any(parent is not None for _, parent, _ in pages)
        assert any(isinstance(event, AllBlocksCleared) for event in events)  # /flush_cache
        # a prompt's pages chain from the root: following parents spells the prompt's tokens
        by_hash = {block_hash: (parent, tokens) for block_hash, parent, tokens in pages}
        spelled = set()
        for block_hash in by_hash:
            tokens: list[int] = []
            while block_hash is not None and block_hash in by_hash:
                parent, page = by_hash[block_hash]
                tokens[:0] = page
                block_hash = parent
            spelled.add(tuple(tokens))
        for prompt in PROMPTS:
            prompt_ids = tuple(build_tokenizer()(prompt)["input_ids"])
            assert prompt_ids in {prefix[: len(prompt_ids)] for prefix in spelled}, prompt
        # the same blocks, hashes and links as SGLang's own tree cache publishes for the script
        assert set(pages) == set(stored_pages(native_llama.events))
        removed = {h for event in events if isinstance(event, BlockRemoved) for h in event.block_hashes}
        assert removed <= {block_hash for block_hash, _, _ in pages}

    def test_sigterm_stops_the_server_and_its_processes(self, kvplug, native_llama):
        assert_stopped_cleanly(kvplug[0], native_llama)


# ============================================================================ Qwen3, radix


class TestQwen3Radix:
    @pytest.fixture(scope="class")
    def kvplug(self, models, logs):
        yield from kvplug_server(models, logs, "qwen3", "radix")

    def test_greedy_completions_are_token_identical_to_native(self, kvplug, native_qwen3):
        assert_same_tokens(kvplug[1], native_qwen3)
        assert kvplug[1].cached == native_qwen3.cached and max(kvplug[1].cached) > 0

    def test_openai_chat_completions_streaming_and_not(self, kvplug, native_qwen3):
        record = kvplug[1]
        assert record.chat_stream_text == record.chat_text == native_qwen3.chat_text

    def test_sigterm_stops_the_server_and_its_processes(self, kvplug, native_qwen3):
        assert_stopped_cleanly(kvplug[0], native_qwen3)


# ============================================================================ other kvplug caches


class TestLlamaNaive:
    @pytest.fixture(scope="class")
    def kvplug(self, models, logs):
        yield from kvplug_server(models, logs, "llama", "naive")

    def test_naive_recomputes_everything_with_the_same_tokens(self, kvplug, native_llama):
        assert_same_tokens(kvplug[1], native_llama)
        assert kvplug[1].cached == [0] * len(kvplug[1].cached)

    def test_sigterm_stops_the_server_and_its_processes(self, kvplug, native_llama):
        assert_stopped_cleanly(kvplug[0], native_llama)


class TestLlamaThirdPartyCache:
    """``page-hash``, registered by the example plugin (examples/third_party_plugin), by name."""

    @pytest.fixture(scope="class")
    def kvplug(self, models, logs):
        pytest.importorskip("kvplug_pagehash", reason="pip install -e examples/third_party_plugin")
        yield from kvplug_server(models, logs, "llama", "page-hash")

    def test_served_by_name_with_the_same_tokens_and_cache_hits(self, kvplug, native_llama):
        assert_same_tokens(kvplug[1], native_llama)
        assert kvplug[1].cached == native_llama.cached
        assert "kvplug:page-hash" in kvplug[0].log.read_text(errors="replace")

    def test_sigterm_stops_the_server_and_its_processes(self, kvplug, native_llama):
        assert_stopped_cleanly(kvplug[0], native_llama)
