"""``kvplug serve --engine-process`` (issue 28 item 2): the model, the batching worker and kvplug in
a process of their own. Real server processes on 127.0.0.1 with the embedded model, the real
``openai`` client: streamed text is token for token the plain answer and greedy ``generate``'s;
the engine process's death gives 503s and exit 2; SIGTERM under load exits 0 with the engine
process gone."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.serve_process import free_port, get_json, start, stop, wait_ready

SHUTDOWN_TIMEOUT_S = 5.0
EXIT_SLACK_S = 3.0
PROMPTS = ("Tell me about paged attention.", "héllo wörld", "1 + 1 =")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from kvplug_transformers.embedded_model import ensure_embedded_model

    directory = tmp_path_factory.mktemp("kvplug-cache")
    ensure_embedded_model(directory)
    return directory


def _serve(cache_dir: Path, log: Path, *extra: str) -> tuple[object, int]:
    port = free_port()
    process = start(
        ["-m", "kvplug", "serve", "--engine-process", "--port", str(port), "--kv-memory", "16MiB",
         "--max-seq-len", "2048", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), *extra],
        cache_dir, log,
    )
    wait_ready(process, port, log)
    return process, port


def _client(port: int, timeout: float = 60):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=timeout, max_retries=0)


def _engine_pid(server_pid: int) -> int:
    """The server's one child process that runs Python (the engine; multiprocessing may add a resource tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    engines = [int(pid) for pid in children if "run_engine" in _cmdline(int(pid)) or "spawn_main" in _cmdline(int(pid))]
    assert len(engines) == 1, (children, [_cmdline(int(pid)) for pid in children])
    return engines[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
    return bool(stat) and stat.split(") ", 1)[1][0] != "Z"


def _greedy_reference(cache_dir: Path, prompt: str) -> str:
    """transformers' own ``generate`` on the embedded model: the text a greedy server must answer."""
    import torch
    import transformers
    from kvplug_transformers.embedded_model import ensure_embedded_model

    path = ensure_embedded_model(cache_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("interval", [1, 4], ids=["every-token", "stream-interval-4"])
def test_streamed_text_is_the_plain_answer_and_greedy_generate(cache_dir, tmp_path, interval):
    log = tmp_path / "serve.log"
    process, port = _serve(cache_dir, log, "--stream-interval", str(interval))
    try:
        client = _client(port)
        messages = {prompt: [{"role": "user", "content": prompt}] for prompt in PROMPTS}

        def plain(prompt: str) -> tuple[str, int]:
            reply = client.chat.completions.create(model="kvplug-default", messages=messages[prompt],
                                                   max_tokens=MAX_TOKENS)
            return reply.choices[0].message.content, reply.usage.completion_tokens

        def streamed(prompt: str) -> tuple[str, str | None, int | None]:
            stream = client.chat.completions.create(model="kvplug-default", messages=messages[prompt],
                                                    max_tokens=MAX_TOKENS, stream=True)
            text, finish, tokens, pieces = [], None, None, 0
            for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                    pieces += bool(chunk.choices[0].delta.content)
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            # the first token alone, then N at a time (the last group may be shorter)
            assert interval == 1 or pieces <= 1 + -(-(MAX_TOKENS - 1) // interval), pieces
            return "".join(text), finish, tokens

        with ThreadPoolExecutor(6) as pool:  # concurrent: the engine batches them
            plains = list(pool.map(plain, PROMPTS))
            streams = list(pool.map(streamed, PROMPTS))
        status, stats = get_json(port, "/kvplug/stats")
        assert status == 200 and stats["worker"]["alive"] and stats["finished_requests"] == 2 * len(PROMPTS)
        assert stats["cache_hit_tokens"] > 0  # each prompt's second request hit what the engine cached
        status, _ = get_json(port, "/health")
        assert status == 200
    finally:
        code, _ = stop(process)
    assert code == 0, log.read_text()[-4000:]
    for prompt, (text, tokens), (streamed_text, finish, streamed_tokens) in zip(PROMPTS, plains, streams):
        assert streamed_tokens == tokens, prompt
        # the byte-level tokenizer's stream holds back the bytes of a UTF-8 sequence the last token
        # left incomplete (transformers' DecodeStream); the whole decode shows them as U+FFFD
        assert text.startswith(streamed_text) and set(text[len(streamed_text):]) <= {"\ufffd"}, prompt
        assert finish == ("length" if tokens == MAX_TOKENS else "stop")
        assert text == _greedy_reference(cache_dir, prompt), prompt


def test_engine_process_death_gives_503_and_exit_2(cache_dir, tmp_path):
    log = tmp_path / "serve.log"
    process, port = _serve(cache_dir, log)
    engine = _engine_pid(process.pid)
    client = _client(port, timeout=30)

    def request(i: int) -> tuple[str, str]:
        try:
            if i % 2:
                reply = client.chat.completions.create(model="kvplug-default", max_tokens=5_000,
                                                       messages=[{"role": "user", "content": f"request {i}"}])
                return "ok", reply.choices[0].finish_reason
            stream = client.chat.completions.create(model="kvplug-default", max_tokens=5_000, stream=True,
                                                    messages=[{"role": "user", "content": f"request {i}"}])
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    return "ok", chunk.choices[0].finish_reason
            return "ended", "the stream ended without a finish_reason"
        except Exception as error:  # the test judges what each client saw
            return type(error).__name__, str(error)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(request, i) for i in range(4)]
        deadline = time.monotonic() + 30
        while get_json(port, "/kvplug/stats")[1]["in_flight"] < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(engine, signal.SIGKILL)
        health = None
        while health is None and time.monotonic() < deadline:
            try:
                status, body = get_json(port, "/health", timeout=2)
                if status == 503:
                    health = body
            except OSError:
                break
            time.sleep(0.05)
        outcomes = [future.result(timeout=30) for future in futures]
    code = process.wait(timeout=20)
    output = log.read_text()
    assert code == 2, output[-4000:]
    assert health is not None and "engine process exited" in health["reason"], health
    for kind, detail in outcomes:
        assert kind != "ok", (kind, detail)
    assert "the batching worker died" in output and "engine process exited" in output


def test_sigterm_under_load_exits_0_in_time_and_stops_the_engine(cache_dir, tmp_path):
    log = tmp_path / "serve.log"
    process, port = _serve(cache_dir, log)
    engine = _engine_pid(process.pid)
    client = _client(port)

    def request(i: int) -> tuple[str, str]:
        try:
            stream = client.chat.completions.create(model="kvplug-default", max_tokens=5_000, stream=True,
                                                    messages=[{"role": "user", "content": f"request {i}"}])
            return "ok", "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        except Exception as error:  # the test judges what each client saw
            return type(error).__name__, str(error)

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(request, i) for i in range(6)]
        time.sleep(2.0)
        assert get_json(port, "/kvplug/stats")[1]["in_flight"] == 6
        code, seconds = stop(process, timeout=SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S)
        outcomes = [future.result(timeout=30) for future in futures]
    output = log.read_text()
    assert code == 0, output[-4000:]
    assert seconds <= SHUTDOWN_TIMEOUT_S + EXIT_SLACK_S
    assert not _alive(engine)
    for kind, detail in outcomes:  # cut off with a reason at the deadline, never a hang
        assert kind == "ok" or "shutting down" in detail, (kind, detail)
    assert "kvplug serve: stopped" in output and "Traceback" not in output


def test_api_key_refusals_and_metrics_come_from_the_engine(cache_dir, tmp_path):
    import urllib.request

    log, port = tmp_path / "serve.log", free_port()
    process = start(
        ["-m", "kvplug", "serve", "--engine-process", "--port", str(port), "--kv-memory", "16MiB",
         "--max-seq-len", "2048", "--api-key", "k3y", "--stream-stall-timeout", "5"],
        cache_dir, log,
    )
    try:
        wait_ready(process, port, log, api_key="k3y")
        assert get_json(port, "/kvplug/stats")[0] == 401  # no key
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as refused:  # checked in the HTTP process, the engine never sees it
            client.chat.completions.create(model="kvplug-default", max_tokens=-1,
                                           messages=[{"role": "user", "content": "x"}])
        assert "max_tokens" in str(refused.value)
        prompt = "Tell me about paged KV caches. " * 4
        for _ in range(2):  # the second finds the first's prompt in the engine's prefix cache
            client.completions.create(model="kvplug-default", prompt=prompt, max_tokens=3)
        ids = client.completions.create(model="kvplug-default", prompt=[1, 2, 3, 4, 5], max_tokens=3)
        assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens <= 3
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer k3y"})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        label = '{model_name="kvplug-default"}'
        assert float(samples["vllm:prefix_cache_hits_total" + label]) > 0  # HostStats of the engine process
        assert float(samples["vllm:e2e_request_latency_seconds_count" + label]) == 3
        status, stats = get_json(port, "/kvplug/stats", headers={"Authorization": "Bearer k3y"})
        assert status == 200 and stats["finished_requests"] == 3 and stats["in_flight"] == 0
    finally:
        code, _ = stop(process)
    assert code == 0, log.read_text()[-4000:]
