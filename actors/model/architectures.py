"""Which model architectures the engine serves exactly, and what each one needs.

The engine computes a model's logits its own way: one ragged forward of the decoder over the
slot cache with a ready 4D attention mask (:mod:`actors.model.batch`), then the output embedding at
the kept positions (:class:`actors.model.backends.SlotBackend`). That equals the model's own
``forward`` only where the engine reproduces everything the model does around its decoder
layers: which keys each layer may see (full causal attention or a sliding window), the
attention implementation the model's law needs, and the transform after the output embedding.
A model whose config asks for anything else would be served with another law, so it is
refused at load (:class:`UnsupportedModelError`, naming the feature and the model).

:func:`resolve_architecture` reads a transformers config and returns the
:class:`Architecture` the backend follows, or refuses. It is an allow-list: a model type not
in :data:`FAMILIES` is refused even when none of the features checked here is present, since
an unknown decoder may do something no check looks for. Every family in the list is tested
against transformers' own full forward (``tests/actors/model/test_architectures.py``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import torch


class UnsupportedModelError(ValueError):
    """A model whose law the engine cannot reproduce; the message names the feature and the model."""

    def __init__(self, model: str, feature: str):
        self.model = model
        self.feature = feature
        super().__init__(f"model {model!r} is refused: {feature}; serving it would change its output law")


class MaskLayout(enum.Enum):
    """How the model's decoder hands attention masks to its layers (read from its ``forward``)."""

    #: Every layer attends to the whole causal context (Llama, GPT-2, ...); ``sliding_window``
    #: in the config, if any, is not read by the model.
    FULL = "full"
    #: One mask for every layer: a sliding window of ``config.sliding_window`` when that is set,
    #: full causal otherwise (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE).
    CONFIG_WINDOW = "config_window"
    #: One mask per ``config.layer_types`` entry, ``"full_attention"`` or
    #: ``"sliding_attention"`` (window ``config.sliding_window``); the decoder takes a dict
    #: from layer type to ready mask (Qwen2, Qwen3, Gemma 2, Gemma 3).
    LAYER_TYPES = "layer_types"


class HeadKind(enum.Enum):
    """What the model's ``forward`` does to ``lm_head``'s output (read from each model's code)."""

    PLAIN = "plain"  # logits = lm_head(h)
    LOGIT_SCALE = "logit_scale"  # Cohere: logits = lm_head(h) * config.logit_scale
    LOGITS_SCALING = "logits_scaling"  # Granite: logits = lm_head(h) / config.logits_scaling
    FINAL_SOFTCAP = "final_softcap"  # Gemma 2/3: c = final_logit_softcapping; tanh(logits / c) * c when c is set


@dataclass(frozen=True)
class Family:
    """What the engine knows of one transformers ``model_type``."""

    masks: MaskLayout
    head: HeadKind = HeadKind.PLAIN
    #: The model's eager attention soft-caps its scores when ``config.attn_logit_softcapping``
    #: is set (sdpa cannot: such a model runs eager).
    attention_softcap: bool = False
    #: transformers runs the model under sdpa (Gemma 2 declares it does not).
    supports_sdpa: bool = True


#: The allow-list: model types whose decoder, masks and head the engine reproduces exactly.
FAMILIES: dict[str, Family] = {
    "llama": Family(MaskLayout.FULL),
    "gemma": Family(MaskLayout.FULL),
    "gpt2": Family(MaskLayout.FULL),
    "gpt_neox": Family(MaskLayout.FULL),
    "opt": Family(MaskLayout.FULL),
    "mistral": Family(MaskLayout.CONFIG_WINDOW),
    "mixtral": Family(MaskLayout.CONFIG_WINDOW),
    "phi3": Family(MaskLayout.CONFIG_WINDOW),
    "starcoder2": Family(MaskLayout.CONFIG_WINDOW),
    "qwen3_moe": Family(MaskLayout.CONFIG_WINDOW),
    "qwen2": Family(MaskLayout.LAYER_TYPES),
    "qwen3": Family(MaskLayout.LAYER_TYPES),
    "gemma2": Family(MaskLayout.LAYER_TYPES, HeadKind.FINAL_SOFTCAP, attention_softcap=True, supports_sdpa=False),
    "gemma3_text": Family(MaskLayout.LAYER_TYPES, HeadKind.FINAL_SOFTCAP, attention_softcap=True),
    "olmo2": Family(MaskLayout.FULL),
    "phi": Family(MaskLayout.FULL),
    "olmo3": Family(MaskLayout.LAYER_TYPES),
    "qwen2_moe": Family(MaskLayout.LAYER_TYPES),
    "smollm3": Family(MaskLayout.LAYER_TYPES),
    "ministral": Family(MaskLayout.LAYER_TYPES),
    "cohere": Family(MaskLayout.FULL, HeadKind.LOGIT_SCALE),
    "cohere2": Family(MaskLayout.LAYER_TYPES, HeadKind.LOGIT_SCALE),
    "granite": Family(MaskLayout.FULL, HeadKind.LOGITS_SCALING),
    "granitemoe": Family(MaskLayout.FULL, HeadKind.LOGITS_SCALING),
}

