"""Prefix sharing by blocks (actors.worker.prefix_cache over actors.model.kv_cache.PagedKVCache):
requests with a common prefix hold its full blocks once, by reference count, and each writes
only blocks of its own (copy-on-write), so what one holds never changes under another."""

from __future__ import annotations

import torch

from actors.model.kv_cache import PagedKVCache
from actors.worker.prefix_cache import PrefixCache

BLOCK, PREFIX, SUFFIX, REQUESTS = 16, 2048, 40, 16


def _cache(max_slots: int = REQUESTS + 2) -> PagedKVCache:
    return PagedKVCache(num_layers=1, kv_heads=1, head_dim=2, capacity=PREFIX + 4 * SUFFIX, max_slots=max_slots,
                        block_size=BLOCK)


def _prefill(cache: PagedKVCache, slot: int, start: int, tokens: list[int]) -> None:
    """What a prefill leaves: column ``start + j`` holds key ``(tokens[j], start + j)``."""
    columns = torch.arange(start, start + len(tokens))  # [L]
    cache.bind(torch.tensor([slot]), columns[None], kv_length=start + len(tokens))
    keys = torch.stack((torch.tensor(tokens, dtype=torch.float32), columns.float()), dim=-1)[None, None]  # [1, 1, L, 2]
    cache.update(keys, keys, 0)
    cache.unbind()


def _holds(cache: PagedKVCache, slot: int, tokens: list[int]) -> bool:
    keys = cache.read_columns(slot, range(len(tokens)))[0, 0, 0]  # [n, 2]
    expected = torch.stack((torch.tensor(tokens, dtype=torch.float32), torch.arange(len(tokens)).float()), dim=-1)
    return torch.equal(keys, expected)


def test_sixteen_requests_with_a_common_prefix_hold_it_once():
    """16 requests with a common 2,048-token prefix and their own 40-token suffixes hold at most
    1.3x the blocks of one such request plus their own suffixes; each still reads its own prompt."""
    cache = _cache()
    prefixes = PrefixCache(cache)
    common = [1 + i % 97 for i in range(PREFIX)]
    prompts = [common + [1000 + 100 * r + j for j in range(SUFFIX)] for r in range(REQUESTS)]
    live: list[tuple[int, list[int]]] = []
    for prompt in prompts:
        slot, reused = prefixes.open(prompt, live)
        assert reused == (0 if not live else PREFIX)
        _prefill(cache, slot, reused, prompt[reused:])
        live.append((slot, prompt))
    one_request = -(-(PREFIX + SUFFIX) // BLOCK)  # 131 blocks
    suffixes = REQUESTS * -(-SUFFIX // BLOCK)  # 3 blocks of its own each
    used = cache.block_counts()["used"]
    assert used == PREFIX // BLOCK + suffixes  # the prefix's 128 blocks once
    assert used <= 1.3 * one_request + suffixes  # the claim (unshared: 16 x 131 = 2,096)
    assert all(_holds(cache, slot, prompt) for slot, prompt in live)


def test_a_write_into_a_shared_block_copies_it_and_release_keeps_the_record():
    """A session rolled back into the shared prefix writes a copy; the donor keeps its keys. A
    released prompt is parked by sharing (no copy) and reused by the next request."""
    cache = _cache(max_slots=4)
    prefixes = PrefixCache(cache)
    prompt = list(range(1, 3 * BLOCK + 2))  # 49 tokens: 3 full blocks
    donor, _ = prefixes.open(prompt)
    _prefill(cache, donor, 0, prompt)
    sharer, reused = prefixes.open(prompt[: 2 * BLOCK] + [500, 501], [(donor, prompt)])
    assert reused == 2 * BLOCK and cache.block_counts()["used"] == 4
    _prefill(cache, sharer, BLOCK - 1, [777])  # into shared block 0: copy-on-write
    assert _holds(cache, donor, prompt) and cache.block_counts()["used"] == 5
    prefixes.release(donor, prompt)
    parked = next(iter(prefixes.records))
    assert parked != donor and cache.held_blocks(donor) == 0 and _holds(cache, parked, prompt)
    slot, reused = prefixes.open(prompt + [9])
    assert reused == len(prompt) and _holds(cache, slot, prompt)
