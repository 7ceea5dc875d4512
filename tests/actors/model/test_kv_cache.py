"""SlotKVCache: slot bookkeeping, scatter/gather of one bound forward, column copies and storage
growth (on small synthetic tensors), and growth inside a real model forward (embedded target)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from actors.model.backends import SlotBackend
from actors.model.batch import linear_row
from actors.model.kv_cache import SlotKVCache
from models import resolve_model_path

LAYERS, HEADS, DIM, CAPACITY = 2, 2, 3, 6


def small_cache(max_slots: int = 4, initial_slots: int = 1) -> SlotKVCache:
    """A cache of 2 layers x 2 heads x 6 (+1 trash) columns x head dim 3."""
    return SlotKVCache(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, capacity=CAPACITY,
                       max_slots=max_slots, initial_slots=initial_slots)


def write(cache: SlotKVCache, slots: list[int], columns: list[list[int]], seed: int) -> list[torch.Tensor]:
    """Bind ``slots`` / ``columns`` and run every layer's update with random states; return the
    keys written per layer ``[B, H, L, D]`` (values are keys + 100)."""
    generator = torch.Generator().manual_seed(seed)
    cache.bind(torch.tensor(slots), torch.tensor(columns), kv_length=CAPACITY)
    written = []
    for layer in range(LAYERS):
        keys = torch.randn(len(slots), HEADS, len(columns[0]), DIM, generator=generator)  # [B, H, L, D]
        cache.update(keys, keys + 100, layer)
        written.append(keys)
    cache.unbind()
    return written


def test_storage_is_zero_and_shaped_per_slot():
    """Storage is [2, layers, slots, heads, capacity + 1, dim] zeros; layers expose views."""
    cache = small_cache(initial_slots=2)
    assert cache.storage.shape == (2, LAYERS, 2, HEADS, CAPACITY + 1, DIM)
    assert not cache.storage.any()
    assert cache.layers[1].keys.shape == (2, HEADS, CAPACITY + 1, DIM)
    assert cache.get_max_length() == CAPACITY  # column CAPACITY is the trash column padded tokens write to


def test_update_scatters_per_row_and_gathers_bound_slots():
    """Each row's new keys land in its own slot and columns; update returns [B, H, T_kv, D]."""
    cache = small_cache(initial_slots=3)
    cache.bind(torch.tensor([2, 0]), torch.tensor([[1, 3], [0, CAPACITY]]), kv_length=4)
    assert cache.get_mask_sizes(2, 0) == (4, 0) and cache.get_seq_length() == 4
    keys = torch.randn(2, HEADS, 2, DIM)  # [B=2, H, L=2, D]
    out_keys, out_values = cache.update(keys, -keys, 0)
    assert out_keys.shape == (2, HEADS, 4, DIM)  # [B, H, T_kv, D]
    assert torch.equal(out_keys[0, :, [1, 3]], keys[0])
    assert torch.equal(out_values[0, :, [1, 3]], -keys[0])
    assert torch.equal(out_keys[1, :, 0], keys[1, :, 0])
    assert torch.equal(cache.layers[0].keys[0, :, CAPACITY], keys[1, :, 1])  # padding -> trash column
    assert not cache.layers[0].keys[1].any() and not cache.layers[1].keys.any()
    cache.unbind()
    with pytest.raises(RuntimeError, match="bind"):
        cache.update(keys, keys, 0)


def test_allocate_free_and_growth_keep_contents():
    """Slots come lowest-first; growth doubles storage and keeps what existing slots hold;
    allocating past max_slots raises naming max_slots."""
    cache = small_cache(max_slots=5, initial_slots=2)
    assert [cache.allocate(), cache.allocate()] == [0, 1]
    written = write(cache, [1, 0], [[0, 1], [2, 3]], seed=0)
    before = cache.storage.clone()  # [2, layers, 2, H, C + 1, D]
    assert cache.allocate() == 2 and cache.num_slots == 4
    assert torch.equal(cache.storage[:, :, :2], before)
    assert torch.equal(cache.layers[1].keys[1, :, [0, 1]], written[1][0])
    assert not cache.storage[:, :, 2:].any()
    assert [cache.allocate(), cache.allocate()] == [3, 4] and cache.num_slots == 5
    with pytest.raises(RuntimeError, match="max_slots=5"):
        cache.allocate()
    cache.free(3)
    assert cache.allocate() == 3
    with pytest.raises(ValueError, match="slot 7 is not allocated"):
        cache.free(7)


def test_copy_columns_moves_every_layer_keys_and_values():
    """copy_columns copies src -> dst in one slot for keys and values of all layers."""
    cache = small_cache(initial_slots=2)
    slot = cache.allocate()
    other = cache.allocate()
    write(cache, [slot, other], [[2, 3, 4], [2, 3, 4]], seed=1)
    expected = cache.storage[:, :, slot, :, [3, 4]].clone()  # [2, layers, H, 2, D]
    untouched = cache.storage[:, :, other].clone()
    cache.copy_columns(slot, [3, 4], [0, 1])
    assert torch.equal(cache.storage[:, :, slot, :, [0, 1]], expected)
    assert torch.equal(cache.storage[:, :, other], untouched)
    sources = cache.storage[:, :, slot, :, [1, 2]].clone()  # [2, layers, H, 2, D]
    cache.copy_columns(slot, [1, 2], [2, 3])  # overlapping: reads before writing
    assert torch.equal(cache.storage[:, :, slot, :, [2, 3]], sources)
    with pytest.raises(ValueError, match="dst columns must be in"):
        cache.copy_columns(slot, [0], [CAPACITY])
    with pytest.raises(ValueError, match="src has 1 columns, dst has 2"):
        cache.copy_columns(slot, [0], [1, 2])


