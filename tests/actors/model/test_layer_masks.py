"""Per-layer masks: the sliding window follows transformers' convention, positions move with keys."""

from __future__ import annotations

import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from actors.model.architectures import FULL_ATTENTION, SLIDING_ATTENTION, Architecture, HeadKind, MaskLayout
from actors.model.layer_masks import ColumnPositions, additive_mask, layer_masks, sliding_window_mask


def test_sliding_window_mask_equals_transformers_convention():
    window, length = 4, 12
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]  # [1, 1, L, T]
    positions = torch.arange(length)[None]  # [1, L]
    got = sliding_window_mask(causal, positions, positions, window)[0, 0]  # [L, T]
    reference = sliding_window_causal_mask_function(window)
    zero, index = torch.tensor(0), torch.arange(length)
    expected = reference(zero, zero, index[:, None], index[None, :])  # [L, T]
    assert torch.equal(got, expected)
    assert got.sum(-1).tolist() == [min(q + 1, window) for q in range(length)]


def test_window_uses_key_positions_not_columns():
    """Chain 1 of a row sits at columns 6..8 with positions 3..5: a query at position 5 sees the
    keys at positions 3, 4, 5 (window 3), wherever they are stored."""
    visible = torch.zeros(1, 1, 1, 9, dtype=torch.bool)
    visible[..., [0, 1, 2, 6, 7, 8]] = True  # prefix columns 0..2, its own chain 6..8
    key_positions = torch.tensor([[0, 1, 2, 3, 4, 5, 3, 4, 5]])  # [1, T]: chain 0 at 3..5, chain 1 at 6..8
    got = sliding_window_mask(visible, torch.tensor([[5]]), key_positions, 3)
    assert got[0, 0, 0].nonzero().flatten().tolist() == [6, 7, 8]


def test_column_positions_move_with_the_keys():
    table = ColumnPositions(num_slots=2, columns=10)
    table.record(torch.tensor([0]), torch.tensor([[0, 1, 2, 5, 6]]), torch.tensor([[0, 1, 2, 3, 4]]))
    table.copy_columns(0, [5, 6], [3, 4])  # an accepted chain moved next to the prefix
    assert table.key_positions(torch.tensor([0]), 5).tolist() == [[0, 1, 2, 3, 4]]
    table.copy_prefix(0, 1, 4)
    assert table.key_positions(torch.tensor([1]), 4).tolist() == [[0, 1, 2, 3]]


def test_layer_masks_per_layer_type_and_additive_for_eager():
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()  # [1, 1, L, T]
    positions = torch.arange(3)[None]
    architecture = Architecture("gemma2", "eager", MaskLayout.LAYER_TYPES, (SLIDING_ATTENTION, FULL_ATTENTION), 2,
                                HeadKind.FINAL_SOFTCAP, 30.0)
    masks = layer_masks(architecture, mask, positions, positions, torch.float32)
    assert set(masks) == {FULL_ATTENTION, SLIDING_ATTENTION}
    minimum = torch.finfo(torch.float32).min
    assert torch.equal(masks[FULL_ATTENTION], additive_mask(mask, torch.float32))
    assert masks[SLIDING_ATTENTION][0, 0, 2].tolist() == [minimum, 0.0, 0.0]
    single = Architecture("mistral", "sdpa", MaskLayout.CONFIG_WINDOW, (SLIDING_ATTENTION,) * 2, 2,
                          HeadKind.PLAIN, None)
    assert layer_masks(single, mask, positions, positions, torch.float32)[0, 0, 2].tolist() == [False, True, True]
