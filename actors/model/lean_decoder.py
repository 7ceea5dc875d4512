"""A lean decoder forward for the Llama-shaped families: the same law as transformers', fewer ops.

:class:`actors.model.backends.SlotBackend` runs a model's own decoder module over the slot cache.
For the families whose decoder layer is exactly "RMSNorm -> q/k/v projections (optional bias,
optional per-head q/k RMSNorm) -> rotary -> attention -> o_proj -> residual -> RMSNorm ->
SiLU-gated MLP -> residual" (:data:`LEAN_FAMILIES`: Llama, Mistral, Qwen2, Qwen3), this module
runs the same computation with less around it:

* the q/k/v projections are one GEMM over packed weights, and so are the MLP's gate and up
  projections (the model's own ``nn.Linear`` weights become views into the packed tensors, and
  the model's own forward still works);
* the rotary cos/sin are computed once per forward by the model's own rotary module, the
  per-layer masks come ready from :func:`actors.model.layer_masks.layer_masks`, and attention is
  :func:`actors.model.grouped_attention.grouped_sdpa_forward` (no mask conversion, no per-call
  dispatch through transformers' attention and mask interfaces);
* each layer is two plain functions over its packed weights (norm + q/k/v + rotary; o_proj +
  residual + norm + MLP + residual) around the cache write and attention;
* on CPU in float32 the layers' and the head's GEMMs go through oneDNN's matmul (:func:`_linear`)
  over a copy of their weights reordered into oneDNN's blocked layout, what vLLM's CPU build runs
  too: the same float32 product, 2.5x faster than the BLAS (MKL) behind ``F.linear`` at 16 rows
  on this machine's AMD cores, and faster at one row too, where the weights are read from memory
  (``python -m benchmarks.forward_micro``, ``docs/benchmarks.md``). That copy is the one weight
  held twice (the model's own ``nn.Linear`` weights stay, for its own forward, the load-time check
  and the fall-back): 46.5 MiB for the embedded target.

What that buys on CPU is the Python and dispatch work around the ops and the faster GEMMs
(``python -m benchmarks.forward_micro --paths model,lean``, ``docs/benchmarks.md``); the
attention's reads of the cache are the same. TorchInductor over the two dense halves (dynamic
token count) measured no faster here: the elementwise work it fuses is small next to the
GEMMs, and its guards cost what the fusion saves; so the path runs eager.

Every operation is the model's own (its RMSNorm and rotary modules, its activation, the same
float32 GEMMs): logits equal transformers' own forward to float32 rounding
(``tests/actors/model/test_lean_decoder.py``). A model that does not match this shape exactly is
not taken (:func:`lean_support` says why) and runs its own decoder.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from actors.model.architectures import Architecture
from actors.model.grouped_attention import grouped_sdpa_forward

logger = logging.getLogger(__name__)

#: Largest relative difference between the lean and the model's own hidden states on the load-time
#: check (:meth:`LeanDecoder.self_check`) before the model's own decoder is used instead: float32
#: rounding; a 16-bit model's GEMMs may round differently when packed (3 significant digits).
SELF_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
SELF_CHECK_TOLERANCE_16_BIT = 2e-2

#: The batch size oneDNN lays the layers' weights out for (any row count runs on that layout).
ONEDNN_LAYOUT_ROWS = 16
_ONEDNN = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))

#: transformers model types whose decoder layer is the Llama shape described in the module doc.
LEAN_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True)
class _LeanLayer:
    """One decoder layer, packed: the arguments of its two dense halves, its attention module
    (``num_key_value_groups``, ``scaling``) and its mask kind (FULL_ATTENTION / SLIDING_ATTENTION)."""

    attention: torch.nn.Module
    before: tuple  # norm weight [hidden], eps, q/k/v weight [(H + 2 H_kv) d, hidden], bias, q/k norm weights [d], eps
    after: tuple  # o weight [hidden, H d], bias, norm weight, eps, gate/up weight [2 I, hidden], bias, down weight, bias
    kind: str


def lean_support(model: Any, architecture: Architecture) -> str | None:
    """None when the lean forward reproduces ``model``'s decoder exactly; else why not."""
    if architecture.model_type not in LEAN_FAMILIES:
        return f"model type {architecture.model_type!r} is not one of {sorted(LEAN_FAMILIES)}"
    if architecture.attn_implementation != "sdpa":
        return f"attention implementation {architecture.attn_implementation!r}"
    decoder = model.get_decoder()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            return f"the decoder has no {name!r}"
    if len(decoder.layers) != int(model.config.num_hidden_layers):
        return "the decoder runs a different number of layers than num_hidden_layers"
    expected_layer = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
    expected_attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    for layer in decoder.layers:
        if expected_layer - set(dict(layer.named_children())):
            return f"decoder layer {type(layer).__name__} lacks {sorted(expected_layer - set(dict(layer.named_children())))}"
        children = set(dict(layer.self_attn.named_children()))
        if expected_attention - children or children - expected_attention - {"q_norm", "k_norm"}:
            return f"attention module {type(layer.self_attn).__name__} has modules {sorted(children)}"
        mlp = layer.mlp
        if set(dict(mlp.named_children())) - {"gate_proj", "up_proj", "down_proj", "act_fn"} or not all(
                hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"MLP {type(mlp).__name__} is not a gated MLP"
    for layer in decoder.layers:
        attention = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm, decoder.norm,
                 *(getattr(attention, name) for name in ("q_norm", "k_norm") if hasattr(attention, name))]
        for norm in norms:
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                return f"norm {type(norm).__name__} is not the Llama RMSNorm"
    if getattr(model.config, "hidden_act", None) != "silu":
        return f"hidden_act={getattr(model.config, 'hidden_act', None)!r} (the lean MLP is SiLU-gated)"
    if getattr(model.config, "pretraining_tp", 1) not in (None, 1):
        return f"pretraining_tp={model.config.pretraining_tp}"
    return None


