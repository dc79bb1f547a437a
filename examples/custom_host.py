"""A host integration of your own: a toy engine that keeps its KV cache in kvplug.

The engine owns the model and the sampling loop; ``kvplug.create_backend`` owns everything about
memory: the pool, the page table and token pool, the paged allocator, the prefix cache and the
attention kernels. Per step the engine calls ``allocate -> prepare -> (forward per layer) ->
append_tokens``, and ``finish`` when a request ends; a later request sharing a prefix is matched
at ``admit`` and skips recomputing it. The model is a 2-layer attention-only transformer with
random weights; at the end every generated sequence is checked against a dense recomputation.

    python examples/custom_host.py
"""

import torch

from kvplug.backend import create_backend
from kvplug.memory.model_shape import ModelShape

LAYERS, Q_HEADS, KV_HEADS, DIM, VOCAB = 2, 4, 2, 16, 97
HIDDEN = Q_HEADS * DIM
torch.manual_seed(0)
SHAPES = {"embed": (VOCAB, HIDDEN), "position": (256, HIDDEN), "head": (HIDDEN, VOCAB)}
for layer in range(LAYERS):
    SHAPES.update({f"q{layer}": (HIDDEN, HIDDEN), f"o{layer}": (HIDDEN, HIDDEN)})
    SHAPES.update({f"k{layer}": (HIDDEN, KV_HEADS * DIM), f"v{layer}": (HIDDEN, KV_HEADS * DIM)})
W = {name: torch.randn(shape) * 0.3 for name, shape in SHAPES.items()}


def model(ids, positions, attend):
    """Logits ``[n, VOCAB]`` of tokens ``ids`` at ``positions``; ``attend(q, k, v, layer)`` does attention."""
    h = W["embed"][ids] + W["position"][positions]
    for layer in range(LAYERS):
        q, k, v = (h @ W[f"{p}{layer}"] for p in "qkv")
        h = h + attend(q, k, v, layer) @ W[f"o{layer}"]
    return h @ W["head"]


def dense_attention(q, k, v, layer):
    """The reference: causal attention over the whole sequence, no cache."""
    q, k, v = (x.view(x.shape[0], -1, DIM).transpose(0, 1) for x in (q, k, v))
    k, v = (x.repeat_interleave(Q_HEADS // KV_HEADS, dim=0) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(0, 1).reshape(-1, HIDDEN)


backend = create_backend(
    ModelShape(LAYERS, Q_HEADS, KV_HEADS, DIM, torch.float32),
    page_size=4, num_pages=64, max_running_reqs=4, max_seq_len=128, prefix_cache="radix", attention="torch",
)


def step(requests, phase):
    """One forward over ``requests``' not-yet-computed tokens; returns the greedy next tokens."""
    backend.allocate(requests)  # pages for every known token, evicting cached prefixes if short
    batch = backend.prepare(requests, phase)  # AttentionBatch: rows, lengths, positions, out_loc
    logits = model(backend.input_ids(batch).long(), batch.positions.long(),
                   lambda q, k, v, layer: backend.forward(q, k, v, layer, batch))
    next_ids = logits[batch.extend_start[1:].long() - 1].argmax(-1).to(torch.int32)  # last token of each
    backend.append_tokens(requests, next_ids)  # K/V computed; sampled ids into the token pool
    return next_ids.tolist()


def generate(prompts, new_tokens=8):
    requests = [backend.admit(prompt) for prompt in prompts]  # row + cached-prefix match
    outputs = [[] for _ in prompts]
    for token_index in range(new_tokens):
        for output, token in zip(outputs, step(requests, "prefill" if token_index == 0 else "decode")):
            output.append(token)
    for request in requests:
        backend.finish(request)  # its prefix goes into the radix cache for later requests
    return outputs


system = list(range(10, 42))  # a 32-token "system prompt" every request shares
first = generate([system + [50, 51, 52]])
later = generate([system + [60, 61], system + [70, 71, 72, 73]])
stats = backend.stats()
print(f"hit {stats.cache_hit_tokens} of {stats.queried_tokens} prompt tokens; {stats.used_pages} pages in use")
assert stats.cache_hit_tokens >= 2 * 32, "the later requests should reuse the shared system prompt"
for prompt, output in zip([system + [50, 51, 52], system + [60, 61], system + [70, 71, 72, 73]], first + later):
    sequence = list(prompt)
    for _ in output:  # dense greedy decoding, recomputing everything each token
        positions = torch.arange(len(sequence))
        sequence.append(int(model(torch.tensor(sequence), positions, dense_attention)[-1].argmax()))
    assert sequence[len(prompt):] == output, (sequence[len(prompt):], output)
print("kvplug-backed generation matches dense recomputation:", first + later)
