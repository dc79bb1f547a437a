"""Build every registered prefix cache by name and show what each does with a shared prefix."""

import torch

import kvplug

PAGE_SIZE = 16
system_prompt = torch.arange(1, 1 + 4 * PAGE_SIZE, dtype=torch.int32)
question_a = torch.cat([system_prompt, torch.full((PAGE_SIZE,), 7, dtype=torch.int32)])
question_b = torch.cat([system_prompt, torch.full((PAGE_SIZE,), 9, dtype=torch.int32)])

for name in kvplug.available("prefix_cache"):
    cache = kvplug.create_prefix_cache(name, page_size=PAGE_SIZE)
    locations_a = torch.arange(len(question_a), dtype=torch.int32) + 10_000
    cache.insert_prefix(question_a, locations_a)
    handle = cache.match_prefix(question_b).handle
    cache.lock_handle(handle)
    print(f"{name:>10}: request B reuses {handle.cached_len:3d} of {len(question_b)} tokens; {cache.size_info}")
    cache.lock_handle(handle, unlock=True)
