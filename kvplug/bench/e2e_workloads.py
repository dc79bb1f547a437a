"""The request streams of ``kvplug bench e2e``: shared prefixes, no shared prefixes, multi-turn chat,
and (for the host-memory tier) multi-turn chat over long per-conversation contexts.

A workload is a list of rounds of prompts (token-id lists). The single-round workloads submit
every request at once; multi-turn chat submits one turn of every conversation per round, and each
turn's prompt is the previous prompt + the answer the engine generated for it + a new question,
so it needs the previous round's answers. Token ids are drawn from a seeded generator (ids from
1 up, 0 is the pad id), and every variant of a run gets the same prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

import numpy as np

Prompts = list[list[int]]


@dataclass(frozen=True)
class E2ESizes:
    """Sizes of every workload (all host-side ints, in tokens unless named otherwise).

    Attributes:
        requests: requests of the shared-prefix and no-prefix workloads.
        system_prompts, system_tokens: distinct shared prefixes and their length.
        question_tokens: unique tokens after the shared prefix (also each chat turn's question).
        output_tokens: tokens generated per request (EOS disabled, so exactly this many).
        concurrency: requests per step (``max_requests_per_batch``, and kvplug's request rows),
            one run per level for the shared-prefix workload; the other two use the largest.
        conversations, turns: the multi-turn chat workload.
        max_batch_tokens: tokens per forward step (prefills are chunked to it).
    """

    requests: int
    system_prompts: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    concurrency: tuple[int, ...]
    conversations: int
    turns: int
    max_batch_tokens: int

    def updated(self, **changes: object) -> "E2ESizes":
        return replace(self, **{name: value for name, value in changes.items() if value is not None})

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def chat_prompt_tokens(self) -> int:
        """Prompt length of the last chat turn, the longest request of that workload."""
        return self.turns * self.question_tokens + (self.turns - 1) * self.output_tokens

    @property
    def longest_request(self) -> int:
        single = self.system_tokens + self.question_tokens
        return max(single, self.chat_prompt_tokens) + self.output_tokens


PRESETS = {
    # the GPU sizes, for --model-shape qwen3-0.6b on an H200
    "gpu": E2ESizes(requests=256, system_prompts=8, system_tokens=2048, question_tokens=256, output_tokens=128,
                    concurrency=(64, 128, 256), conversations=64, turns=6, max_batch_tokens=8192),
    # scaled so the tiny model finishes all three workloads in a few minutes on 2 CPU cores
    "cpu": E2ESizes(requests=48, system_prompts=4, system_tokens=384, question_tokens=48, output_tokens=24,
                    concurrency=(4, 16, 48), conversations=12, turns=4, max_batch_tokens=512),
    "quick": E2ESizes(requests=8, system_prompts=2, system_tokens=64, question_tokens=16, output_tokens=4,
                      concurrency=(4, 8), conversations=4, turns=2, max_batch_tokens=128),
}


@dataclass(frozen=True)
class Workload:
    """Rounds of prompts; ``next_round(k, prompts, answers)`` gives round k (k >= 1) from round
    k-1's prompts and answers. Stateless, so one workload serves every variant and repeat."""

    name: str
    rounds: int
    first_round: Prompts
    next_round: Callable[[int, Prompts, Prompts], Prompts] | None = None


def _tokens(rng: np.random.Generator, count: int, vocab: int) -> list[int]:
    return rng.integers(1, vocab, count).tolist()


def shared_prefix(sizes: E2ESizes, vocab: int, seed: int) -> Workload:
    """``requests`` prompts, request i = system prompt (i mod system_prompts) + its own question."""
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, sizes.system_tokens, vocab) for _ in range(sizes.system_prompts)]
    prompts = [systems[i % sizes.system_prompts] + _tokens(rng, sizes.question_tokens, vocab)
               for i in range(sizes.requests)]
    return Workload("shared-prefix", 1, prompts)


