"""A preallocated slot KV cache that runs inside a stock transformers decoder forward.

Every session owns one *slot*: ``capacity`` storage columns of keys/values in every layer
(plus one trash column that padded tokens write to and nothing reads). Which columns a new
token sees is decided by the caller's attention mask (:mod:`actors.model.batch`), so rollback is a
length change and moving an accepted draft is a column copy (:meth:`SlotKVCache.copy_columns`).

Before a forward the caller :meth:`~SlotKVCache.bind` s the rows' slots ``[B]``, their write
columns ``[B, L]`` and the key length ``T_kv``; each attention layer then calls ``update``,
which scatters the new keys/values to their columns and returns ``[B, H, T_kv, D]`` gathered
from the bound slots. Storage starts with a few slots and doubles on demand up to
``max_slots`` (a rare copy). Storage is zero-initialised: uninitialised memory can hold NaN,
and a NaN key poisons sdpa even at a masked position.

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
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

DEFAULT_INITIAL_SLOTS = 4


def cache_shape(config: Any) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a transformers decoder ``config``: what one cached
    token costs per layer (``head_dim`` defaults to ``hidden_size / num_attention_heads``,
    ``num_key_value_heads`` to ``num_attention_heads``)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return int(config.num_hidden_layers), int(kv_heads), int(head_dim)


class SlotKVLayer(CacheLayerMixin):
    """One layer's view of a :class:`SlotKVCache`; the storage lives in the cache."""

    is_sliding = False
    is_croppable = False
    is_initialized = True

    def __init__(self, cache: SlotKVCache, layer_idx: int):
        self.cache = cache
        self.layer_idx = layer_idx

    @property
    def keys(self) -> torch.Tensor:
        """This layer's keys, ``[num_slots, kv_heads, capacity + 1, head_dim]``."""
        return self.cache.storage[0, self.layer_idx]

    @property
    def values(self) -> torch.Tensor:
        """This layer's values, ``[num_slots, kv_heads, capacity + 1, head_dim]``."""
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
        """Not supported: rows map to slots through :meth:`SlotKVCache.bind`."""
        raise NotImplementedError("SlotKVCache has no beam reordering; bind the slots to read instead")


