"""Several prompts in one ``/v1/completions`` request (issue 29): a list of strings or of token-id
lists gets one choice per prompt, ``index`` its position as OpenAI answers, usage summed, streamed
too. Differential: each choice is the text the same prompt gets alone (greedy), on a real
``kvplug serve`` driven by the real ``openai`` client."""

from __future__ import annotations

import pytest

from tests.serve_process import free_port, start, stop, wait_ready

PROMPTS = ["The quick brown fox", "kvplug pages", "Once upon a time, in a land", "0123"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for module in ("transformers", "fastapi", "uvicorn", "openai"):
        pytest.importorskip(module)
    from kvplug_transformers.embedded_model import ensure_embedded_model

    cache_dir = tmp_path_factory.mktemp("kvplug-cache")
    model = ensure_embedded_model(cache_dir)
    port, log = free_port(), tmp_path_factory.mktemp("log") / "serve.log"
    process = start(["-m", "kvplug", "serve", "--port", str(port), "--kv-memory", "4MiB", "--max-seq-len", "256"],
                    cache_dir, log)
    try:
        wait_ready(process, port, log)
        yield port, model
    finally:
        code, _ = stop(process)
        output = log.read_text()
        assert code == 0 and "Traceback" not in output, output[-3000:]


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def alone(client):
    """Each prompt's greedy reply and usage, one request each: the reference."""
    replies = [client.completions.create(model="kvplug-default", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
               for p in PROMPTS]
    return [(reply.choices[0].text, reply.usage.prompt_tokens, reply.usage.completion_tokens) for reply in replies]


@pytest.mark.parametrize("as_ids", [False, True], ids=["strings", "token-ids"])
def test_one_choice_per_prompt_in_order_usage_summed(server, client, alone, as_ids):
    from transformers import AutoTokenizer

    prompts = [AutoTokenizer.from_pretrained(server[1])(p)["input_ids"] for p in PROMPTS] if as_ids else PROMPTS
    reply = client.completions.create(model="kvplug-default", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
    assert [choice.index for choice in reply.choices] == list(range(len(PROMPTS)))
    assert [choice.text for choice in reply.choices] == [text for text, _, _ in alone]
    assert all(choice.finish_reason in ("stop", "length") for choice in reply.choices)
    assert reply.usage.prompt_tokens == sum(p for _, p, _ in alone)
    assert reply.usage.completion_tokens == sum(c for _, _, c in alone)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def _streamed_text(client, prompt) -> str:
    stream = client.completions.create(model="kvplug-default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True)
    return "".join(choice.text for chunk in stream for choice in chunk.choices)


def test_streamed_choices_carry_their_index_and_the_last_chunk_the_summed_usage(client, alone):
    """Each choice's streamed text is the prompt's own stream (a stream holds back an incomplete
    UTF-8 tail, which the embedded model's random tokens end with)."""
    chunks = list(client.completions.create(model="kvplug-default", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    texts, finishes = [""] * len(PROMPTS), [None] * len(PROMPTS)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                assert finishes[choice.index] is None  # one finish per choice
                finishes[choice.index] = choice.finish_reason
    assert texts == [_streamed_text(client, prompt) for prompt in PROMPTS]
    assert all(finish in ("stop", "length") for finish in finishes), finishes
    assert len({chunk.id for chunk in chunks}) == 1
    with_usage = [chunk for chunk in chunks if chunk.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == sum(c for _, _, c in alone)
    assert chunks[-1].usage.prompt_tokens == sum(p for _, p, _ in alone)


def test_stop_strings_and_a_seed_apply_to_every_prompt(client, alone):
    """The request's sampling is every prompt's: a seeded sampling request repeats prompt by prompt."""
    seeded = dict(max_tokens=MAX_TOKENS, temperature=1.2, seed=7)
    together = client.completions.create(model="kvplug-default", prompt=PROMPTS[:2], **seeded)
    one_by_one = [client.completions.create(model="kvplug-default", prompt=p, **seeded).choices[0].text
                  for p in PROMPTS[:2]]
    assert [choice.text for choice in together.choices] == one_by_one