class LeanDecoder:
    """The decoder forward of a :data:`LEAN_FAMILIES` model over a bound
    :class:`actors.model.kv_cache.SlotKVCache` (see the module doc)."""

    def __init__(self, model: Any, architecture: Architecture):
        reason = lean_support(model, architecture)
        if reason is not None:
            raise ValueError(f"LeanDecoder: {reason}")
        decoder = model.get_decoder()
        self.architecture = architecture
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.final_norm = (decoder.norm.weight, float(decoder.norm.variance_epsilon))
        # oneDNN's layout for the layers' GEMMs: on CPU in float32 (see the module doc).
        self.onednn = _ONEDNN and self.embed_tokens.weight.device.type == "cpu" and model.dtype == torch.float32
        self.layers = [_pack_layer(layer, kind, self.onednn) for layer, kind in zip(decoder.layers, architecture.layer_types)]
        head = model.get_output_embeddings()
        self._head = head if type(head) is torch.nn.Linear else None
        self._head_weight = None if self._head is None else _onednn_weight(self._head.weight.detach(), self.onednn)
        attention = decoder.layers[0].self_attn
        shape = _HeadShape(int(model.config.num_attention_heads),
                           int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads),
                           int(attention.head_dim))
        # The model's own rotary application (q * cos + rotate_half(q) * sin), from its module.
        apply_rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        self._before_attention = _before_attention_fn(shape, apply_rotary)

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, masks: torch.Tensor | dict[str, torch.Tensor],
        cache: Any,
    ) -> torch.Tensor:
        """``input_ids`` / ``position_ids`` ``[B, L]``, ``masks`` from ``layer_masks`` (one
        ``[B, 1, L, T_kv]`` bool mask or one per layer kind), ``cache`` bound to the rows ->
        the final-normed hidden states ``[B, L, hidden]``; every layer's new keys/values are written."""
        hidden = self.embed_tokens(input_ids)  # [B, L, hidden]
        cos, sin = self.rotary_emb(hidden, position_ids)  # [B, L, d] each
        batch, length = input_ids.shape
        for index, layer in enumerate(self.layers):
            mask = masks[layer.kind] if isinstance(masks, dict) else masks  # [B, 1, L, T_kv]
            query, key, value = self._before_attention(hidden, cos, sin, *layer.before)  # [B, H|H_kv, L, d]
            keys, values = cache.write_and_gather(index, key, value)  # [B, H_kv, T_kv, d] each
            attended = _attention(layer.attention, query, keys, values, mask)  # [B, L, H, d]
            hidden = _after_attention(hidden, attended.reshape(batch, length, -1), *layer.after)  # [B, L, hidden]
        return _rms_norm(hidden, *self.final_norm)

    def head(self, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)`` (``[N, hidden]`` -> ``[N, V]``), through :func:`_linear` over the
        weight in oneDNN's layout when ``lm_head`` is the model's plain ``nn.Linear`` head."""
        if lm_head is self._head:
            return _linear(hidden, self._head_weight, lm_head.bias)
        return lm_head(hidden)

    @torch.inference_mode()
    def self_check(self, model: Any, tokens: int = 6) -> float:
        """Run ``tokens`` new tokens through this path and through ``model``'s own decoder over a
        scratch one-slot cache -> the largest difference of their hidden states, relative to
        their largest magnitude (a variant this path does not reproduce shows here, at load)."""
        from actors.model.kv_cache import SlotKVCache
        from actors.model.layer_masks import layer_masks

        device = self.embed_tokens.weight.device
        cache = SlotKVCache.from_config(model.config, capacity=tokens, max_slots=1, initial_slots=1,
                                        dtype=self.embed_tokens.weight.dtype, device=device)
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, self.embed_tokens.num_embeddings, (1, tokens), generator=generator).to(device)
        positions = torch.arange(tokens, device=device)[None]  # [1, L]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()[None, None]  # [1, 1, L, L]
        masks = layer_masks(self.architecture, causal, positions, positions, self.embed_tokens.weight.dtype)
        outputs = []
        for run in (lambda: self(input_ids, positions, masks, cache),
                    lambda: model.get_decoder()(input_ids=input_ids, position_ids=positions, attention_mask=masks,
                                                past_key_values=cache, use_cache=True).last_hidden_state):
            cache.bind(torch.zeros(1, dtype=torch.long, device=device), positions, tokens, 0)
            try:
                outputs.append(run().float())  # [1, L, hidden]
            finally:
                cache.unbind()
        lean, own = outputs
        return float((lean - own).abs().max() / own.abs().max().clamp_min(1e-6))


def _attention(module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """sdpa of ``query`` ``[B, H, L, d]`` over ``keys`` / ``values`` ``[B, H_kv, T_kv, d]`` under the
    bool ``mask`` ``[B, 1, L, T_kv]`` -> ``[B, L, H, d]``; grouped heads read in place."""
    if module.num_key_value_groups > 1:
        return grouped_sdpa_forward(module, query, keys, values, mask, scaling=module.scaling)[0]
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=module.scaling).transpose(1, 2)


def _linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)``, as oneDNN's matmul when ``weight`` is in its layout
    (:func:`_onednn_weight`): the same float32 GEMM. ``inputs`` ``[..., in]`` -> ``[..., out]``."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(inputs, weight, bias, "none", [], "")
    return F.linear(inputs, weight, bias)


def _onednn_weight(weight: torch.Tensor, reorder: bool) -> torch.Tensor:
    """``weight`` ``[out, in]`` copied into oneDNN's blocked layout when ``reorder``, else itself."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_LAYOUT_ROWS) if reorder else weight


