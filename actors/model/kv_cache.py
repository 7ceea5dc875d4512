"""A paged KV cache that runs inside a stock transformers decoder forward.

Every session owns a *slot*: a block table mapping its columns to fixed-size blocks of one
pool shared by every session of the model (:class:`PagedKVCache`), so memory follows the
tokens a session holds, not the whole context it may reach. Which columns a new token sees is
decided by the caller's attention mask (:mod:`actors.model.batch`), so rollback is a length
change (:meth:`PagedKVCache.truncate` gives back the blocks past it) and moving an accepted
draft is a column copy (:meth:`PagedKVCache.copy_columns`). A prefix is shared by reference
count, whole blocks at a time (:meth:`PagedKVCache.copy_prefix`), and copied on write.

Before a forward the caller :meth:`~PagedKVCache.bind` s the rows' slots ``[B]``, their write
columns ``[B, L]`` and the key length ``T_kv``; each attention layer then calls ``update``,
which scatters the new keys/values to their rows and returns ``[B, H, T_kv, D]`` gathered
through the block tables: whole blocks at a time (one index per row, head and block, each
copying ``block_size`` rows), then narrowed to ``T_kv`` columns (a strided view).

The gathered keys/values of a layer are read by that layer's attention only, so every layer
gathers into the same two reused buffers instead of fresh tensors. A fresh multi-megabyte
tensor per layer per forward is a fresh ``mmap`` from the allocator while the gathered size
keeps growing past its threshold, and faulting its pages in cost more than the attention
itself: a run of 16-row decode forwards of the embedded target took 39.9 ms a forward with fresh
tensors and 16.4 ms with the reused buffers (transformers with a DynamicCache: 15.7 ms; the
decode run of ``python -m benchmarks.micro.forward_micro``, ``docs/benchmarks.md``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

#: Tokens per KV block (vLLM's default).
DEFAULT_BLOCK_SIZE = 16


def cache_shape(config: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a transformers decoder ``config``: what one cached
    token costs per layer (``head_dim`` defaults to ``hidden_size / num_attention_heads``,
    ``num_key_value_heads`` to ``num_attention_heads``)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return int(config.num_hidden_layers), int(kv_heads), int(head_dim)


class PagedKVLayer(CacheLayerMixin):
    """One layer's view of a :class:`PagedKVCache`; the storage lives in the cache."""

    is_sliding = False
    is_croppable = False
    is_initialized = True

    def __init__(self, cache: PagedKVCache, layer_idx: int):
        self.cache = cache
        self.layer_idx = layer_idx

    @property
    def keys(self) -> torch.Tensor:
        """This layer's keys, ``[kv_heads, (blocks + 1) * block_size, head_dim]``."""
        return self.cache.storage[0, self.layer_idx]

    @property
    def values(self) -> torch.Tensor:
        """This layer's values, ``[kv_heads, (blocks + 1) * block_size, head_dim]``."""
        return self.cache.storage[1, self.layer_idx]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: storage is allocated up front."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter ``[B, H, L, D]`` new keys/values to the bound columns -> ``[B, H, T_kv, D]``."""
        return self.cache.write_and_gather(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(T_kv, 0)``: the key length ``update`` returns, whatever the query length."""
        return self.cache.kv_length, 0

    def get_seq_length(self) -> int:
        """The bound key length ``T_kv`` (0 when unbound). Positions never come from here."""
        return self.cache.kv_length

    def get_max_length(self) -> int:
        """Usable columns per slot."""
        return self.cache.capacity

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Not supported: rows map to slots through :meth:`PagedKVCache.bind`."""
        raise NotImplementedError("PagedKVCache has no beam reordering; bind the slots to read instead")


class KVBlocksExhaustedError(RuntimeError):
    """Every block of the pool is held by an open sequence; the message names the numbers."""


class PagedKVCache(Cache):
    """Key/value storage in fixed-size blocks shared by every sequence ("slot") of one model.

    Storage is ``[2 (keys, values), layers, kv_heads, (num_blocks + 1) * block_size, head_dim]``:
    one row per token of every block, plus one trash block whose first row (the trash row) padded
    tokens write to and nothing attends. Slot ``s``'s column ``c`` lives in row ``table[s, c //
    block_size] * block_size + c % block_size``; a column whose block is not allocated reads the
    (finite) trash block, which masks hide. Blocks are allocated when a forward or a copy writes
    their first column, shared by reference count (:meth:`copy_prefix`) and copied before a
    write to a shared one (copy-on-write); :meth:`truncate` frees the blocks past a length
    (rollback). A freed slot keeps its blocks (its stale contents, which prefix caching reads) until the pool runs dry:
    then the blocks of the least recently freed slots go back first. Zero-initialised (never
    ``torch.empty``: a NaN key poisons sdpa even at a masked position).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        max_slots: int,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if capacity < 1 or max_slots < 1 or block_size < 1:
            raise ValueError(f"capacity, max_slots and block_size must be >= 1, got {capacity}, {max_slots}, {block_size}")
        super().__init__(layers=[PagedKVLayer(self, i) for i in range(num_layers)])
        self.capacity = capacity
        self.max_slots = max_slots
        self.block_size = block_size
        self.blocks_per_slot = -(-capacity // block_size)
        self.num_blocks = max_slots * self.blocks_per_slot if num_blocks is None else int(num_blocks)
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.heads, self.head_dim = kv_heads, head_dim
        self.trash = self.num_blocks * block_size  # the trash row: the first of the trash block
        self._rows_per_head = self.trash + block_size
        self.storage = torch.zeros((2, num_layers, kv_heads, self._rows_per_head, head_dim), dtype=dtype,
                                   device=self.device)  # [2, layers, H, (num_blocks + 1) * block_size, D]
        # Block tables: -1 where a slot holds no block. The device copy is what forwards index.
        self._tables = [[-1] * self.blocks_per_slot for _ in range(max_slots)]
        self.block_tables = torch.full((max_slots, self.blocks_per_slot), -1, dtype=torch.long,
                                       device=self.device)  # [S, blocks_per_slot]
        self._refs = [0] * self.num_blocks  # per block: the slots whose table holds it
        self._free_blocks = list(range(self.num_blocks))  # heap, lowest first
        self._free = list(range(max_slots))  # heap of free slots
        self._allocated: set[int] = set()
        self._released: dict[int, None] = {}  # free slots holding blocks, least recently freed first
        self._gather_buffer = torch.empty((2, 0), dtype=dtype, device=self.device)  # [2, B * H * n_blocks * block_size * D]
        #: Called when no block is free and no freed slot holds one: takes an open slot's blocks
        #: back (a preempted session, :mod:`actors.worker.engine`) -> whether it did.
        self.reclaim: Callable[[], bool] | None = None
        #: Per-token states kept next to the keys/values (an EAGLE-3 head's aux states of the target,
        #: :meth:`enable_aux`): ``[(num_blocks + 1) * block_size, width]``, the rows of the KV storage.
        self.aux: torch.Tensor | None = None
        self.unbind()

    def enable_aux(self, width: int, dtype: torch.dtype | None = None) -> None:
        """Keep ``width`` floats per token next to its keys/values (:meth:`write_aux`, :meth:`read_aux`):
        moved with the columns (:meth:`copy_columns`, :meth:`copy_prefix`, copy-on-write) as they are."""
        self.aux = torch.zeros((self._rows_per_head, int(width)), dtype=dtype or self.dtype, device=self.device)

    def write_aux(self, states: torch.Tensor) -> None:
        """Write ``states`` ``[B, L, width]`` of the bound rows to their bound columns (see :meth:`bind`)."""
        if self.aux is None or self._slots is None:
            raise RuntimeError("write_aux: no aux storage (enable_aux) or no rows bound")
        rows = self._physical(self._slots, self._write_columns)  # [B, L]
        self.aux.index_copy_(0, rows.reshape(-1), states.reshape(-1, self.aux.shape[1]).to(self.aux.dtype))

    def read_aux(self, slot: int, columns: Sequence[int]) -> torch.Tensor:
        """The aux states of ``slot``'s ``columns`` -> ``[len(columns), width]`` (a copy)."""
        if self.aux is None:
            raise RuntimeError("read_aux: no aux storage (enable_aux)")
        return self.aux.index_select(0, torch.tensor(self._rows(slot, columns), dtype=torch.long, device=self.device))

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> PagedKVCache:
        """Size the cache for a transformers decoder ``config`` (layers, kv heads, head dim)."""
        num_layers, kv_heads, head_dim = cache_shape(config)
        return cls(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, **kwargs)

    @staticmethod
    def block_bytes(config: Any, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block holds: layers x 2 (keys, values) x kv heads x head dim x ``block_size``
        x the dtype's bytes."""
        num_layers, kv_heads, head_dim = cache_shape(config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * kv_heads * head_dim * block_size * itemsize

    @staticmethod
    def slot_bytes(config: Any, capacity: int, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
        """Bytes of the blocks one sequence of ``capacity`` columns holds at most."""
        return -(-capacity // block_size) * PagedKVCache.block_bytes(config, block_size, dtype)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the block pool (the storage but its trash block)."""
        return self.storage[:, :, :, : self.trash].numel() * self.storage.element_size()

    # -- slots ------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Slots (sequences) the cache tracks."""
        return self.max_slots

    @property
    def allocated(self) -> frozenset[int]:
        """Slots handed out and not yet freed."""
        return frozenset(self._allocated)

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is handed out."""
        return slot in self._allocated

    def allocate(self) -> int:
        """Hand out the lowest free slot (with whatever blocks it still holds)."""
        if not self._free:
            raise RuntimeError(f"PagedKVCache is full: all max_slots={self.max_slots} slots are allocated; free one first")
        slot = heapq.heappop(self._free)
        self._allocated.add(slot)
        self._released.pop(slot, None)
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot``; its blocks stay (stale contents) until the pool needs them."""
        self._check_allocated(slot)
        self._allocated.remove(slot)
        heapq.heappush(self._free, slot)
        if self.held_blocks(slot):
            self._released[slot] = None

    def free_slots(self) -> list[int]:
        """Slots not handed out, lowest first."""
        return sorted(self._free)

    def _check_allocated(self, slot: int) -> None:
        if not self.is_allocated(slot):
            raise ValueError(f"slot {slot} is not allocated (allocated: {sorted(self._allocated)})")

    # -- blocks -----------------------------------------------------------------------------

    def held_blocks(self, slot: int) -> int:
        """Blocks in ``slot``'s table."""
        return sum(block >= 0 for block in self._tables[slot])

    def held_columns(self, slot: int) -> int:
        """The leading columns of ``slot`` that blocks back (``[0, n)``; a freed slot's shrink
        when the pool takes its blocks back)."""
        table = self._tables[slot]
        first_missing = next((i for i, block in enumerate(table) if block < 0), len(table))
        return min(first_missing * self.block_size, self.capacity)

    def block_counts(self) -> dict[str, int]:
        """``{"total", "free", "used", "cached"}`` blocks: free ones hold nothing, used ones are
        held by an open slot, cached ones only by freed slots (given back when needed)."""
        free = len(self._free_blocks)
        used = {block for slot in self._allocated for block in self._tables[slot] if block >= 0}
        return {"total": self.num_blocks, "free": free, "used": len(used),
                "cached": self.num_blocks - free - len(used)}

    def truncate(self, slot: int, length: int) -> None:
        """Free ``slot``'s blocks past its first ``length`` columns (those holding no column below it)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"truncate: length must be in [0, {self.capacity}], got {length}")
        table = self._tables[slot]
        dropped = [index for index in range(-(-length // self.block_size), self.blocks_per_slot) if table[index] >= 0]
        for index in dropped:
            self._unref(table[index])
            table[index] = -1
        if dropped:
            self._sync_table(slot, dropped)
        if not any(block >= 0 for block in table):
            self._released.pop(slot, None)

    def _unref(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            heapq.heappush(self._free_blocks, block)

    def _sync_table(self, slot: int, indices: Sequence[int]) -> None:
        """Copy entries ``indices`` of ``slot``'s host table to the device table."""
        table = self._tables[slot]
        self.block_tables[slot, list(indices)] = torch.tensor([table[i] for i in indices], dtype=torch.long,
                                                              device=self.device)

    def _new_block(self, keep: int) -> int:
        """A block of nobody's, taking back the blocks of the least recently freed slots (never
        ``keep``'s) when none is free, then those :attr:`reclaim` gives back."""
        while not self._free_blocks:
            victim = next((slot for slot in self._released if slot != keep), None)
            if victim is None and self.reclaim is not None and self.reclaim():
                continue
            if victim is None:
                counts = self.block_counts()
                raise KVBlocksExhaustedError(
                    f"all {self.num_blocks} KV blocks of {self.block_size} tokens are held by open sequences "
                    f"({counts['used']} used); raise engine.kv_cache_memory or run fewer requests at once")
            self.truncate(victim, 0)
        block = heapq.heappop(self._free_blocks)
        self._refs[block] = 1
        return block

    def _writable(self, slot: int, columns: set[int]) -> None:
        """Give ``slot`` a block of its own under every column in ``columns``: a new one where it
        holds none, a copy where it shares one (copy-on-write)."""
        table, changed = self._tables[slot], []
        for index in sorted({column // self.block_size for column in columns}):
            block = table[index]
            if block >= 0 and self._refs[block] == 1:
                continue
            fresh = self._new_block(keep=slot)
            if block >= 0:  # shared: copy its rows, then let go of it
                self._copy_rows(block, fresh, self.block_size)
                self._unref(block)
            table[index] = fresh
            changed.append(index)
        if changed:
            self._sync_table(slot, changed)

    def _copy_rows(self, src_block: int, dst_block: int, rows: int) -> None:
        src, dst = src_block * self.block_size, dst_block * self.block_size
        self.storage[:, :, :, dst : dst + rows] = self.storage[:, :, :, src : src + rows]
        if self.aux is not None:
            self.aux[dst : dst + rows] = self.aux[src : src + rows]

    def _rows(self, slot: int, columns: Sequence[int]) -> list[int]:
        """Storage rows of ``slot``'s ``columns`` (the trash row where no block backs one)."""
        table, size = self._tables[slot], self.block_size
        return [table[c // size] * size + c % size if table[c // size] >= 0 else self.trash for c in columns]

    def read_columns(self, slot: int, columns: Sequence[int]) -> torch.Tensor:
        """Every layer's keys/values of ``slot``'s ``columns``: ``[2, layers, H, len(columns), D]`` (a copy)."""
        return self.storage.index_select(3, torch.tensor(self._rows(slot, columns), dtype=torch.long, device=self.device))

    # -- copies -----------------------------------------------------------------------------

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Make columns ``[0, length)`` of ``dst_slot`` hold those of ``src_slot``: its full
        blocks shared (reference counts), the last partial one copied. ``dst_slot`` lets go of
        what it held; either slot may be free."""
        for name, slot in (("src_slot", src_slot), ("dst_slot", dst_slot)):
            if not 0 <= slot < self.max_slots:
                raise ValueError(f"copy_prefix: {name} must be in [0, {self.max_slots}), got {slot}")
        if length and not 0 < length <= self.held_columns(src_slot):
            raise ValueError(f"copy_prefix: length must be in [0, {self.held_columns(src_slot)}] "
                             f"(the columns slot {src_slot} holds), got {length}")
        if src_slot == dst_slot or not length:
            return
        self.truncate(dst_slot, 0)
        full, rest = divmod(length, self.block_size)
        source, target = self._tables[src_slot], self._tables[dst_slot]
        for index in range(full):
            target[index] = source[index]
            self._refs[source[index]] += 1
        if rest:
            target[full] = self._new_block(keep=dst_slot)
            self._copy_rows(source[full], target[full], rest)
        self._sync_table(dst_slot, range(full + (1 if rest else 0)))
        if dst_slot not in self._allocated:
            self._released[dst_slot] = None

    def copy_columns(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy keys/values of every layer from columns ``src`` to columns ``dst`` of ``slot``.

        Keys already carry their rotary position, so moving an accepted draft chain to right
        after the prefix keeps positions right. Overlapping ``src``/``dst`` is fine (read first).
        """
        self._check_allocated(slot)
        if len(src) != len(dst):
            raise ValueError(f"copy_columns: src has {len(src)} columns, dst has {len(dst)}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"copy_columns: dst columns must be distinct, got {list(dst)}")
        for name, columns in (("src", src), ("dst", dst)):
            if any(not 0 <= c < self.capacity for c in columns):
                raise ValueError(f"copy_columns: {name} columns must be in [0, {self.capacity}), got {list(columns)}")
        if not src:
            return
        source = torch.tensor(self._rows(slot, src), dtype=torch.long, device=self.device)  # [n]
        values = self.storage.index_select(3, source)  # [2, layers, H, n, D]: read before any write
        aux = None if self.aux is None else self.aux.index_select(0, source)  # [n, width]
        self._writable(slot, set(dst))
        target = torch.tensor(self._rows(slot, dst), dtype=torch.long, device=self.device)  # [n]
        self.storage.index_copy_(3, target, values)
        if aux is not None:
            self.aux.index_copy_(0, target, aux)

    # -- one forward ------------------------------------------------------------------------

    def bind(self, slots: torch.Tensor, write_columns: torch.Tensor, kv_length: int) -> None:
        """Set up the next forward: row ``b`` lives in ``slots[b]`` ``[B]``, writes its new tokens
        to ``write_columns[b]`` ``[B, L]`` (column ``capacity``: the trash row), and reads columns
        ``[0, kv_length)``, gathered through the block tables. Blocks under the written columns
        are allocated (or copied, when shared) first."""
        if slots.dim() != 1 or write_columns.dim() != 2 or write_columns.shape[0] != slots.shape[0]:
            raise ValueError(f"bind: need slots [B] and write_columns [B, L], got {tuple(slots.shape)}, "
                             f"{tuple(write_columns.shape)}")
        if not 0 < kv_length <= self.capacity:
            raise ValueError(f"bind: kv_length must be in [1, {self.capacity}], got {kv_length}")
        host_columns = write_columns.tolist()
        for slot, columns in zip(slots.tolist(), host_columns):
            self._writable(slot, {c for c in columns if c < self.capacity})
        self.unbind()
        self._slots = slots.to(self.device)  # [B]
        self._write_columns = write_columns.to(self.device)  # [B, L]
        self.kv_length = kv_length
        self._write_index, self._read_index = self._bind_indices()  # [layers, 2 B L H], [B H n_blocks]

    def bind_run(self, slot: int, start: int, length: int) -> None:
        """Set up a forward of one row in ``slot`` whose ``length`` new tokens go to columns
        ``[start, start + length)`` and which reads columns ``[0, start + length)``."""
        self._check_allocated(slot)
        if start < 0 or length < 1 or start + length > self.capacity:
            raise ValueError(f"bind_run: columns [{start}, {start + length}) must lie in [0, {self.capacity})")
        columns = torch.arange(start, start + length, device=self.device)[None]  # [1, L]
        self.bind(torch.tensor([slot], device=self.device), columns, start + length)

    def decode_rows(self, slot: int, column: int) -> torch.Tensor:
        """For a one-token forward of ``slot`` writing ``column``: the block under the column made
        the slot's own (allocated, or copied where shared), then the storage row of every column of
        the slot ``[capacity]`` (the trash row where no block backs it; a CUDA graph's input)."""
        self._check_allocated(slot)
        self._writable(slot, {column})
        columns = torch.arange(self.capacity, device=self.device)[None]  # [1, capacity]
        return self._physical(torch.tensor([slot], device=self.device), columns)[0]  # [capacity]

    def _physical(self, slots: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Storage rows of ``columns`` ``[B, N]`` of ``slots`` ``[B]``: the trash row where a
        column is ``capacity`` or no block backs it -> ``[B, N]``."""
        index = (columns // self.block_size).clamp_(max=self.blocks_per_slot - 1)  # [B, N]
        blocks = self.block_tables[slots[:, None], index]  # [B, N]
        rows = blocks * self.block_size + columns % self.block_size  # [B, N]
        return torch.where((blocks >= 0) & (columns < self.capacity), rows, self.trash)

    def _bind_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``storage.view(-1, D)`` the bound rows write, per layer in ``[2 (keys,
        values), B, L, H]`` order ``[layers, 2 B L H]``, and the blocks of one layer's
        ``[H * (num_blocks + 1), block_size * D]`` view they read (the trash block where a slot
        holds none), in ``[B, H, n_blocks]`` order ``[B H n_blocks]``, ``n_blocks`` covering ``T_kv``."""
        layers, rows = len(self.layers), self._rows_per_head
        heads = torch.arange(self.heads, device=self.device)  # [H]
        written = self._physical(self._slots, self._write_columns)  # [B, L]
        within_layer = written[:, :, None] + heads * rows  # [B, L, H]
        layer_offsets = (torch.arange(2, device=self.device)[None, :] * layers
                         + torch.arange(layers, device=self.device)[:, None]) * (self.heads * rows)  # [layers, 2]
        write_index = (layer_offsets[:, :, None, None, None] + within_layer).view(layers, -1)
        blocks = self.block_tables[self._slots, : -(-self.kv_length // self.block_size)]  # [B, n_blocks]
        blocks = torch.where(blocks >= 0, blocks, self.num_blocks)  # the trash block where none is held
        read = blocks[:, None, :] + (heads * (self.num_blocks + 1))[:, None]  # [B, H, n_blocks]
        return write_index, read.reshape(-1)

    def unbind(self) -> None:
        """Forget the bound rows (``update`` then refuses to run)."""
        self._slots: torch.Tensor | None = None
        self._write_columns: torch.Tensor | None = None
        self._write_index: torch.Tensor | None = None
        self._read_index: torch.Tensor | None = None
        self.kv_length = 0

    def write_and_gather(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, L, D]`` new keys/values of layer ``layer_idx`` to the bound columns of
        the bound slots; return that layer's ``[B, H, T_kv, D]`` keys and values of those slots."""
        if self._slots is None:
            raise RuntimeError("PagedKVCache.update called with no rows bound; call bind() before the forward")
        if key_states.shape[0] != self._slots.shape[0] or key_states.shape[2] != self._write_columns.shape[1]:
            raise ValueError(f"update: key_states {tuple(key_states.shape)} do not match the bound rows "
                             f"[B={self._slots.shape[0]}, L={self._write_columns.shape[1]}]")
        # Keys and values in one copy: [2, B, L, H, D] rows of storage's [..., D] rows (see _bind_indices).
        written = torch.stack((key_states.transpose(1, 2), value_states.transpose(1, 2))).to(self.dtype)
        self.storage.view(-1, self.head_dim).index_copy_(
            0, self._write_index[layer_idx], written.view(-1, self.head_dim))
        read, width = [], self.block_size * self.head_dim
        for kind, gathered in enumerate(self._gather_views(self._slots.shape[0])):
            layer = self.storage[kind, layer_idx].view(-1, width)  # [H * (num_blocks + 1), block_size * D]
            torch.index_select(layer, 0, self._read_index, out=gathered.view(-1, width))
            read.append(gathered[:, :, : self.kv_length])  # [B, H, T_kv, D]
        return read[0], read[1]

    def _gather_views(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values views ``[B, H, n_blocks * block_size, D]`` into the reused gather
        buffer, ``n_blocks`` covering ``T_kv`` (valid until the next layer's ``update``: only that
        layer's attention reads them)."""
        columns = -(-self.kv_length // self.block_size) * self.block_size
        shape = (batch, self.heads, columns, self.head_dim)
        size = batch * self.heads * columns * self.head_dim
        if self._gather_buffer.shape[1] < size:  # doubling: contexts grow a column per decoded token
            grown = max(size, 2 * self._gather_buffer.shape[1])
            self._gather_buffer = torch.empty((2, grown), dtype=self.dtype, device=self.device)
        return self._gather_buffer[0, :size].view(shape), self._gather_buffer[1, :size].view(shape)
