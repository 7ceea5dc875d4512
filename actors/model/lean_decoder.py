"""A lean decoder forward for the Llama-shaped families: the same law as transformers', fewer ops.

:class:`actors.model.backends.SlotBackend` runs a model's own decoder module over the slot cache.
For the families whose decoder layer is exactly "RMSNorm -> q/k/v projections (optional bias,
optional per-head q/k RMSNorm) -> rotary -> attention -> o_proj -> residual -> RMSNorm ->
SiLU-gated MLP -> residual" (:data:`LEAN_FAMILIES`: Llama, Mistral, Qwen2, Qwen3), this module
runs the same computation with less around it:

* the q/k/v projections are one GEMM over packed weights, and so are the MLP's gate and up
  projections (the model's own ``nn.Linear`` weights become views into the packed tensors, and
  the model's own forward still works);
* the rotary cos/sin are computed once per forward by the model's own rotary module and applied to
  the queries and keys in one pass (they are adjacent in the q/k/v GEMM's output; transformers'
  ``q * cos + rotate_half(q) * sin`` with the sign of ``rotate_half`` folded into ``sin``, checked
  against the model module's ``apply_rotary_pos_emb`` at load); the norms are ``F.rms_norm``;
* on CPU attention is two batched matmuls over the keys/values where they lie, under an additive
  mask built once per forward (:func:`~actors.model.lean_attention.bmm_attention`: fewer passes over the cached keys/values than
  sdpa's flash kernel at a few query positions per row); elsewhere sdpa
  (:func:`actors.model.grouped_attention.grouped_sdpa_forward` for grouped heads); the per-layer
  masks come ready from :func:`actors.model.layer_masks.layer_masks`;
* each layer is two plain functions over its packed weights (norm + q/k/v + rotary; o_proj +
  residual + norm + MLP + residual) around the cache write (keys and values in one copy,
  :meth:`actors.model.kv_cache.PagedKVCache.write_and_gather`) and attention;
* on CPU in float32, and in bfloat16 where oneDNN has bf16 kernels for the CPU
  (:data:`ONEDNN_DTYPES`), the layers' and the head's GEMMs go through oneDNN's matmul
  (:func:`_linear`) over a copy of their weights reordered into oneDNN's blocked layout, what
  vLLM's CPU build runs too: the same product (float32 accumulation, one rounding to the
  output's dtype), in float32 2.5x faster than the BLAS (MKL) behind ``F.linear`` at 16 rows on
  this machine's AMD cores, and faster at one row too, where the weights are read from memory
  (``python -m benchmarks.micro.forward_micro``, ``docs/benchmarks.md``); in bfloat16 about twice the
  float32 speed at one row, as half the bytes read should be, where ``F.linear`` over the plain
  bf16 weights ran no faster than float32 (``python -m benchmarks.peers.real_size``). In float32 the
  residual adds after o_proj and down_proj are that matmul's own post-op (:func:`_linear_add`);
  in 16 bits they stay a separate add, as the model's own forward rounds the product before the
  sum. That copy is the one weight held twice (the model's own ``nn.Linear`` weights stay, for
  its own forward, the load-time check and the fall-back): 46.5 MiB for the embedded target.
* in 16 bits the norms compute as the model's own RMSNorm does (the normalization in float32,
  rounded, then the weight: :func:`_rms_norm`) and attention keeps the scores and softmax in
  float32, as the model's own sdpa forward does: :func:`~actors.model.lean_attention.bmm_attention` over queries, keys and values
  upcast to float32 for one new token a row (:data:`BMM_FLOAT32_MAX_LENGTH`; sdpa's 16-bit CPU
  kernel is 4-9x slower there; its rounding, sums in another order), sdpa for longer rows; never
  16-bit products, which would round the scores before the softmax.

What that buys on CPU is the Python and dispatch work around the ops, the faster GEMMs and a
faster attention at 16 rows: the embedded target's forward at context 150 takes 2.9 ms at 1 x 1
and 3.9 at 1 x 5 (a row alone: :meth:`actors.model.backends.SlotBackend._forward_run`, no mask for
one token), 9.4 at 16 x 1 and 17.8 at 16 x 5 against 5.7, 7.5, 13.6 and 29.2 with its own decoder
(``python -m benchmarks.micro.forward_micro --rows 1,16 --context 150``, ``docs/benchmarks.md``).
TorchInductor over the two dense halves (dynamic token count) measured no faster here: the
elementwise work it fuses is small next to the GEMMs, and its guards cost what the fusion saves;
so the path runs eager.

Every operation computes the model's own formula (its RMSNorm, rotary and activation, the same
float32 GEMMs): logits equal transformers' own forward to float32 rounding
(``tests/actors/model/test_lean_decoder.py``); in bfloat16 they equal it to the rounding of
bf16 GEMMs summed in another order. A model that does not match this shape exactly is
not taken (:func:`lean_support` says why) and runs its own decoder.

A weight-only quantized copy of a model (``quantization``, :mod:`actors.model.quantized`) runs this
path too, over the model's own embeddings, norms and rotary module (one copy in memory, shared
with the model it copies): each packed GEMM weight (q/k/v, gate/up, o, down, the head) becomes an
int8 / int4 module built from the float weights (:func:`actors.model.quantized.quantized_gemm`), and
the model's own weights are left untouched; a copy whose kernels take another dtype (w8a8: float32)
computes and caches in it (:data:`actors.model.quantized.ACTIVATION_DTYPES`). Its load-time check
allows the quantization's error (:data:`QUANTIZED_SELF_CHECK_TOLERANCE`).
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
from actors.model.lean_attention import HeadShape, additive_grouped_mask, bmm_attention, bmm_attention_rounded, sdpa_attention

logger = logging.getLogger(__name__)

#: Largest relative difference between the lean and the model's own hidden states on the load-time
#: check (:meth:`LeanDecoder.self_check`) before the model's own decoder is used instead: float32
#: rounding; a 16-bit model's GEMMs may round differently when packed (3 significant digits).
SELF_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
SELF_CHECK_TOLERANCE_16_BIT = 2e-2
#: The same check for a quantized copy, against the float model's own decoder: the weights' rounding
#: moves the hidden states (int4 on the embedded target ~0.1), a wrongly packed weight moves them ~1.
QUANTIZED_SELF_CHECK_TOLERANCE = 0.5

#: The batch size oneDNN lays the layers' weights out for (any row count runs on that layout).
ONEDNN_LAYOUT_ROWS = 16
_ONEDNN = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
#: The dtypes whose GEMMs run in oneDNN's layout on CPU: float32, and bfloat16 where oneDNN runs
#: bf16 kernels on this CPU (``avx512_bf16`` or AMX; elsewhere it would emulate them, slower).
ONEDNN_DTYPES = frozenset({torch.float32} | ({torch.bfloat16} if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                                              else set()))
#: The dtypes the norms and attention compute in directly (see :func:`_rms_norm`); 16-bit ones round as the model does.
_FULL_PRECISION = frozenset({torch.float32, torch.float64})

#: Whether a quantized copy attends with :func:`~actors.model.lean_attention.bmm_attention` whatever its dtype.
BMM_QUANTIZED = True
#: In 16 bits on CPU, a forward of at most this many new tokens per row (a decode step) attends
#: as sdpa's CPU kernel computes (:func:`~actors.model.lean_attention.bmm_attention_rounded`: float32 scores, softmax and
#: products, the exponentials rounded to 16 bits), in two batched matmuls; longer rows take sdpa.
#: One query over 100-800 cached keys of the 279M shape: 29-144 us against sdpa's 107-1337 us (one
#: thread). Rows of several tokens stay on sdpa: their last-place differences (its sums' order),
#: carried through the layers, reach past one unit of a logit.
BMM_FLOAT32_MAX_LENGTH = 1

#: transformers model types whose decoder layer is the Llama shape described in the module doc.
LEAN_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True)
class _LeanLayer:
    """One decoder layer, packed: the arguments of its two dense halves, its attention module
    (``num_key_value_groups``, ``scaling``) and its mask kind (FULL_ATTENTION / SLIDING_ATTENTION)."""

    attention: torch.nn.Module
    before: tuple  # norm weight [hidden], eps, q/k/v weight [(H + 2 H_kv) d, hidden], bias, q/k norm weight [H + H_kv, d], eps
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
    :class:`actors.model.kv_cache.PagedKVCache` (see the module doc)."""

    def __init__(self, model: Any, architecture: Architecture, quantization: str | None = None):
        reason = lean_support(model, architecture)
        if reason is not None:
            raise ValueError(f"LeanDecoder: {reason}")
        decoder = model.get_decoder()
        self.architecture = architecture
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        # The activations' (and the KV cache's) dtype: the model's, or a quantized copy's kernels' own.
        self.dtype = _activation_dtype(quantization, model.dtype)
        self.final_norm = (decoder.norm.weight.to(self.dtype), float(decoder.norm.variance_epsilon))
        # oneDNN's layout for the layers' GEMMs: on CPU in ONEDNN_DTYPES (see the module doc).
        self.quantization = quantization
        self.onednn = (_ONEDNN and self.embed_tokens.weight.device.type == "cpu" and model.dtype in ONEDNN_DTYPES
                       and quantization is None)
        gemm = _gemm_fn(self.onednn, quantization)
        self.layers = [_pack_layer(layer, kind, gemm, share=quantization is None, dtype=self.dtype)
                       for layer, kind in zip(decoder.layers, architecture.layer_types)]
        head = model.get_output_embeddings()
        self._head = head if type(head) is torch.nn.Linear else None
        if quantization is not None and self._head is None:
            raise ValueError("LeanDecoder: a quantized copy needs the model's plain nn.Linear head")
        self._head_weight, self._head_bias = (None, None) if self._head is None else gemm(
            self._head.weight.detach(), _detached(self._head.bias))
        attention = decoder.layers[0].self_attn
        shape = HeadShape(int(model.config.num_attention_heads),
                           int(getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads),
                           int(attention.head_dim))
        # The model's own rotary application (q * cos + rotate_half(q) * sin), from its module.
        self._shape = shape
        _check_rotary(sys.modules[type(attention).__module__].apply_rotary_pos_emb, shape.head_dim)
        self._before_attention = _before_attention_fn(shape)
        # Attention as two batched matmuls where they beat sdpa's kernel (CPU; see bmm_attention); in
        # 16 bits sdpa, whose kernel keeps the scores in float32 as the model's own forward does.
        # A quantized copy (a draft: its rows need only be the ones it samples from) takes them in 16 bits too.
        on_cpu = self.embed_tokens.weight.device.type == "cpu"
        self._bmm_attention = on_cpu and (model.dtype in _FULL_PRECISION or (quantization is not None and BMM_QUANTIZED))
        # 16 bits on CPU otherwise: one new token a row attends in float32 over upcast keys/values
        # (BMM_FLOAT32_MAX_LENGTH), rounded as sdpa's kernel rounds.
        self._bmm_float32 = on_cpu and not self._bmm_attention
        #: Layers whose INPUTS each forward keeps per token in the cache (``cache.write_aux``, ``[B, L,
        #: len * hidden]`` in this order): an EAGLE-3 head's aux states (:mod:`actors.model.eagle3_serving`).
        self.aux_layers: tuple[int, ...] = ()

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor,
        masks: torch.Tensor | dict[str, torch.Tensor] | None, cache: Any,
    ) -> torch.Tensor:
        """``input_ids`` / ``position_ids`` ``[B, L]``, ``masks`` from ``layer_masks`` (one
        ``[B, 1, L, T_kv]`` bool mask or one per layer kind; None: every token sees every bound
        column, a one-token row of a model without sliding layers), ``cache`` bound to the rows ->
        the final-normed hidden states ``[B, L, hidden]``; every layer's new keys/values are written."""
        hidden = self.embed_tokens(input_ids).to(self.dtype)  # [B, L, hidden]
        cos, sin = self.rotary_emb(hidden, position_ids)  # [B, L, d] each
        rotary = _rotary_factors(cos, sin)
        batch, length = input_ids.shape
        bmm_dtype = self._bmm_dtype(length)
        attend = self._attention_masks(masks, bmm_dtype)  # per layer kind: the mask attention takes
        aux: dict[int, torch.Tensor] = {}  # the inputs of the aux layers, [B, L, hidden] each
        for index, layer in enumerate(self.layers):
            if index in self.aux_layers:
                aux[index] = hidden
            query, key, value = self._before_attention(hidden, rotary, *layer.before)  # [B, L, H|H_kv, d]
            keys, values = cache.write_and_gather(index, key.transpose(1, 2), value.transpose(1, 2))  # [B, H_kv, T_kv, d]
            attended = self._attend(layer.attention, query, keys, values, attend[layer.kind], bmm_dtype)  # [B, L, H d]
            hidden = _after_attention(hidden, attended, *layer.after)  # [B, L, hidden]
        if aux:
            cache.write_aux(torch.cat([aux[i] for i in self.aux_layers], dim=-1))  # [B, L, len * hidden]
        return _rms_norm(hidden, *self.final_norm)

    def _bmm_dtype(self, length: int) -> torch.dtype | None:
        """The dtype :func:`~actors.model.lean_attention.bmm_attention` computes in for a forward of ``length`` new tokens per
        row: the activations' (float32/float64, a quantized copy's), float32 (16 bits, at most
        :data:`BMM_FLOAT32_MAX_LENGTH` tokens), or None: sdpa."""
        if self._bmm_attention:
            return self.dtype
        if self._bmm_float32 and length <= BMM_FLOAT32_MAX_LENGTH:
            return torch.float32
        return None

    def _attention_masks(self, masks: torch.Tensor | dict[str, torch.Tensor] | None,
                         bmm_dtype: torch.dtype | None) -> dict[str, torch.Tensor | None]:
        """Each layer kind's bool mask ``[B, 1, L, T_kv]`` in the form :meth:`_attend` takes, built
        once per forward: for :func:`~actors.model.lean_attention.bmm_attention` (``bmm_dtype`` set), additive ``[B H_kv, G L, T_kv]``
        in that dtype (None stays None)."""
        by_kind = masks if isinstance(masks, dict) else {kind: masks for kind in set(self.architecture.layer_types)}
        if bmm_dtype is None:
            return by_kind
        return {kind: None if mask is None else additive_grouped_mask(mask, self._shape, bmm_dtype)
                for kind, mask in by_kind.items()}

    def _attend(self, module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None, bmm_dtype: torch.dtype | None) -> torch.Tensor:
        """Attention of ``query`` ``[B, L, H, d]`` over ``keys`` / ``values`` ``[B, H_kv, T_kv, d]``
        -> ``[B, L, H d]``: two batched matmuls in ``bmm_dtype`` (:func:`~actors.model.lean_attention.bmm_attention`; the result
        rounded to the query's dtype), else sdpa."""
        batch, length = query.shape[:2]
        if bmm_dtype == query.dtype:
            return bmm_attention(query, keys, values, mask, module.scaling)
        if bmm_dtype is not None:
            return bmm_attention_rounded(query, keys, values, mask, module.scaling)
        return sdpa_attention(module, query.transpose(1, 2), keys, values, mask).reshape(batch, length, -1)

    def head(self, lm_head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)`` (``[N, hidden]`` -> ``[N, V]``), through :func:`_linear` over the
        weight in oneDNN's layout when ``lm_head`` is the model's plain ``nn.Linear`` head."""
        if lm_head is self._head:
            return _linear(hidden, self._head_weight, self._head_bias)
        return lm_head(hidden)

    def drop_float_head(self) -> None:
        """Forget the model's float head (replaced by a quantized one): :meth:`head` calls the model's."""
        self._head, self._head_weight, self._head_bias = None, None, None

    @torch.inference_mode()
    def self_check(self, model: Any, tokens: int = 6) -> float:
        """Run ``tokens`` new tokens through this path and through ``model``'s own decoder over a
        scratch one-slot cache -> the largest difference of their hidden states, relative to
        their largest magnitude (a variant this path does not reproduce shows here, at load)."""
        from actors.model.kv_cache import PagedKVCache
        from actors.model.layer_masks import layer_masks

        device = self.embed_tokens.weight.device
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, self.embed_tokens.num_embeddings, (1, tokens), generator=generator).to(device)
        positions = torch.arange(tokens, device=device)[None]  # [1, L]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()[None, None]  # [1, 1, L, L]
        masks = layer_masks(self.architecture, causal, positions, positions, self.embed_tokens.weight.dtype)
        outputs = []
        for dtype, run in ((self.dtype, lambda cache: self(input_ids, positions, masks, cache)),
                           (model.dtype, lambda cache: model.get_decoder()(
                               input_ids=input_ids, position_ids=positions, attention_mask=masks, past_key_values=cache,
                               use_cache=True).last_hidden_state)):
            cache = PagedKVCache.from_config(model.config, capacity=tokens, max_slots=1, dtype=dtype, device=device)
            cache.bind(torch.zeros(1, dtype=torch.long, device=device), positions, tokens)
            try:
                outputs.append(run(cache).float())  # [1, L, hidden]
            finally:
                cache.unbind()
        lean, own = outputs
        return float((lean - own).abs().max() / own.abs().max().clamp_min(1e-6))


def _linear(inputs: torch.Tensor, weight: torch.Tensor | torch.nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)``, as oneDNN's matmul when ``weight`` is in its layout
    (:func:`_onednn_weight`): the same float32 GEMM; a quantized module (its bias inside) is called.
    ``inputs`` ``[..., in]`` -> ``[..., out]``."""
    if isinstance(weight, torch.nn.Module):
        return weight(inputs)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(inputs, weight, bias, "none", [], "")
    return F.linear(inputs, weight, bias)