def no_prefix(sizes: E2ESizes, vocab: int, seed: int) -> Workload:
    """The same request count and lengths as ``shared_prefix``, every token random: no hits."""
    rng = np.random.default_rng(seed + 1)
    length = sizes.system_tokens + sizes.question_tokens
    return Workload("no-prefix", 1, [_tokens(rng, length, vocab) for _ in range(sizes.requests)])


def multi_turn(sizes: E2ESizes, vocab: int, seed: int) -> Workload:
    """``conversations`` chats of ``turns`` turns; turn k+1 = turn k's prompt + answer + question."""
    rng = np.random.default_rng(seed + 2)
    questions = _turn_questions(rng, sizes, vocab)
    return Workload("multi-turn", sizes.turns, questions[0], _chat_rounds(sizes.turns, questions))


def _turn_questions(rng: np.random.Generator, sizes: E2ESizes, vocab: int) -> list[Prompts]:
    """``questions[turn][conversation]``: a fresh question per conversation and turn."""
    return [[_tokens(rng, sizes.question_tokens, vocab) for _ in range(sizes.conversations)]
            for _ in range(sizes.turns)]


def _chat_rounds(turns: int, questions: list[Prompts]) -> Callable[[int, Prompts, Prompts], Prompts]:
    """``next_round`` of a chat workload: turn k+1 = turn k's prompt + its answer + the next question."""

    def next_round(turn: int, prompts: Prompts, answers: Prompts) -> Prompts:
        if not 1 <= turn < turns or len(answers) != len(prompts):
            raise ValueError(f"expected turn in [1, {turns}) and one answer per prompt ({len(prompts)}), "
                             f"got turn {turn} and {len(answers)} answers")
        return [prompt + answer + question for prompt, answer, question in zip(prompts, answers, questions[turn])]

    return next_round


def long_context_chat(sizes: E2ESizes, vocab: int, seed: int) -> Workload:
    """``conversations`` chats, each over its own ``system_tokens``-token context (a document, a
    codebase, a long system prompt), ``turns`` turns; turn k+1 = turn k's prompt + answer +
    question. Every round touches every conversation once, in the same order: LRU's worst case,
    so a pool smaller than the working set (``working_set_tokens``) evicts each conversation
    before its next turn, and only a larger tier below it keeps the hits."""
    rng = np.random.default_rng(seed + 3)
    contexts = [_tokens(rng, sizes.system_tokens, vocab) for _ in range(sizes.conversations)]
    questions = _turn_questions(rng, sizes, vocab)
    first = [context + question for context, question in zip(contexts, questions[0])]
    return Workload("long-context-chat", sizes.turns, first, _chat_rounds(sizes.turns, questions))


WORKLOADS = {"shared-prefix": shared_prefix, "no-prefix": no_prefix, "multi-turn": multi_turn}
#: workloads sized against a pool smaller than their working set (``--working-set-ratio``); not run by default
TIER_WORKLOADS = {"long-context-chat": long_context_chat}


def build_workload(name: str, sizes: E2ESizes, vocab: int, seed: int) -> Workload:
    factory = WORKLOADS.get(name) or TIER_WORKLOADS.get(name)
    if factory is None:
        raise ValueError(f"unknown workload {name!r}; expected some of {sorted(WORKLOADS) + sorted(TIER_WORKLOADS)}")
    return factory(sizes, vocab, seed)


def working_set_tokens(name: str, sizes: E2ESizes) -> int:
    """Tokens a workload keeps reusable at its end: every conversation's last prompt and answer
    (``long-context-chat``), else every distinct prompt prefix of the first round."""
    if name == "long-context-chat":
        return sizes.conversations * (sizes.system_tokens + sizes.chat_prompt_tokens + sizes.output_tokens)
    if name == "multi-turn":
        return sizes.conversations * (sizes.chat_prompt_tokens + sizes.output_tokens)
    return sizes.system_prompts * sizes.system_tokens


def prompt_tokens(prompts: Sequence[Sequence[int]]) -> int:
    return sum(len(prompt) for prompt in prompts)
