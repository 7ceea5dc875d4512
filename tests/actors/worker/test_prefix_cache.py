"""Prefix caching (actors.worker.prefix_cache) on the fake backend, whose slots remember the token and
position written to every column: what is copied, from where, into which slot, and when
nothing is. A wrong copy shows up as wrong (token, position) pairs in the receiving slot.
The rows after a reuse on a real model are checked in tests/actors/worker/test_model_worker.py."""

from __future__ import annotations

from actors.worker.prefix_cache import MIN_REUSE_TOKENS, PrefixCache
from tests.actors.fake_models import FAKE_MODELS, VOCAB, FunctionBackend

LONG = list(range(1, 41))  # 40 tokens, well above MIN_REUSE_TOKENS


def _backend(max_slots: int = 6) -> FunctionBackend:
    return FunctionBackend(FAKE_MODELS["target"], VOCAB, max_slots=max_slots)


def _fill(backend: FunctionBackend, slot: int, tokens: list[int]) -> None:
    """What a prefill of ``tokens`` leaves in ``slot``: column j holds (tokens[j], j)."""
    backend.columns[slot].update({j: (t, j) for j, t in enumerate(tokens)})


def _holds(backend: FunctionBackend, slot: int, tokens: list[int]) -> bool:
    return all(backend.columns[slot].get(j) == (t, j) for j, t in enumerate(tokens))


def _finished_session(backend: FunctionBackend, cache: PrefixCache, prompt: list[int],
                      held: list[int] | None = None) -> tuple[int, int]:
    """A session opened with ``prompt`` whose slot ends up holding ``held`` (default: the
    prompt), then released -> what ``open`` returned: ``(slot, reused)``."""
    held = prompt if held is None else held
    slot, reused = cache.open(prompt)
    _fill(backend, slot, held)
    cache.release(slot, held)
    return slot, reused


def test_a_released_prompt_is_parked_high_and_copied_into_the_lowest_free_slot():
    backend = _backend()
    cache = PrefixCache(backend)
    assert _finished_session(backend, cache, LONG) == (0, 0)
    assert cache.records == {5: tuple(LONG)} and _holds(backend, 5, LONG)  # parked in the highest free slot
    again, reused = cache.open(LONG[:30] + [99, 98])
    assert again == 0 and reused == 30  # the lowest slot, with the common prefix copied in
    assert _holds(backend, 0, LONG[:30])
    assert cache.reused_tokens_total == 30 and cache.prompt_tokens_total == 40 + 32


def test_the_last_prompt_token_is_never_reused():
    """Even a prompt the cache holds whole keeps its last token to feed (its row is needed)."""
    backend = _backend()
    cache = PrefixCache(backend)
    _finished_session(backend, cache, LONG)
    assert cache.open(LONG)[1] == len(LONG) - 1


def test_an_open_session_is_a_donor_too():
    backend = _backend()
    cache = PrefixCache(backend)
    first, _ = cache.open(LONG)
    _fill(backend, first, LONG)
    second, reused = cache.open(LONG[:25] + [7], live=[(first, LONG)])
    assert second != first and reused == 25 and _holds(backend, second, LONG[:25])


def test_short_prefixes_and_a_disabled_cache_are_computed():
    backend = _backend()
    cache = PrefixCache(backend)
    _finished_session(backend, cache, LONG)
    short = LONG[: MIN_REUSE_TOKENS - 1] + [99]
    assert cache.open(short)[1] == 0
    off = PrefixCache(_backend(), enabled=False)
    slot, _ = off.open(LONG)
    off.release(slot, LONG)
    assert off.records == {} and off.open(LONG)[1] == 0


def test_a_record_another_record_contains_is_not_parked_twice_and_the_oldest_is_evicted():
    backend = _backend(max_slots=3)
    cache = PrefixCache(backend)
    prompts = [[k] * 20 for k in (1, 2, 3)]
    _finished_session(backend, cache, LONG)
    _finished_session(backend, cache, [9] + LONG, held=LONG[:20])  # contained in the parked LONG
    assert list(cache.records.values()) == [tuple(LONG)]  # not parked again
    for prompt in prompts:
        _finished_session(backend, cache, prompt + [0], held=prompt)
    # Never parked in slot 0 (handed out next): [1]*20 parks in slot 1 (empty), [2]*20 evicts
    # the least recently used record (LONG, slot 2), [3]*20 the next one ([1]*20, slot 1).
    assert cache.records == {1: tuple(prompts[2]), 2: tuple(prompts[1])}
    assert _holds(backend, 1, prompts[2]) and _holds(backend, 2, prompts[1])


def test_handing_out_a_parked_slot_drops_its_record():
    backend = _backend(max_slots=2)
    cache = PrefixCache(backend)
    _finished_session(backend, cache, LONG)  # parked in slot 1
    a, _ = cache.open([50] * 20)
    b, _ = cache.open([60] * 20)  # takes the parked slot
    assert {a, b} == {0, 1} and cache.records == {}
