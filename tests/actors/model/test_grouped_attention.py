"""GQA read in place (actors.model.grouped_attention): the same attention as transformers' repeated
keys/values, and the backend switches exactly the sdpa models that have key/value groups.

The architecture matrix (tests/actors/model/test_architectures.py: 2 key/value heads for 4 query
heads in every family) checks the served rows against transformers' own forward on this path.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.integrations.sdpa_attention import repeat_kv

from actors.model.backends import SlotBackend
from actors.model.batch import linear_row
from actors.model.grouped_attention import GROUPED_SDPA, grouped_sdpa_forward, has_key_value_groups


class _Layer(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("new_tokens", [1, 5])
def test_grouped_attention_equals_repeated_keys_and_values(new_tokens):
    generator = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, columns, size = 3, 6, 2, 40, 16
    query = torch.randn(batch, heads, new_tokens, size, generator=generator)  # [B, H, L, d]
    key = torch.randn(batch, kv_heads, columns, size, generator=generator)  # [B, H_kv, T, d]
    value = torch.randn(batch, kv_heads, columns, size, generator=generator)  # [B, H_kv, T, d]
    mask = torch.rand(batch, 1, new_tokens, columns, generator=generator) > 0.3  # [B, 1, L, T]
    mask[..., 0] = True
    grouped, _ = grouped_sdpa_forward(_Layer(heads // kv_heads), query, key, value, mask, scaling=0.25)
    groups = heads // kv_heads
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=0.25).transpose(1, 2)
    assert grouped.shape == (batch, new_tokens, heads, size)
    assert torch.allclose(grouped, repeated, atol=1e-6, rtol=0)


def _llama(kv_heads: int) -> transformers.PreTrainedModel:
    """A tiny random Llama under sdpa (seeded: two calls give the same weights)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().requires_grad_(False)
    model.set_attn_implementation("sdpa")
    return model


@pytest.mark.parametrize(("kv_heads", "switched"), [(2, True), (4, False)])
def test_backend_switches_gqa_models_and_rows_equal_transformers(kv_heads, switched):
    model, reference = _llama(kv_heads), _llama(kv_heads)
    backend = SlotBackend(model, "cpu", max_slots=2)
    assert backend.grouped_attention is switched and has_key_value_groups(model.config) is switched
    assert (model.config._attn_implementation == GROUPED_SDPA) is switched
    tokens = torch.randint(1, 64, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    slot = backend.allocate()
    backend.forward([linear_row(slot, 0, tokens[:7], 0, [6])])
    rows = backend.forward([linear_row(slot, 7, tokens[7:], 7, list(range(5)))])[0]  # [5, V]
    with torch.inference_mode():
        full = reference(torch.tensor([tokens])).logits[0, 7:]  # [5, V]
    assert torch.allclose(rows, full, atol=1e-5, rtol=0)
