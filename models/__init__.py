"""The embedded default model family and the helpers that locate it on disk.

Four small Llama-architecture causal LMs share one byte-level BPE tokenizer and live under
``models/embedded/<name>/`` in standard transformers format (config.json, model.safetensors,
generation_config.json and the tokenizer files in every directory), so each loads stand-alone
with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` offline:

- ``target``   -- the verifier (~12M parameters).
- ``draft``    -- a ~1M-parameter model distilled from ``target`` (the speculative proposer).
- ``partner``  -- target-sized, trained on a different data slice (ensembles, contrastive decoding).
- ``partner2`` -- a smaller third member for three-model ensembles.

See ``models/README.md`` (the model card) and ``models/train.py`` (how they were trained).
A model can be named anywhere a hub id or path is accepted with the string form
``embedded:<name>``; :func:`resolve_model_path` turns that into the local directory.
"""

from __future__ import annotations

import pathlib

EMBEDDED_MODELS: tuple[str, ...] = ("target", "draft", "partner", "partner2")
#: Embedded checkpoints that are no causal LM of their own: ``eagle3``, the EAGLE-3 head of ``target``.
EMBEDDED_HEADS: tuple[str, ...] = ("eagle3",)
EMBEDDED_PREFIX = "embedded:"
EMBEDDED_ROOT = pathlib.Path(__file__).resolve().parent / "embedded"


def embedded_model_path(name: str) -> pathlib.Path:
    """Return the checkpoint directory of the embedded model ``name``.

    Raises:
        ValueError: if ``name`` is not one of :data:`EMBEDDED_MODELS`.
    """
    if name not in EMBEDDED_MODELS + EMBEDDED_HEADS:
        raise ValueError(
            f"unknown embedded model {name!r}; expected one of {', '.join(EMBEDDED_MODELS + EMBEDDED_HEADS)}"
        )
    return EMBEDDED_ROOT / name


def is_embedded_spec(spec: str) -> bool:
    """True when ``spec`` uses the ``embedded:<name>`` form."""
    return spec.startswith(EMBEDDED_PREFIX)


def resolve_model_path(spec: str) -> str:
    """Resolve a model spec to something ``from_pretrained`` accepts.

    ``embedded:<name>`` becomes the local checkpoint directory of that embedded model (a
    ``ValueError`` names the bad value for an unknown name); any other string is returned
    unchanged, to be treated as a hub id or a filesystem path.
    """
    if is_embedded_spec(spec):
        return str(embedded_model_path(spec[len(EMBEDDED_PREFIX):]))
    return spec


__all__ = [
    "EMBEDDED_HEADS",
    "EMBEDDED_MODELS",
    "EMBEDDED_PREFIX",
    "EMBEDDED_ROOT",
    "embedded_model_path",
    "is_embedded_spec",
    "resolve_model_path",
]