def _linear_add(inputs: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``residual + F.linear(inputs, weight, bias)``; in float32 in oneDNN's layout the add is the
    matmul's own post-op (one op, the same float32 sum); in 16 bits a separate add of the rounded
    product, as the model's own forward sums them. ``inputs`` ``[..., in]``, ``residual`` ``[..., out]``."""
    if isinstance(weight, torch.Tensor) and weight.is_mkldnn and weight.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise.binary(inputs, residual, weight, bias, "add")
    return residual + _linear(inputs, weight, bias)


def _onednn_weight(weight: torch.Tensor, reorder: bool) -> torch.Tensor:
    """``weight`` ``[out, in]`` copied into oneDNN's blocked layout when ``reorder``, else itself."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_LAYOUT_ROWS) if reorder else weight


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm ``weight * (h * rsqrt(mean(h^2) + eps))`` over the last dim, as
    torch's ``F.rms_norm`` (one call; on CPU in torch 2.13 it still runs the formula op by op).
    In 16 bits as the model's own module rounds: the normalization in float32, rounded to the
    dtype, then times the weight (bit for bit its result; ``F.rms_norm`` with the weight inside
    rounds once, a last-bit difference in a quarter of the values)."""
    if hidden.dtype in _FULL_PRECISION:
        return F.rms_norm(hidden, hidden.shape[-1:], weight, eps)
    normed = F.rms_norm(hidden.float(), hidden.shape[-1:], None, eps).to(hidden.dtype)  # [..., hidden]
    return normed if weight is None else weight * normed


def _rotary_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary module's ``cos`` / ``sin`` ``[B, L, d]`` -> ``cos`` and ``sin`` with the first
    half negated, each ``[B, L, 1, d]``, so that for ``x`` ``[B, L, heads, d]``
    ``x * cos + x.roll(d / 2, -1) * signed_sin`` is transformers' ``x * cos + rotate_half(x) * sin``
    (``rotate_half(x) = cat(-x2, x1)``; ``-x2 * s == x2 * -s`` exactly)."""
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((sin[..., :half].neg(), sin[..., half:]), dim=-1)  # [B, L, d]
    return cos.unsqueeze(2), signed_sin.unsqueeze(2)


def _rotate(states: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary position embedding of ``states`` ``[B, L, heads, d]`` (queries and keys together)."""
    cos, signed_sin = rotary
    return states * cos + states.roll(states.shape[-1] // 2, -1) * signed_sin


def _check_rotary(apply_rotary: Callable, head_dim: int) -> None:
    """Raise unless :func:`_rotate` equals the model module's ``apply_rotary_pos_emb`` (the
    half-split rotation every :data:`LEAN_FAMILIES` module has; checked on random values at load)."""
    generator = torch.Generator().manual_seed(0)
    states, cos, sin = (torch.randn(2, 3, 4, head_dim, generator=generator, dtype=torch.float64) for _ in range(3))
    expected, _ = apply_rotary(states.transpose(1, 2), states.transpose(1, 2), cos[:, :, 0], sin[:, :, 0])
    ours = _rotate(states, _rotary_factors(cos[:, :, 0], sin[:, :, 0]))  # [2, 3, 4, d]
    if not torch.allclose(ours, expected.transpose(1, 2), rtol=0, atol=1e-12):
        raise ValueError("the model's apply_rotary_pos_emb is not the half-split rotation")


def _before_attention_fn(shape: HeadShape) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The first half of a layer for one head shape (constants of the graph)."""
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim

    def before_attention(
        hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], norm_weight: torch.Tensor, eps: float,
        qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, qk_norm_weight: torch.Tensor | None, head_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` ``[B, L, hidden]`` -> rotated queries ``[B, L, H, d]``, rotated keys and
        values ``[B, L, H_kv, d]``: the input norm, one q/k/v GEMM, the optional per-head norms
        and the rotary embedding, each over queries and keys at once (adjacent in the GEMM's output)."""
        batch, length, _ = hidden.shape
        qkv = _linear(_rms_norm(hidden, norm_weight, eps), qkv_weight, qkv_bias).view(
            batch, length, heads + 2 * kv_heads, head_dim)  # [B, L, H + 2 H_kv, d]
        query_key = qkv[:, :, : heads + kv_heads]  # [B, L, H + H_kv, d]
        if qk_norm_weight is not None:  # q_norm's weight on the query heads, k_norm's on the key heads
            query_key = _rms_norm(query_key, None, head_eps) * qk_norm_weight  # [H + H_kv, d] weight
        query_key = _rotate(query_key, rotary)
        return query_key[:, :, :heads], query_key[:, :, heads:], qkv[:, :, heads + kv_heads :]

    return before_attention


def _after_attention(
    hidden: torch.Tensor, attended: torch.Tensor, o_weight: torch.Tensor, o_bias: torch.Tensor | None,
    norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor, gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor, down_bias: torch.Tensor | None,
) -> torch.Tensor:
    """The rest of the layer: ``hidden + o_proj(attended)``, then ``+ down(silu(gate) * up)`` of its
    norm. ``hidden`` ``[B, L, hidden]``, ``attended`` ``[B, L, H d]`` -> ``[B, L, hidden]``."""
    hidden = _linear_add(attended, hidden, o_weight, o_bias)
    gate, up = _linear(_rms_norm(hidden, norm_weight, eps), gate_up_weight, gate_up_bias).chunk(2, dim=-1)  # [B, L, I]
    return _linear_add(F.silu(gate).mul_(up), hidden, down_weight, down_bias)


def _gemm_fn(reorder: bool, quantization: str | None) -> Callable[..., tuple[Any, torch.Tensor | None]]:
    """How a packed float ``(weight [out, in], bias)`` becomes what :func:`_linear` takes: the weight
    in oneDNN's layout when ``reorder``; a weight-only quantized module (bias inside) with ``quantization``."""
    if quantization is None:
        return lambda weight, bias: (_onednn_weight(weight, reorder), bias)
    from actors.model.quantized import quantized_gemm

    return lambda weight, bias: (quantized_gemm(weight, bias, quantization), None)


def _pack(linears: list[torch.nn.Linear], share: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` stacked by output rows; with ``share`` each ``nn.Linear``
    keeps a view of its rows, so the model holds each weight once and its own forward is unchanged
    (without: a copy, the model untouched, for a quantized copy that keeps only its own form)."""
    weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum of out, in]
    biases = [linear.bias for linear in linears]
    if any(bias is not None for bias in biases) and not all(bias is not None for bias in biases):
        raise ValueError("LeanDecoder: some packed projections have a bias and some do not")
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None  # [sum of out]
    if not share:
        return weight, bias
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _activation_dtype(quantization: str | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype a decoder of ``dtype`` computes in: its own, or a quantized copy's kernels' own."""
    if quantization is None:
        return dtype
    from actors.model.quantized import activation_dtype

    return activation_dtype(quantization, dtype)


def _pack_layer(layer: Any, kind: str, gemm: Callable[..., tuple[Any, torch.Tensor | None]], share: bool = True,
                dtype: torch.dtype | None = None) -> _LeanLayer:
    """One layer's :class:`_LeanLayer`; its four GEMM weights as ``gemm`` makes them (:func:`_gemm_fn`)."""
    attention, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = gemm(*_pack([attention.q_proj, attention.k_proj, attention.v_proj], share))
    gate_up_weight, gate_up_bias = gemm(*_pack([mlp.gate_proj, mlp.up_proj], share))
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    qk_norm_weight, head_eps = None, 0.0
    if q_norm is not None:
        if float(q_norm.variance_epsilon) != float(k_norm.variance_epsilon):
            raise ValueError("q_norm and k_norm have different epsilons")
        heads, kv_heads = attention.q_proj.weight.shape[0] // attention.head_dim, attention.k_proj.weight.shape[0] // attention.head_dim
        qk_norm_weight = torch.cat([q_norm.weight.detach().expand(heads, -1),
                                    k_norm.weight.detach().expand(kv_heads, -1)])  # [H + H_kv, d]
        head_eps = float(q_norm.variance_epsilon)
    cast = (lambda weight: weight) if dtype is None else (lambda weight: weight.to(dtype))  # the norms' weights
    before = (cast(layer.input_layernorm.weight.detach()), float(layer.input_layernorm.variance_epsilon), qkv_weight,
              qkv_bias, None if qk_norm_weight is None else cast(qk_norm_weight), head_eps)
    o_weight, o_bias = gemm(attention.o_proj.weight.detach(), _detached(attention.o_proj.bias))
    down_weight, down_bias = gemm(mlp.down_proj.weight.detach(), _detached(mlp.down_proj.bias))
    after = (o_weight, o_bias, cast(layer.post_attention_layernorm.weight.detach()),
             float(layer.post_attention_layernorm.variance_epsilon), gate_up_weight, gate_up_bias, down_weight, down_bias)
    return _LeanLayer(attention=attention, before=before, after=after, kind=kind)


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def build_lean_decoder(model: Any, architecture: Architecture, name: str,
                       quantization: str | None = None) -> tuple[LeanDecoder | None, str]:
    """The lean decoder of ``model`` (``name`` names it in logs), or None when the model's own
    decoder must run: a family or shape the lean path does not cover (logged), or a failure while
    building it (a warning naming the model; the model's own decoder gives the same law); and the
    path it runs, in words (for the start-up log). ``quantization``: the decoder of a weight-only
    quantized copy of ``model`` (see the module doc; None back: the caller builds the copy otherwise)."""
    reason = lean_support(model, architecture)
    if reason is not None:
        logger.info("%s runs its own decoder forward (lean path: %s)", name, reason)
        return None, f"its own decoder ({reason})"
    try:
        decoder = LeanDecoder(model, architecture, quantization)
        difference = decoder.self_check(model)
    except Exception as error:  # noqa: BLE001 - any failure means the model's own forward, never a crash
        logger.warning("%s: the lean decoder could not be built (%s: %s); running the model's own decoder",
                       name, type(error).__name__, error)
        return None, f"its own decoder (the lean decoder failed to build: {type(error).__name__})"
    tolerance = (QUANTIZED_SELF_CHECK_TOLERANCE if quantization is not None
                 else SELF_CHECK_TOLERANCE.get(model.dtype, SELF_CHECK_TOLERANCE_16_BIT))
    if not difference <= tolerance:  # NaN included
        logger.warning("%s: the lean decoder's hidden states differ from the model's own by %.3g (over %g); "
                       "running the model's own decoder", name, difference, tolerance)
        return None, f"its own decoder (the lean decoder differed by {difference:.3g} at load)"
    weights = f"weight-only {quantization}" if quantization is not None else ("oneDNN's layout" if decoder.onednn else "")
    logger.info("%s runs the lean decoder forward (%s, packed q/k/v and gate/up weights%s; self-check %.3g)", name,
                architecture.model_type, f", {weights}" if weights else "", difference)
    return decoder, f"the lean decoder ({architecture.model_type}{', weight-only ' + quantization if quantization else ''})"