class SlotKVCache(Cache):
    """Preallocated per-slot key/value storage for every layer: [num_slots, kv_heads, capacity + 1, head_dim]
    (the last column is a trash column that padded tokens write to and nothing reads).
    Zero-initialised (never torch.empty: NaN keys at masked positions poison sdpa)."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        max_slots: int,
        initial_slots: int = DEFAULT_INITIAL_SLOTS,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_slots < 1 or initial_slots < 1:
            raise ValueError(f"max_slots and initial_slots must be >= 1, got {max_slots}, {initial_slots}")
        super().__init__(layers=[SlotKVLayer(self, i) for i in range(num_layers)])
        self.capacity = capacity
        self.max_slots = max_slots
        self.dtype = dtype
        self.device = torch.device(device)
        self._shape = (kv_heads, capacity + 1, head_dim)
        # Keys and values of every layer in one tensor, so a column copy is one op.
        self.storage = self._zeros(min(initial_slots, max_slots))  # [2, layers, S, H, capacity + 1, D]
        # Reused by every layer's gather; grows (rarely) to the largest B * T_kv seen.
        self._gather_buffer = torch.empty((2, 0), dtype=self.dtype, device=self.device)  # [2, B * H * T_kv * D]
        self._free = list(range(self.num_slots))  # heap of free slots below num_slots
        self._allocated: set[int] = set()
        self.unbind()

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> SlotKVCache:
        """Size the cache for a transformers decoder ``config`` (layers, kv heads, head dim)."""
        num_layers, kv_heads, head_dim = cache_shape(config)
        return cls(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, **kwargs)

    @staticmethod
    def slot_bytes(config: Any, capacity: int, dtype: torch.dtype) -> int:
        """Bytes one slot of a cache built by :meth:`from_config` holds: layers x 2 (keys,
        values) x kv heads x head dim x (capacity + 1 trash column) x the dtype's bytes."""
        num_layers, kv_heads, head_dim = cache_shape(config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * kv_heads * head_dim * (capacity + 1) * itemsize

    # -- slots ------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        """Slots currently held in storage (grows up to ``max_slots``)."""
        return self.storage.shape[2]

    @property
    def allocated(self) -> frozenset[int]:
        """Slots handed out and not yet freed."""
        return frozenset(self._allocated)

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is handed out."""
        return slot in self._allocated

    def allocate(self) -> int:
        """Hand out a free slot (the lowest), growing storage when every slot is taken."""
        if not self._free:
            if self.num_slots >= self.max_slots:
                raise RuntimeError(
                    f"SlotKVCache is full: all max_slots={self.max_slots} slots are allocated; free one first"
                )
            self._grow(min(2 * self.num_slots, self.max_slots))
        slot = heapq.heappop(self._free)
        self._allocated.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot``; its stale contents stay (masks hide them, writes overwrite them)."""
        self._check_allocated(slot)
        self._allocated.remove(slot)
        heapq.heappush(self._free, slot)

    def free_slots(self) -> list[int]:
        """Slots in storage not handed out (their stale contents intact), lowest first."""
        return sorted(self._free)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Copy columns ``[0, length)`` of every layer's keys/values from ``src_slot`` to
        ``dst_slot`` (either may be free: a free slot keeps its stale contents)."""
        for name, slot in (("src_slot", src_slot), ("dst_slot", dst_slot)):
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"copy_prefix: {name} must be in [0, {self.num_slots}), got {slot}")
        if not 0 <= length <= self.capacity:
            raise ValueError(f"copy_prefix: length must be in [0, {self.capacity}], got {length}")
        if src_slot != dst_slot and length:
            self.storage[:, :, dst_slot, :, :length] = self.storage[:, :, src_slot, :, :length]

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
        index = torch.tensor([*src, *dst], dtype=torch.long, device=self.device)  # [2 * n]
        src_t, dst_t = index.split(len(src))  # [n], [n]
        view = self.storage[:, :, slot]  # [2, layers, H, capacity + 1, D]
        view.index_copy_(3, dst_t, view.index_select(3, src_t))

    def _check_allocated(self, slot: int) -> None:
        if not self.is_allocated(slot):
            raise ValueError(f"slot {slot} is not allocated (allocated: {sorted(self._allocated)})")

    def _zeros(self, slots: int) -> torch.Tensor:
        return torch.zeros(
            (2, len(self.layers), slots, *self._shape), dtype=self.dtype, device=self.device
        )  # [2, layers, slots, H, capacity + 1, D]

    def _grow(self, slots: int) -> None:
        """Reallocate storage with ``slots`` slots, keeping the existing slots' contents."""
        old = self.num_slots
        storage = self._zeros(slots)  # [2, layers, slots, H, capacity + 1, D]
        storage[:, :, :old] = self.storage
        self.storage = storage
        for slot in range(old, slots):
            heapq.heappush(self._free, slot)

    # -- one forward ------------------------------------------------------------------------

    def bind(
        self, slots: torch.Tensor, write_columns: torch.Tensor, kv_length: int, first_slot: int | None = None
    ) -> None:
        """Set up the next forward: row ``b`` lives in ``slots[b]`` ``[B]``, writes its new tokens
        to ``write_columns[b]`` ``[B, L]``, and reads columns ``[0, kv_length)``. With
        ``first_slot``, ``slots`` must be ``first_slot, first_slot + 1, ...`` and attention reads
        the storage in place (a view) instead of a gathered copy."""
        if slots.dim() != 1 or write_columns.dim() != 2 or write_columns.shape[0] != slots.shape[0]:
            raise ValueError(f"bind: need slots [B] and write_columns [B, L], got {tuple(slots.shape)}, "
                             f"{tuple(write_columns.shape)}")
        if not 0 < kv_length <= self.capacity:
            raise ValueError(f"bind: kv_length must be in [1, {self.capacity}], got {kv_length}")
        if first_slot is not None and not 0 <= first_slot <= self.num_slots - slots.shape[0]:
            raise ValueError(f"bind: first_slot {first_slot} + {slots.shape[0]} rows exceeds {self.num_slots} slots")
        self._slots = slots.to(self.device)  # [B]
        self._write_columns = write_columns.to(self.device)  # [B, L]
        self.kv_length = kv_length
        self._first_slot = first_slot
        self._run = None
        self._write_index = self._bind_write_index()  # [layers, 2 B L H]

    def bind_run(self, slot: int, start: int, length: int) -> None:
        """Set up a forward of one row in ``slot`` whose ``length`` new tokens go to columns
        ``[start, start + length)`` and which reads columns ``[0, start + length)``: the new
        keys/values are copied straight into those columns and attention reads the slot in place
        (no write index, no gather)."""
        self._check_allocated(slot)
        if start < 0 or length < 1 or start + length > self.capacity:
            raise ValueError(f"bind_run: columns [{start}, {start + length}) must lie in [0, {self.capacity})")
        self.unbind()
        self.kv_length = start + length
        self._run = (slot, start, length)

    def _bind_write_index(self) -> torch.Tensor:
        """For each layer, the rows of ``storage.view(-1, D)`` that the bound rows' new keys and
        values go to, in ``[2 (keys, values), B, L, H]`` order: ``[layers, 2 B L H]``. One
        ``index_copy_`` per layer then writes both (padded tokens all write their slot's trash
        column; nothing reads it, so which of them lands there does not matter)."""
        layers, slots = len(self.layers), self.num_slots
        heads, columns, _ = self._shape
        head_offsets = torch.arange(heads, device=self.device) * columns  # [H]
        within_layer = (self._slots[:, None, None] * (heads * columns) + head_offsets
                        + self._write_columns[:, :, None])  # [B, L, H]
        layer_offsets = (torch.arange(2, device=self.device)[None, :] * layers
                         + torch.arange(layers, device=self.device)[:, None]) * (slots * heads * columns)  # [layers, 2]
        return (layer_offsets[:, :, None, None, None] + within_layer).view(layers, -1)

    def unbind(self) -> None:
        """Forget the bound rows (``update`` then refuses to run)."""
        self._slots: torch.Tensor | None = None
        self._write_columns: torch.Tensor | None = None
        self._write_index: torch.Tensor | None = None
        self.kv_length = 0
        self._first_slot: int | None = None
        self._run: tuple[int, int, int] | None = None  # bind_run's (slot, start, length)

    def write_and_gather(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, L, D]`` new keys/values of layer ``layer_idx`` to the bound columns of
        the bound slots; return that layer's ``[B, H, T_kv, D]`` keys and values of those slots."""
        if self._run is not None:
            return self._write_and_read_run(layer_idx, key_states, value_states)
        if self._slots is None:
            raise RuntimeError("SlotKVCache.update called with no rows bound; call bind() before the forward")
        if key_states.shape[0] != self._slots.shape[0] or key_states.shape[2] != self._write_columns.shape[1]:
            raise ValueError(f"update: key_states {tuple(key_states.shape)} do not match the bound rows "
                             f"[B={self._slots.shape[0]}, L={self._write_columns.shape[1]}]")
        batch = self._slots.shape[0]
        # Keys and values in one copy: [2, B, L, H, D] rows of storage's [..., D] rows (see _bind_write_index).
        written = torch.stack((key_states.transpose(1, 2), value_states.transpose(1, 2))).to(self.dtype)
        self.storage.view(-1, self.storage.shape[-1]).index_copy_(
            0, self._write_index[layer_idx], written.view(-1, written.shape[-1]))
        read = []
        for kind in range(2):
            layer = self.storage[kind, layer_idx]  # [S, H, capacity + 1, D]
            if self._first_slot is not None:  # a view: no copy
                read.append(layer[self._first_slot : self._first_slot + batch, :, : self.kv_length])  # [B, H, T_kv, D]
            else:
                gathered = self._gather_views(batch)[kind]  # [B, H, T_kv, D]
                read.append(torch.index_select(layer[:, :, : self.kv_length], 0, self._slots, out=gathered))
        return read[0], read[1]

    def _write_and_read_run(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`write_and_gather` of a :meth:`bind_run` row: ``[1, H, L, D]`` new keys/values
        copied into their columns; ``[1, H, T_kv, D]`` views of the slot returned."""
        slot, start, length = self._run
        if key_states.shape[0] != 1 or key_states.shape[2] != length:
            raise ValueError(f"update: key_states {tuple(key_states.shape)} do not match the bound run [B=1, L={length}]")
        read = []
        for kind, states in enumerate((key_states, value_states)):
            layer = self.storage[kind, layer_idx]  # [S, H, capacity + 1, D]
            layer[slot, :, start : start + length].copy_(states[0])  # [H, L, D]
            read.append(layer[slot : slot + 1, :, : self.kv_length])  # [1, H, T_kv, D]
        return read[0], read[1]

    def _gather_views(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values views ``[B, H, T_kv, D]`` into the reused gather buffer (valid until
        the next layer's ``update``: only that layer's attention reads them)."""
        heads, _, head_dim = self._shape
        shape = (batch, heads, self.kv_length, head_dim)
        size = batch * heads * self.kv_length * head_dim
        if self._gather_buffer.shape[1] < size:  # doubling: contexts grow a column per decoded token
            grown = max(size, 2 * self._gather_buffer.shape[1])
            self._gather_buffer = torch.empty((2, grown), dtype=self.dtype, device=self.device)
        return self._gather_buffer[0, :size].view(shape), self._gather_buffer[1, :size].view(shape)
