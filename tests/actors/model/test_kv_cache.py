"""PagedKVCache: slot bookkeeping, scatter/gather of one bound forward through block tables,
blocks allocated on demand, rollback freeing, shared prefixes with copy-on-write, the pool
running dry (on small synthetic tensors), and a real model forward on scattered blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from actors.model.backends import SlotBackend
from actors.model.batch import chains_row, linear_row
from actors.model.kv_cache import KVBlocksExhaustedError, PagedKVCache
from models import resolve_model_path

LAYERS, HEADS, DIM, CAPACITY, BLOCK = 2, 2, 3, 6, 2


def small_cache(max_slots: int = 4, num_blocks: int | None = None) -> PagedKVCache:
    """A cache of 2 layers x 2 heads x 6 columns (3 blocks of 2) x head dim 3 per slot."""
    return PagedKVCache(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, capacity=CAPACITY,
                        max_slots=max_slots, num_blocks=num_blocks, block_size=BLOCK)


def write(cache: PagedKVCache, slots: list[int], columns: list[list[int]], seed: int) -> list[torch.Tensor]:
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


def test_storage_is_zero_and_one_pool_of_blocks():
    """Storage is [2, layers, heads, (blocks + 1 trash block) * block size, dim] zeros; no block is held."""
    cache = small_cache(max_slots=2)
    assert cache.num_blocks == 2 * 3 and cache.storage.shape == (2, LAYERS, HEADS, 7 * BLOCK, DIM)
    assert not cache.storage.any()
    assert cache.layers[1].keys.shape == (HEADS, 7 * BLOCK, DIM)
    assert cache.get_max_length() == CAPACITY  # column CAPACITY writes the trash row
    assert cache.block_counts() == {"total": 6, "free": 6, "used": 0, "cached": 0}


def test_update_scatters_per_row_and_gathers_through_the_tables():
    """Each row's new keys land in its own blocks; update returns [B, H, T_kv, D]; padding
    writes the trash row; columns no block backs read the trash block (finite)."""
    cache = small_cache()
    slots = [cache.allocate() for _ in range(3)]
    cache.bind(torch.tensor([slots[2], slots[0]]), torch.tensor([[1, 3], [0, CAPACITY]]), kv_length=4)
    assert cache.get_mask_sizes(2, 0) == (4, 0) and cache.get_seq_length() == 4
    keys = torch.randn(2, HEADS, 2, DIM)  # [B=2, H, L=2, D]
    out_keys, out_values = cache.update(keys, -keys, 0)
    assert out_keys.shape == (2, HEADS, 4, DIM)  # [B, H, T_kv, D]
    assert torch.equal(out_keys[0, :, [1, 3]], keys[0]) and torch.equal(out_values[0, :, [1, 3]], -keys[0])
    assert torch.equal(out_keys[1, :, 0], keys[1, :, 0])
    assert torch.equal(cache.layers[0].keys[:, cache.trash], keys[1, :, 1])  # padding -> trash row
    assert torch.equal(out_keys[1, :, 2], keys[1, :, 1])  # slot 0 holds no block under column 2: trash
    assert not out_keys[1, :, 3].any()  # the trash block's second row: never written
    assert cache.held_blocks(slots[2]) == 2 and cache.held_blocks(slots[0]) == 1 and cache.held_blocks(slots[1]) == 0
    cache.unbind()
    with pytest.raises(RuntimeError, match="bind"):
        cache.update(keys, keys, 0)


@pytest.mark.parametrize("kv_length", range(1, CAPACITY + 1))
def test_gathered_blocks_equal_each_columns_row_at_every_length(kv_length):
    """Whole blocks gathered per row and narrowed to ``T_kv`` hold, for every row and column, what
    :meth:`PagedKVCache.read_columns` reads there (shared, copied and unheld blocks alike)."""
    cache = small_cache()
    slots = [cache.allocate() for _ in range(3)]
    write(cache, slots, [[0, 1, 2, 3, 4], [0, 1, 2, CAPACITY, CAPACITY], [5, 4, 3, 2, 1]], seed=3)
    cache.copy_prefix(slots[0], slots[1], 3)  # one shared block, one copied
    cache.truncate(slots[2], 2)  # rows past column 2 read the trash block
    cache.bind(torch.tensor([slots[1], slots[2], slots[0]]), torch.full((3, 1), CAPACITY), kv_length=kv_length)
    for layer in range(LAYERS):
        keys, values = cache.update(torch.zeros(3, HEADS, 1, DIM), torch.zeros(3, HEADS, 1, DIM), layer)
        assert keys.shape == values.shape == (3, HEADS, kv_length, DIM)
        for row, slot in enumerate([slots[1], slots[2], slots[0]]):
            expected = cache.read_columns(slot, range(kv_length))[:, layer]  # [2, H, T_kv, D]
            assert torch.equal(keys[row], expected[0]) and torch.equal(values[row], expected[1])
    cache.unbind()


def test_allocate_and_free_slots():
    """Slots come lowest-first; allocating past max_slots raises naming it; freeing twice raises."""
    cache = small_cache(max_slots=3)
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="max_slots=3"):
        cache.allocate()
    cache.free(1)
    assert cache.free_slots() == [1] and cache.allocate() == 1
    with pytest.raises(ValueError, match="slot 7 is not allocated"):
        cache.free(7)


def test_blocks_follow_the_written_columns_and_rollback_frees_them():
    """A slot holds blocks only under the columns written (a draft chain far out included);
    truncate gives back every block past the kept length and keeps what is below it."""
    cache = small_cache(max_slots=2)
    slot = cache.allocate()
    written = write(cache, [slot], [[0, 1, 2]], seed=0)
    assert cache.held_blocks(slot) == 2 and cache.block_counts()["used"] == 2
    write(cache, [slot], [[5, CAPACITY, CAPACITY]], seed=1)  # a scratch column: its block only
    assert cache.held_blocks(slot) == 3 and cache.held_columns(slot) == CAPACITY
    cache.truncate(slot, 2)  # rollback to 2 columns: blocks 1 and 2 go back
    assert cache.held_blocks(slot) == 1 and cache.held_columns(slot) == 2
    assert cache.block_counts() == {"total": 6, "free": 5, "used": 1, "cached": 0}
    assert torch.equal(cache.read_columns(slot, [0, 1])[0, 1], written[1][0, :, :2])  # [H, 2, D] kept
    cache.truncate(slot, 0)
    assert cache.held_blocks(slot) == 0 and cache.block_counts()["free"] == 6


def test_copy_columns_moves_every_layer_keys_and_values():
    """copy_columns copies src -> dst in one slot for keys and values of all layers."""
    cache = small_cache()
    slot, other = cache.allocate(), cache.allocate()
    write(cache, [slot, other], [[2, 3, 4], [2, 3, 4]], seed=1)
    expected = cache.read_columns(slot, [3, 4])  # [2, layers, H, 2, D]
    untouched = cache.read_columns(other, range(5))
    cache.copy_columns(slot, [3, 4], [0, 1])
    assert torch.equal(cache.read_columns(slot, [0, 1]), expected)
    assert torch.equal(cache.read_columns(other, range(5)), untouched)
    sources = cache.read_columns(slot, [1, 2])
    cache.copy_columns(slot, [1, 2], [2, 3])  # overlapping: reads before writing
    assert torch.equal(cache.read_columns(slot, [2, 3]), sources)
    with pytest.raises(ValueError, match="dst columns must be in"):
        cache.copy_columns(slot, [0], [CAPACITY])
    with pytest.raises(ValueError, match="src has 1 columns, dst has 2"):
        cache.copy_columns(slot, [0], [1, 2])


def test_copy_prefix_shares_full_blocks_and_copies_on_write():
    """copy_prefix shares the full blocks of columns [0, n) (no copy) and copies the partial
    last one; a write into a shared block copies it first, so the other slot keeps its keys."""
    cache = small_cache(max_slots=3)
    a, b = cache.allocate(), cache.allocate()
    write(cache, [a], [[0, 1, 2, 3]], seed=4)
    before = cache.read_columns(a, range(4))
    cache.free(a)  # a freed slot keeps its blocks (stale contents)
    cache.copy_prefix(a, b, 3)
    assert cache.block_counts() == {"total": 9, "free": 6, "used": 2, "cached": 1}  # block 0 shared, one copied
    assert torch.equal(cache.read_columns(b, range(3)), before[:, :, :, :3])
    write(cache, [b], [[1]], seed=5)  # into the shared block: copy-on-write
    assert torch.equal(cache.read_columns(a, range(4)), before)
    assert cache.block_counts()["used"] == 2 and cache.block_counts()["cached"] == 2
    with pytest.raises(ValueError, match="dst_slot"):
        cache.copy_prefix(a, 3, 1)
    with pytest.raises(ValueError, match="length"):
        cache.copy_prefix(a, b, 5)  # slot a holds 4 columns


def test_a_dry_pool_takes_back_freed_slots_blocks_then_refuses():
    """With every block taken, a new block comes from the least recently freed slot's; when
    only open slots hold blocks the write is refused naming the numbers."""
    cache = small_cache(max_slots=3, num_blocks=3)
    a, b = cache.allocate(), cache.allocate()
    write(cache, [a], [[0, 1, 2]], seed=0)
    write(cache, [b], [[0]], seed=1)
    cache.free(a)
    write(cache, [b], [[2]], seed=2)  # no free block: slot a's go back
    assert cache.held_blocks(a) == 0 and cache.held_columns(a) == 0 and cache.held_blocks(b) == 2
    write(cache, [b], [[4]], seed=3)
    with pytest.raises(KVBlocksExhaustedError, match="all 3 KV blocks"):
        cache.bind(torch.tensor([cache.allocate()]), torch.tensor([[0]]), kv_length=1)


def test_a_bound_run_writes_its_columns_and_reads_its_slot():
    """bind_run(slot, start, length): the new keys/values land in columns [start, start + length)
    of that slot only, and every layer reads the slot's columns [0, start + length)."""
    cache = small_cache()
    slots = [cache.allocate() for _ in range(3)]
    keys, values = torch.randn(1, HEADS, 2, DIM), torch.randn(1, HEADS, 2, DIM)  # [1, H, L, D]
    cache.bind_run(slots[1], 3, 2)
    read_keys, read_values = cache.layers[1].update(keys, values, 1)
    cache.unbind()
    assert read_keys.shape == (1, HEADS, 5, DIM)
    assert torch.equal(read_keys[0, :, 3:5], keys[0]) and torch.equal(read_values[0, :, 3:5], values[0])
    assert cache.held_blocks(slots[1]) == 2 and not cache.held_blocks(slots[0])
    with pytest.raises(ValueError, match="bind_run"):
        cache.bind_run(slots[0], cache.capacity - 1, 2)
    with pytest.raises(ValueError, match="not allocated"):
        cache.bind_run(3, 0, 1)