#: Layer kinds of ``MaskLayout.LAYER_TYPES`` models.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

#: Rotary scalings whose frequencies depend on the longest position in the batch
#: (``transformers.modeling_rope_utils.dynamic_rope_update``: a type containing "dynamic", or
#: "longrope"): a row's law would depend on the other rows of its forward.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class Architecture:
    """What :class:`actors.model.backends.SlotBackend` does for one model (see the module doc)."""

    model_type: str
    attn_implementation: str  # "sdpa", or "eager" where the law needs it (attention soft-capping)
    masks: MaskLayout
    layer_types: tuple[str, ...]  # per decoder layer: FULL_ATTENTION or SLIDING_ATTENTION
    sliding_window: int | None  # keys at positions > p - sliding_window are seen by a query at p
    head: HeadKind
    head_value: float | None  # logit_scale, logits_scaling or the soft-cap; None: nothing to do

    @property
    def has_sliding_layers(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return SLIDING_ATTENTION in self.layer_types


def resolve_architecture(config: Any, model: str) -> Architecture:
    """The :class:`Architecture` of a transformers ``config``; ``model`` (its path or name)
    names it in errors. Raises :class:`UnsupportedModelError` for anything not served exactly."""
    model_type = str(getattr(config, "model_type", None))
    _refuse_structure(config, model)
    family = FAMILIES.get(model_type)
    if family is None:
        found = "; ".join(detected_features(config)) or "none of the known law-changing features"
        raise UnsupportedModelError(
            model, f"model type {model_type!r} is not among the architectures served exactly "
                   f"({', '.join(sorted(FAMILIES))}); config features found: {found}")
    _refuse_dynamic_rope(config, model)
    layer_types, window = _layer_kinds(config, family, model)
    head, head_value = _head(config, family, model)
    attention_softcap = getattr(config, "attn_logit_softcapping", None)
    if attention_softcap is not None and not family.attention_softcap:
        raise UnsupportedModelError(model, f"attention soft-capping (attn_logit_softcapping={attention_softcap}) "
                                           f"on model type {model_type!r}, whose attention does not implement it")
    eager = attention_softcap is not None or not family.supports_sdpa  # sdpa cannot soft-cap scores
    return Architecture(
        model_type=model_type,
        attn_implementation="eager" if eager else "sdpa",
        masks=family.masks,
        layer_types=layer_types,
        sliding_window=window,
        head=head,
        head_value=head_value,
    )


def apply_head(architecture: Architecture, logits: torch.Tensor) -> torch.Tensor:
    """The model's own transform of ``lm_head``'s output ``[N, V]`` (in the model's dtype, as its
    ``forward`` does): Cohere ``logits * logit_scale``, Granite ``logits / logits_scaling``,
    Gemma 2/3 ``tanh(logits / c) * c`` with ``c = final_logit_softcapping``."""
    value = architecture.head_value
    if value is None:
        return logits
    if architecture.head is HeadKind.LOGIT_SCALE:
        return logits * value
    if architecture.head is HeadKind.LOGITS_SCALING:
        return logits / value
    if architecture.head is HeadKind.FINAL_SOFTCAP:
        return torch.tanh(logits / value) * value
    raise ValueError(f"apply_head: no transform for head {architecture.head}")


def detected_features(config: Any) -> list[str]:
    """The law-changing features a config declares, as ``name=value`` strings (for errors)."""
    found = []
    for name in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "logit_scale",
                 "logits_scaling", "attention_chunk_size", "alibi", "is_encoder_decoder", "add_cross_attention"):
        value = getattr(config, name, None)
        if value not in (None, False):
            found.append(f"{name}={value}")
    if str(getattr(config, "model_type", "")) in ("bloom", "mpt"):
        found.append("ALiBi position bias")
    kinds = sorted(set(getattr(config, "layer_types", None) or ()))
    if kinds:
        found.append(f"layer_types={kinds}")
    return found


