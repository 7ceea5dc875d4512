"""Grouped-query attention read in place: sdpa that never repeats keys/values per query head.

A GQA model (Llama-3, Qwen2/3, Mistral: fewer key/value heads than query heads) under
transformers' ``sdpa`` attention repeats every layer's keys and values to the query heads
(``repeat_kv``: ``[B, H_kv, T, d]`` -> ``[B, H, T, d]``, a copy of the whole context per layer)
whenever an explicit mask is given and more than one query position is new, which is every
forward of the engine (it always passes its own 4D masks, and verification rows hold gamma + 1
positions). Here each key/value head's queries are packed into one attention over its own
keys/values instead (query heads ``[B, H, L, d]`` -> ``[B, H_kv, G x L, d]`` for ``G`` query heads
per key/value head, the mask repeated over the ``G`` groups: ``B x G x L x T`` bools against
copying ``2 x B x H x T x d`` floats per layer), which transformers itself does only for one new
position (``pack_gqa``). Equal to the repeated form to 1e-6 (``tests/actors/model/test_grouped_attention.py``).

Measured here (one torch thread, 8 rows x 5 new tokens, 2,048 cached columns, 14 query heads
over 2 key/value heads, head size 64; one attention call): 70 ms with ``repeat_kv``, 10 ms with
torch's ``enable_gqa=True``, 7 ms packed; for one new position packed 1.0-2.9 ms against
2.0-4.4 ms for ``enable_gqa`` (2,048-4,096 columns). ``python -m benchmarks.peers.real_shape`` measures
whole forwards of a Qwen2.5-shaped model.

:func:`use_grouped_attention` switches a loaded sdpa model to :data:`GROUPED_SDPA`, which takes
that path on CPU and hands everything else to transformers' own sdpa function: CUDA (never run
here, so left as transformers does it), models without key/value groups, calls without a 4D
mask shared by the heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: The attention implementation name registered with transformers.
GROUPED_SDPA = "specserve_grouped_sdpa"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, L, d]
    key: torch.Tensor,  # [B, H_kv, T, d]
    value: torch.Tensor,  # [B, H_kv, T, d]
    attention_mask: torch.Tensor | None,  # [B, 1, L, T] bool (True = attend) or additive
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature -> ``([B, L, H, d], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    grouped = (groups > 1 and query.device.type == "cpu" and attention_mask is not None
               and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
               and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)
    if not grouped:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    batch, heads, length, size = query.shape
    kv_heads = key.shape[1]
    # Query head h reads key/value head h // groups (transformers' repeat_kv): a key/value
    # head's groups x L queries become one attention over its keys, each with its row's mask.
    packed_query = query.reshape(batch, kv_heads, groups * length, size)  # [B, H_kv, G*L, d]
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1)  # [B, 1, G, L, T]
    packed_mask = mask.reshape(mask.shape[0], 1, groups * length, mask.shape[-1])  # [B, 1, G*L, T]
    output = F.scaled_dot_product_attention(  # [B, H_kv, G*L, d]
        packed_query, key, value, attn_mask=packed_mask, dropout_p=dropout, scale=scaling)
    return output.reshape(batch, heads, length, size).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def has_key_value_groups(config: Any) -> bool:
    """Whether the model shares each key/value head among several query heads."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    return isinstance(heads, int) and isinstance(kv_heads, int) and 0 < kv_heads < heads


def use_grouped_attention(model: Any) -> bool:
    """Switch an sdpa GQA model to :data:`GROUPED_SDPA` (same law, no key/value repeat); returns
    whether it switched. Models under another implementation (eager for soft-capped attention)
    or without key/value groups are left as they are."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not has_key_value_groups(model.config):
        return False
    _register()
    model.set_attn_implementation(GROUPED_SDPA)
    return True