@torch.inference_mode()
def test_growth_inside_a_model_forward_keeps_sessions():
    """Four sessions fill the initial storage; a fifth grows it; all five then continue in one
    forward and match the embedded target run per row with a DynamicCache."""
    backend = SlotBackend.load(resolve_model_path("embedded:target"), max_context=64, max_slots=8, initial_slots=4)
    assert backend.cache.num_slots == 4
    generator = torch.Generator().manual_seed(3)
    contexts = [torch.randint(1, 4096, (n,), generator=generator).tolist() for n in (6, 21, 13, 40, 9)]
    slots = [backend.allocate() for _ in range(4)]
    backend.forward([linear_row(s, 0, ctx, 0, []) for s, ctx in zip(slots, contexts)])
    slots.append(backend.allocate())
    assert backend.cache.num_slots == 8
    backend.forward([linear_row(slots[4], 0, contexts[4], 0, [])])

    news = [[11, 12], [13], [14, 15, 16], [17], [18, 19]]
    rows = [linear_row(s, len(c), t, len(c), range(len(t))) for s, c, t in zip(slots, contexts, news)]
    for ctx, new, logits in zip(contexts, news, backend.forward(rows)):
        cache = DynamicCache(config=backend.model.config)
        backend.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
        expected = backend.model(input_ids=torch.tensor([new]), past_key_values=cache).logits[0]  # [L, V]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    for _ in range(3):
        backend.allocate()
    with pytest.raises(RuntimeError, match="max_slots=8"):
        backend.allocate()


def test_copy_prefix_copies_every_layer_between_slots_and_free_slots_keep_contents():
    """copy_prefix moves columns [0, n) of every layer's keys and values from one slot to
    another (the source may be free: freeing keeps contents); nothing else changes."""
    cache = small_cache(max_slots=3, initial_slots=3)
    a, b = cache.allocate(), cache.allocate()
    write(cache, [a], [[0, 1, 2, 3]], seed=4)
    before = cache.storage.clone()  # [2, layers, S, H, C + 1, D]
    cache.free(a)
    assert cache.free_slots() == [a, 2]
    cache.copy_prefix(a, b, 3)
    assert torch.equal(cache.storage[:, :, b, :, :3], before[:, :, a, :, :3])
    assert torch.equal(cache.storage[:, :, b, :, 3:], before[:, :, b, :, 3:])
    assert torch.equal(cache.storage[:, :, a], before[:, :, a])
    with pytest.raises(ValueError, match="dst_slot"):
        cache.copy_prefix(a, 3, 1)
    with pytest.raises(ValueError, match="length"):
        cache.copy_prefix(a, b, CAPACITY + 1)


def test_bound_run_of_slots_is_read_in_place():
    """bind(first_slot=...) returns views of the storage (no copy) holding the written columns."""
    cache = small_cache(max_slots=4, initial_slots=4)
    slots = [cache.allocate() for _ in range(3)]
    keys = torch.randn(3, HEADS, 1, DIM)  # [B, H, L, D]
    cache.bind(torch.tensor(slots), torch.tensor([[2], [0], [1]]), kv_length=3, first_slot=0)
    read_keys, _ = cache.layers[0].update(keys, keys.clone(), 0)
    cache.unbind()
    assert read_keys.data_ptr() == cache.storage[0, 0, 0].data_ptr()  # a view, not a gathered copy
    for row, column in enumerate((2, 0, 1)):
        assert torch.equal(read_keys[row, :, column], keys[row, :, 0])
    with pytest.raises(ValueError, match="first_slot"):
        cache.bind(torch.tensor(slots), torch.tensor([[0], [0], [0]]), kv_length=1, first_slot=2)


def test_a_bound_run_writes_its_columns_and_reads_its_slot_in_place():
    """bind_run(slot, start, length): the new keys/values land in columns [start, start + length)
    of that slot only, and every layer reads the slot's columns [0, start + length) as a view."""
    cache = small_cache(max_slots=4, initial_slots=4)
    slots = [cache.allocate() for _ in range(3)]
    before = cache.storage.clone()
    keys, values = torch.randn(1, HEADS, 2, DIM), torch.randn(1, HEADS, 2, DIM)  # [1, H, L, D]
    cache.bind_run(slots[1], 3, 2)
    read_keys, read_values = cache.layers[1].update(keys, values, 1)
    cache.unbind()
    assert read_keys.shape == (1, HEADS, 5, DIM)
    assert read_keys.data_ptr() == cache.storage[0, 1, slots[1]].data_ptr()  # a view of the slot
    assert torch.equal(read_keys[0, :, 3:5], keys[0]) and torch.equal(read_values[0, :, 3:5], values[0])
    changed = (cache.storage != before).nonzero().tolist()
    assert changed and {(kind, layer, slot) for kind, layer, slot, *_ in changed} == {(0, 1, slots[1]), (1, 1, slots[1])}
    assert {column for *_, column, _ in changed} <= {3, 4}
    with pytest.raises(ValueError, match="bind_run"):
        cache.bind_run(slots[0], cache.capacity - 1, 2)
    with pytest.raises(ValueError, match="not allocated"):
        cache.bind_run(3, 0, 1)
    cache.bind_run(slots[0], 0, 1)
    cache.bind(torch.tensor([slots[0]]), torch.tensor([[0]]), kv_length=1)  # a plain bind replaces the run
    read_keys, _ = cache.layers[0].update(keys[:, :, :1], values[:, :, :1], 0)
    assert read_keys.shape == (1, HEADS, 1, DIM)
    cache.unbind()
