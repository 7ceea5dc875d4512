"""Per-layer attention masks: sliding windows from positions, additive masks for eager attention.

:func:`actors.model.batch.build_batch` builds one bool mask ``[B, 1, L, T_kv]`` saying which cache
columns each new token may see (its prefix, its own chain, itself). A sliding-window layer sees
less: transformers' ``sliding_window_overlay`` (``masking_utils``) lets a query at position ``p``
see a key at position ``k`` only when ``k > p - sliding_window``. Positions, not columns: in the
slot layout a draft chain's columns are not its positions (token ``j`` of chain ``k`` sits at
column ``base + k * G + j`` with rotary position ``base + j``, ``docs/design.md``), and keys of
earlier forwards keep the position they were computed at. So :class:`ColumnPositions` records,
for every slot and column, the rotary position of the key written there, and moves those
positions with the keys (:meth:`ColumnPositions.copy_prefix`, :meth:`ColumnPositions.copy_columns`).

:func:`layer_masks` turns the batch's bool mask into what the decoder takes for an
:class:`actors.model.architectures.Architecture`: one tensor for every layer, or a dict from layer type
(``"full_attention"``, ``"sliding_attention"``) to tensor; bool for sdpa, additive float
(0 / dtype min) for eager attention, which adds the mask to the scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.model.architectures import FULL_ATTENTION, SLIDING_ATTENTION, Architecture, MaskLayout


class ColumnPositions:
    """The rotary position of the key stored in every column of every slot: ``[slots, columns]``."""

    def __init__(self, num_slots: int, columns: int, device: str | torch.device = "cpu"):
        self.table = torch.zeros((num_slots, columns), dtype=torch.long, device=device)  # [S, capacity + 1]

    def record(self, slots: torch.Tensor, write_columns: torch.Tensor, position_ids: torch.Tensor) -> None:
        """The keys of a forward: row ``b`` writes ``write_columns[b]`` ``[B, L]`` of slot
        ``slots[b]`` ``[B]`` at ``position_ids[b]`` ``[B, L]`` (padding writes the trash column)."""
        self.table[slots[:, None], write_columns] = position_ids

    def key_positions(self, slots: torch.Tensor, kv_length: int) -> torch.Tensor:
        """Positions of the keys attention reads: ``[B, T_kv]`` for the rows' ``slots`` ``[B]``."""
        return self.table[slots, :kv_length]

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Columns ``[0, length)`` of ``src_slot`` were copied to ``dst_slot``."""
        if src_slot != dst_slot and length:
            self.table[dst_slot, :length] = self.table[src_slot, :length]

    def copy_columns(self, slot: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Columns ``src`` of ``slot`` were copied to columns ``dst`` (their keys keep their positions)."""
        if src:
            row = self.table[slot]  # [capacity + 1]
            row[list(dst)] = row[list(src)].clone()


def sliding_window_mask(
    mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """``mask`` ``[B, 1, L, T_kv]`` limited to keys at positions ``> p - window`` for a query at
    ``p`` (transformers' ``sliding_window_overlay``). ``query_positions`` ``[B, L]``,
    ``key_positions`` ``[B, T_kv]``. A query always keeps its own key (position ``p``)."""
    in_window = key_positions[:, None, :] > query_positions[:, :, None] - window  # [B, L, T_kv]
    return mask & in_window[:, None]  # [B, 1, L, T_kv]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as the additive float mask eager attention adds to its
    scores: 0 where attended, the dtype's lowest value elsewhere (transformers' own convention)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def layer_masks(
    architecture: Architecture,
    mask: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` argument of the decoder's forward for one batch.

    ``mask`` ``[B, 1, L, T_kv]`` bool from :func:`actors.model.batch.build_batch`; ``query_positions``
    ``[B, L]``; ``key_positions`` ``[B, T_kv]`` (needed only when a layer slides). A
    ``MaskLayout.LAYER_TYPES`` decoder gets a dict keyed by layer type, the others one mask.
    """
    by_kind = {FULL_ATTENTION: mask}
    if architecture.has_sliding_layers:
        if key_positions is None:
            raise ValueError("layer_masks: key_positions are needed for sliding-window layers")
        by_kind[SLIDING_ATTENTION] = sliding_window_mask(mask, query_positions, key_positions,
                                                         architecture.sliding_window)
    if architecture.attn_implementation == "eager":
        by_kind = {kind: additive_mask(value, dtype) for kind, value in by_kind.items()}
    if architecture.masks is MaskLayout.LAYER_TYPES:
        return {kind: by_kind[kind] for kind in set(architecture.layer_types)}
    return by_kind[architecture.layer_types[0]]  # one kind for every layer
