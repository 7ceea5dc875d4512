"""The lean decoder's attention kernels (:mod:`actors.model.lean_decoder`): sdpa over the cache's
keys/values with grouped heads read in place, and two batched matmuls where they beat sdpa's CPU
kernel (full precision; and 16-bit decode rows computed as sdpa's kernel computes them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.model.grouped_attention import grouped_sdpa_forward


@dataclass(frozen=True)
class HeadShape:
    heads: int  # H
    kv_heads: int  # H_kv
    head_dim: int  # d


def sdpa_attention(module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """sdpa of ``query`` ``[B, H, L, d]`` over ``keys`` / ``values`` ``[B, H_kv, T_kv, d]`` under the
    bool ``mask`` ``[B, 1, L, T_kv]`` (None: every key) -> ``[B, L, H, d]``; grouped heads read in place."""
    if mask is None:
        return F.scaled_dot_product_attention(query, keys, values, scale=module.scaling,
                                              enable_gqa=module.num_key_value_groups > 1).transpose(1, 2)
    if module.num_key_value_groups > 1:
        return grouped_sdpa_forward(module, query, keys, values, mask, scaling=module.scaling)[0]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=module.scaling).transpose(1, 2)


def additive_grouped_mask(mask: torch.Tensor, shape: HeadShape, dtype: torch.dtype) -> torch.Tensor:
    """The bool ``mask`` ``[B, 1, L, T_kv]`` (True: attend) as the additive mask of
    :func:`bmm_attention`, ``[B H_kv, G L, T_kv]`` (0 where attended, the dtype's lowest value
    elsewhere, as transformers' own additive masks): query head ``h`` reads key/value head ``h // G``."""
    batch, _, length, columns = mask.shape
    groups = shape.heads // shape.kv_heads
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask.logical_not(), torch.finfo(dtype).min)  # [B, 1, L, T_kv]
    return additive.expand(batch, shape.kv_heads * groups, length, columns).reshape(
        batch * shape.kv_heads, groups * length, columns)


def bmm_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                   scaling: float) -> torch.Tensor:
    """``softmax(scaling q k^T + mask) v`` as two batched matmuls over the keys/values where they
    lie (the slot cache's in-place view or the gathered buffer; no copy of them), the query heads
    of each key/value head packed together (grouped heads read their key/value head once).
    ``query`` ``[B, L, H, d]``, ``keys`` / ``values`` ``[B, H_kv, T_kv, d]``, ``mask`` from
    :func:`additive_grouped_mask` ``[B H_kv, G L, T_kv]`` (None: every key) -> ``[B, L, H d]``.

    On this CPU the products read each row's keys and values once with fewer passes than sdpa's
    flash kernel, which at a handful of query positions per row runs below its block size: one
    layer of 16 rows x 1 new token over 150 cached columns, its keys/values read from memory, 0.51 ms
    against 0.56-0.64 ms with sdpa (``docs/benchmarks.md``)."""
    scores = _packed_scores(query, keys, mask, scaling)  # [B H_kv, G L, T_kv]
    attended = torch.bmm(scores.softmax(-1), _packed_values(values))  # [B H_kv, G L, d]
    return _unpacked(attended, query.shape)


def bmm_attention_rounded(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                           scaling: float) -> torch.Tensor:
    """:func:`bmm_attention` of 16-bit ``query`` / ``keys`` / ``values`` computed as sdpa's CPU flash
    kernel computes them: the scaled scores plus ``mask`` (float32, from :func:`additive_grouped_mask`),
    their row maximum, ``exp(score - max)`` and its sum in float32; the exponentials rounded to the
    16-bit dtype for the product with the values (accumulated in float32), divided by the sum, rounded
    once. Shapes as :func:`bmm_attention`; the kernel's result up to the order of its sums (one key
    block: up to 512 keys; longer contexts it rescales block by block)."""
    scores = _packed_scores(query, keys, mask, scaling, torch.float32)  # [B H_kv, G L, T_kv]
    weights = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # [B H_kv, G L, T_kv], unnormalized
    total = weights.sum(-1, keepdim=True)  # [B H_kv, G L, 1]
    attended = torch.bmm(weights.to(query.dtype).float(), _packed_values(values).float())
    return _unpacked(attended.div_(total).to(query.dtype), query.shape)  # from [B H_kv, G L, d]


def _packed_scores(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """``scaling q k^T + mask`` with the query heads of each key/value head packed together:
    ``query`` ``[B, L, H, d]``, ``keys`` ``[B, H_kv, T_kv, d]`` (both converted to ``dtype`` when
    given) -> ``[B H_kv, G L, T_kv]``."""
    batch, length, heads, size = query.shape
    kv_heads, columns = keys.shape[1], keys.shape[2]
    packed = query.transpose(1, 2).reshape(batch * kv_heads, heads // kv_heads * length, size)  # [B H_kv, G L, d]
    keys_flat = keys.reshape(batch * kv_heads, columns, size)  # [B H_kv, T_kv, d]
    if dtype is not None:
        packed, keys_flat = packed.to(dtype), keys_flat.to(dtype)
    keys_t = keys_flat.transpose(1, 2)  # [B H_kv, d, T_kv]
    if mask is None:  # no mask to add: the product scaled after it, as baddbmm's alpha (the same scores)
        return torch.bmm(packed, keys_t).mul_(scaling)
    return torch.baddbmm(mask, packed, keys_t, alpha=scaling)


def _packed_values(values: torch.Tensor) -> torch.Tensor:
    """``values`` ``[B, H_kv, T_kv, d]`` -> ``[B H_kv, T_kv, d]``."""
    batch, kv_heads, columns, size = values.shape
    return values.reshape(batch * kv_heads, columns, size)


def _unpacked(attended: torch.Tensor, query_shape: torch.Size) -> torch.Tensor:
    """``attended`` ``[B H_kv, G L, d]`` back in the query's order -> ``[B, L, H d]``."""
    batch, length, heads, size = query_shape
    return attended.view(batch, heads, length, size).transpose(1, 2).reshape(batch, length, heads * size)