def _refuse_structure(config: Any, model: str) -> None:
    """Refuse encoder-decoders, cross-attention, ALiBi and chunked attention, whatever the family."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(model, "an encoder-decoder model (is_encoder_decoder=True)")
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(model, "cross-attention layers (add_cross_attention=True)")
    if getattr(config, "alibi", False) or str(getattr(config, "model_type", "")) in ("bloom", "mpt"):
        raise UnsupportedModelError(model, "ALiBi position bias (added to attention scores; not built by the engine)")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None:
        raise UnsupportedModelError(model, f"chunked attention (attention_chunk_size={chunk})")


def _rope_types(config: Any) -> list[str]:
    """Every rotary type named by the config (``rope_parameters`` may hold one per layer type)."""
    found = []
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if not isinstance(params, dict):
            continue
        nested = [value for value in params.values() if isinstance(value, dict)]
        for entry in nested or [params]:
            kind = entry.get("rope_type", entry.get("type"))
            if kind is not None:
                found.append(str(kind))
    return found


def _refuse_dynamic_rope(config: Any, model: str) -> None:
    for kind in _rope_types(config):
        if any(dynamic in kind for dynamic in DYNAMIC_ROPE_TYPES):  # transformers: '"dynamic" in rope_type'
            raise UnsupportedModelError(
                model, f"rotary scaling rope_type={kind!r} (its frequencies depend on the longest position in the batch)")


def _layer_kinds(config: Any, family: Family, model: str) -> tuple[tuple[str, ...], int | None]:
    """Per layer FULL_ATTENTION / SLIDING_ATTENTION, and the window (None when no layer slides)."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if family.masks is MaskLayout.FULL:
        kinds = (FULL_ATTENTION,) * layers
    elif family.masks is MaskLayout.CONFIG_WINDOW:
        kinds = (FULL_ATTENTION if window is None else SLIDING_ATTENTION,) * layers
    else:
        kinds = tuple(str(kind) for kind in (getattr(config, "layer_types", None) or ()))
        if len(kinds) != layers:
            raise UnsupportedModelError(model, f"layer_types has {len(kinds)} entries for {layers} layers")
        unknown = sorted(set(kinds) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise UnsupportedModelError(model, f"attention layer types {unknown} in layer_types")
    if SLIDING_ATTENTION not in kinds:
        return kinds, None
    if not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(model, f"sliding-window layers with sliding_window={window!r} (need an int >= 1)")
    return kinds, int(window)


def _head(config: Any, family: Family, model: str) -> tuple[HeadKind, float | None]:
    """The family's head transform and its constant; refuse a transform the family does not do."""
    values = {
        HeadKind.LOGIT_SCALE: getattr(config, "logit_scale", None),
        HeadKind.LOGITS_SCALING: getattr(config, "logits_scaling", None),
        HeadKind.FINAL_SOFTCAP: getattr(config, "final_logit_softcapping", None),
    }
    for kind, value in values.items():
        if value is not None and kind is not family.head:
            raise UnsupportedModelError(
                model, f"a final logit transform ({kind.value}={value}) that model type "
                       f"{config.model_type!r} does not apply")
    if family.head is HeadKind.PLAIN:
        return HeadKind.PLAIN, None
    value = values[family.head]
    if family.head is not HeadKind.FINAL_SOFTCAP and value is None:
        raise UnsupportedModelError(model, f"{family.head.value} is missing from the config")
    if value is None:
        return family.head, None
    value = float(value)
    if not math.isfinite(value) or value == 0 or (family.head is HeadKind.FINAL_SOFTCAP and value < 0):
        raise UnsupportedModelError(model, f"{family.head.value}={value} (need a finite non-zero value; a cap > 0)")
    return family.head, value