def _reference(backend: SlotBackend, context: list[int], new: list[int]) -> torch.Tensor:
    """Logits ``[L, V]`` of ``new`` after ``context``, from a DynamicCache."""
    cache = DynamicCache(config=backend.model.config)
    backend.model(input_ids=torch.tensor([context]), past_key_values=cache)
    return backend.model(input_ids=torch.tensor([new]), past_key_values=cache).logits[0]


@torch.inference_mode()
def test_model_rows_on_scattered_blocks_with_drafts_and_rollback():
    """The embedded target over blocks of 4 tokens, sessions' blocks interleaved: prefill, two
    draft chains in one row, keep chain 1 (column copy), roll back (blocks freed), continue: the
    logits match a DynamicCache run of the same tokens every step."""
    backend = SlotBackend.load(resolve_model_path("embedded:target"), max_context=64, max_slots=4, lean_forward=True)
    backend.cache = PagedKVCache.from_config(backend.model.config, capacity=backend.capacity, max_slots=4, block_size=4)
    generator = torch.Generator().manual_seed(3)
    contexts = [torch.randint(1, 4096, (n,), generator=generator).tolist() for n in (9, 14)]
    slots = [backend.allocate() for _ in contexts]
    for step in range(3):  # interleaved prefill chunks: the two slots' blocks alternate in the pool
        backend.forward([linear_row(s, 5 * step, c[5 * step : 5 * step + 5], 5 * step, [])
                         for s, c in zip(slots, contexts) if len(c) > 5 * step])
    slot, context = slots[0], contexts[0]
    chains = [[21, 22, 23], [31, 32, 33]]
    row = chains_row(slot, len(context), chains, len(context), range(6))
    logits = backend.forward([row])[0]  # [6, V]
    for k, chain in enumerate(chains):
        torch.testing.assert_close(logits[3 * k : 3 * k + 3], _reference(backend, context, chain), atol=1e-4, rtol=0)
    before = backend.cache.held_blocks(slot)
    src = [len(context) + 3 + j for j in range(2)]
    backend.copy_columns(slot, src, [len(context) + j for j in range(2)])  # keep 2 tokens of chain 1
    backend.truncate(slot, len(context) + 2)
    assert backend.cache.held_blocks(slot) < before
    kept = context + chains[1][:2]
    new = [41, 42]
    (got,) = backend.forward([linear_row(slot, len(kept), new, len(kept), range(2))])
    torch.testing.assert_close(got, _reference(backend, kept, new), atol=1e-4, rtol=0)
    (other,) = backend.forward([linear_row(slots[1], len(contexts[1]), new, len(contexts[1]), range(2))])
    torch.testing.assert_close(other, _reference(backend, contexts[1], new), atol=1e-4, rtol=0)