@dataclass(frozen=True)
class _HeadShape:
    heads: int  # H
    kv_heads: int  # H_kv
    head_dim: int  # d


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op: ``weight * (h * rsqrt(mean(h^2) + eps))`` in float32."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + eps)).to(dtype)


def _before_attention_fn(shape: _HeadShape, apply_rotary: Callable) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The first half of a layer for one head shape and rotary function (constants of the graph)."""
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim

    def before_attention(
        hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_weight: torch.Tensor, eps: float,
        qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None, head_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` ``[B, L, hidden]`` -> rotated queries ``[B, H, L, d]``, rotated keys and values
        ``[B, H_kv, L, d]``: the input norm, one q/k/v GEMM, the optional per-head norms, rotary."""
        batch, length, _ = hidden.shape
        qkv = _linear(_rms_norm(hidden, norm_weight, eps), qkv_weight, qkv_bias)  # [B, L, (H + 2 H_kv) d]
        query, key, value = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
        query = query.view(batch, length, heads, head_dim)  # [B, L, H, d]
        key = key.view(batch, length, kv_heads, head_dim)  # [B, L, H_kv, d]
        if q_norm_weight is not None:
            query = _rms_norm(query, q_norm_weight, head_eps)
            key = _rms_norm(key, k_norm_weight, head_eps)
        value = value.view(batch, length, kv_heads, head_dim).transpose(1, 2)  # [B, H_kv, L, d]
        query, key = apply_rotary(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        return query, key, value

    return before_attention


def _after_attention(
    hidden: torch.Tensor, attended: torch.Tensor, o_weight: torch.Tensor, o_bias: torch.Tensor | None,
    norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor, down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The rest of the layer: ``hidden + o_proj(attended)``, then ``+ down(silu(gate) * up)`` of its
    norm. ``hidden`` ``[B, L, hidden]``, ``attended`` ``[B, L, H d]`` -> ``[B, L, hidden]``."""
    hidden = hidden + _linear(attended, o_weight, o_bias)
    normed = _rms_norm(hidden, norm_weight, eps)
    gate, up = _linear(normed, gate_up_weight, gate_up_bias).chunk(2, dim=-1)  # [B, L, I] each
    return hidden + _linear(F.silu(gate) * up, down_weight, down_bias)


def _pack(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` stacked by output rows; each ``nn.Linear`` keeps a view
    of its rows, so the model holds each weight once and its own forward is unchanged."""
    weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum of out, in]
    biases = [linear.bias for linear in linears]
    if any(bias is not None for bias in biases) and not all(bias is not None for bias in biases):
        raise ValueError("LeanDecoder: some packed projections have a bias and some do not")
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None  # [sum of out]
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _pack_layer(layer: Any, kind: str, reorder: bool) -> _LeanLayer:
    """One layer's :class:`_LeanLayer`; its four GEMM weights in oneDNN's layout when ``reorder``."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = _pack([attention.q_proj, attention.k_proj, attention.v_proj])
    gate_up_weight, gate_up_bias = _pack([mlp.gate_proj, mlp.up_proj])
    qkv_weight, gate_up_weight = _onednn_weight(qkv_weight, reorder), _onednn_weight(gate_up_weight, reorder)
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    before = (layer.input_layernorm.weight.detach(), float(layer.input_layernorm.variance_epsilon), qkv_weight,
              qkv_bias, None if q_norm is None else q_norm.weight.detach(),
              None if k_norm is None else k_norm.weight.detach(),
              0.0 if q_norm is None else float(q_norm.variance_epsilon))
    after = (_onednn_weight(attention.o_proj.weight.detach(), reorder), _detached(attention.o_proj.bias),
             layer.post_attention_layernorm.weight.detach(), float(layer.post_attention_layernorm.variance_epsilon),
             gate_up_weight, gate_up_bias, _onednn_weight(mlp.down_proj.weight.detach(), reorder),
             _detached(mlp.down_proj.bias))
    return _LeanLayer(attention=attention, before=before, after=after, kind=kind)


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def build_lean_decoder(model: Any, architecture: Architecture, name: str) -> tuple[LeanDecoder | None, str]:
    """The lean decoder of ``model`` (``name`` names it in logs), or None when the model's own
    decoder must run: a family or shape the lean path does not cover (logged), or a failure while
    building it (a warning naming the model; the model's own decoder gives the same law); and the
    path it runs, in words (for the start-up log)."""
    reason = lean_support(model, architecture)
    if reason is not None:
        logger.info("%s runs its own decoder forward (lean path: %s)", name, reason)
        return None, f"its own decoder ({reason})"
    try:
        decoder = LeanDecoder(model, architecture)
        difference = decoder.self_check(model)
    except Exception as error:  # noqa: BLE001 - any failure means the model's own forward, never a crash
        logger.warning("%s: the lean decoder could not be built (%s: %s); running the model's own decoder",
                       name, type(error).__name__, error)
        return None, f"its own decoder (the lean decoder failed to build: {type(error).__name__})"
    tolerance = SELF_CHECK_TOLERANCE.get(model.dtype, SELF_CHECK_TOLERANCE_16_BIT)
    if not difference <= tolerance:  # NaN included
        logger.warning("%s: the lean decoder's hidden states differ from the model's own by %.3g (over %g); "
                       "running the model's own decoder", name, difference, tolerance)
        return None, f"its own decoder (the lean decoder differed by {difference:.3g} at load)"
    logger.info("%s runs the lean decoder forward (%s, packed q/k/v and gate/up weights%s)", name,
                architecture.model_type, ", oneDNN's layout" if decoder.onednn else "")
    return decoder, f"the lean decoder ({architecture.model_type})"
