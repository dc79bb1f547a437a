"""A model-shaped decoder over a ``KVBackend`` and a random serving scenario, for the decode-step
and CUDA-graph tests (CPU and GPU): two backends built alike, one stepping eagerly and one
through ``decode_graphs``, driven by the same admissions, prefills, decode steps and finishes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvplug.backend import KVBackend, ModelShape, create_backend


class DecoderStack:
    """Embedding -> layers of (qkv projection -> kvplug attention -> output projection +
    residual) -> logits; weights depend only on ``seed``. ``step_forward(step)`` is a host's
    decode forward (the function ``decode_graphs`` captures); ``__call__(ids, batch)`` any forward."""

    def __init__(self, backend: KVBackend, *, hidden: int = 256, vocab: int = 512, seed: int = 0) -> None:
        shape, device, dtype = backend.shape, backend.device, backend.pool.dtype
        gen = torch.Generator().manual_seed(seed)

        def weight(*dims):
            return (torch.randn(*dims, generator=gen) / dims[0] ** 0.5).to(dtype).to(device)

        self.backend = backend
        self.q_size, self.kv_size = shape.num_qo_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.embed = weight(vocab, hidden) * hidden**0.5
        self.qkv = [weight(hidden, self.q_size + 2 * self.kv_size) for _ in range(shape.num_layers)]
        self.proj = [weight(self.q_size, hidden) for _ in range(shape.num_layers)]
        self.head = weight(hidden, vocab)

    def __call__(self, ids: torch.Tensor, batch: Any) -> torch.Tensor:
        x = self.embed[ids.long()]
        for layer, (qkv, proj) in enumerate(zip(self.qkv, self.proj)):
            q, k, v = (x @ qkv).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            x = x + 0.5 * (self.backend.forward(q, k, v, layer, batch) @ proj)
        return (x @ self.head).float()

    def step_forward(self, step: Any) -> torch.Tensor:
        return self(step.input_ids, step.batch)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def make_world(*, attention: str, page_size: int, device: str, dtype=torch.float32, num_layers: int = 3,
               num_qo_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 64, max_running_reqs: int = 12,
               max_seq_len: int = 256, num_pages: int | None = None, prefix_cache: str = "radix", seed: int = 0,
               manager: Any = None) -> tuple[KVBackend, DecoderStack]:
    shape = ModelShape(num_layers, num_qo_heads, num_kv_heads, head_dim, dtype)
    pages = num_pages or max_running_reqs * -(-max_seq_len // page_size) + 8
    backend = create_backend(shape, page_size=page_size, num_pages=pages, max_running_reqs=max_running_reqs,
                             max_seq_len=max_seq_len, prefix_cache=prefix_cache, attention=attention, device=device,
                             manager=manager)
    return backend, DecoderStack(backend, seed=seed)


def run_scenario(eager: tuple, graphed: tuple, *, steps: int, seed: int, tolerance: float,
                 check_live_kv: bool = False) -> dict:
    """Drive both worlds alike; the graph world decodes through ``graphs.run``. Returns counters
    (steps replayed from a graph, eager steps, the largest logit difference seen).

    Both worlds take the eager world's greedy tokens, so a near-tie cannot make them diverge;
    logits must agree to ``tolerance`` in relative error (``|a - b| / |a|`` over the whole
    tensor: batched GEMMs of another batch size round differently). With ``check_live_kv`` every graph step is
    replayed twice and the pool must be bit-identical after the second replay (padding writes
    only the dummy page, whose contents are never read)."""
    (backend_a, model_a), (backend_b, model_b) = eager, graphed
    graphs = backend_b.graphs
    rng = np.random.default_rng(seed)
    shared = [rng.integers(0, 500, int(rng.integers(20, 60))).tolist() for _ in range(3)]
    running: list[tuple[Any, Any]] = []
    counters = {"graph_steps": 0, "eager_steps": 0, "worst": 0.0, "sizes": set()}
    limit = backend_a.max_seq_len - 2
    for _ in range(steps):
        while len(running) < backend_a.max_running_reqs and rng.random() < 0.35:
            prompt = shared[int(rng.integers(3))][: int(rng.integers(8, 60))] + rng.integers(
                0, 500, int(rng.integers(1, 30))).tolist()
            pair = []
            for backend, model in ((backend_a, model_a), (backend_b, model_b)):
                request = backend.admit(prompt)
                backend.allocate([request])
                batch = backend.prepare([request], "prefill")
                logits = model(backend.input_ids(batch), batch)
                pair.append((request, logits[-1:]))
            assert relative_error(pair[1][1], pair[0][1]) <= tolerance
            first = torch.argmax(pair[0][1], dim=-1).to(torch.int32)
            for (request, _), backend in zip(pair, (backend_a, backend_b)):
                backend.append_tokens([request], first.to(backend.device))
            running.append((pair[0][0], pair[1][0]))
        if running and rng.random() < 0.25:  # a request finishes mid-batch
            a, b = running.pop(int(rng.integers(len(running))))
            backend_a.finish(a, computed=True)
            backend_b.finish(b, computed=True)
        running = [(a, b) for a, b in running if a.num_tokens < limit]
        if not running:
            continue
        order = rng.permutation(len(running))
        live = [running[i] for i in order[: int(rng.integers(1, len(running) + 1))]]
        step_a = backend_a.begin_decode([a for a, _ in live])
        logits_a = model_a.step_forward(step_a)
        step_b = backend_b.begin_decode([b for _, b in live])
        if step_b.graph_size is None:
            counters["eager_steps"] += 1
        else:
            counters["graph_steps"] += 1
            counters["sizes"].add((len(live), step_b.graph_size))
        logits_b = graphs.run(step_b)
        if check_live_kv and step_b.graph_size is not None:
            after_first = backend_b.pool.kv_buffer.clone()
            graphs.run(step_b)
            dummy = backend_b.pool.num_pages
            assert torch.equal(backend_b.pool.kv_buffer[:, :, :dummy], after_first[:, :, :dummy])
        assert logits_b.shape == logits_a.shape
        error = relative_error(logits_b, logits_a)
        counters["worst"] = max(counters["worst"], error)
        assert error <= tolerance, f"graph logits differ from eager by {error:.2e} (batch {len(live)})"
        tokens = torch.argmax(logits_a, dim=-1).to(torch.int32)
        step_a.commit(tokens)
        step_b.commit(tokens.to(backend_b.device))
    for a, b in running:
        backend_a.finish(a, computed=True)
        backend_b.finish(b, computed=True)
    backend_a.check_integrity()
    backend_b.check_integrity()
    return counters
