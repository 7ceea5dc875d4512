"""One vocabulary per model group: the same tokenizer everywhere, padded embedding rows masked.

Models of one family often share a tokenizer but pad their embedding tables differently
(Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064, for a tokenizer of 151,665 tokens). Rows
past the tokenizer's last id are no tokens at all: they cannot be decoded, and a draft that
lacks them loses nothing. So the group's law is each model's softmax over the tokenizer's
**real tokens** ``[0, len(tokenizer))``; logits of padded rows are dropped before sampling
(:class:`actors.messages.RowSampling` ``vocab_limit``), in every model alike.

What must hold, checked when the group starts (:func:`group_vocabulary`), else the group is
refused with :class:`VocabularyMismatchError` naming the models:

* every model that ships a tokenizer ships the same one as the group's: the same token -> id
  map and special tokens (:func:`tokenizer_identity`; two tokenizers that split text alike but
  number tokens differently would verify one model's ids against another's meaning);
* every model has an embedding row for every real token (``vocab_size >= len(tokenizer)``): a
  model short of rows cannot give the law over the tokenizer's tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class VocabularyMismatchError(ValueError):
    """The models of a group do not share one vocabulary (the message names them)."""


@dataclass(frozen=True)
class TokenizerIdentity:
    """What makes two tokenizers interchangeable for the law: ids ``[0, size)`` are real tokens."""

    size: int  # len(tokenizer), added tokens included
    digest: str  # sha256 of the token -> id map and the special tokens


def tokenizer_identity(tokenizer: Any) -> TokenizerIdentity:
    """The :class:`TokenizerIdentity` of a transformers tokenizer."""
    special = {name: str(value) for name, value in sorted(tokenizer.special_tokens_map.items())}
    content = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]),
               "special": special, "special_ids": sorted(int(i) for i in tokenizer.all_special_ids)}
    digest = hashlib.sha256(json.dumps(content, ensure_ascii=False).encode()).hexdigest()
    return TokenizerIdentity(size=len(tokenizer), digest=digest)


def load_tokenizer_identity(path: str | None) -> TokenizerIdentity | None:
    """The identity of the tokenizer saved at ``path``; None when there is none to load."""
    if path is None:
        return None
    try:
        tokenizer = load_tokenizer(path)  # the process's one instance (the coordinator's, where shared)
    except (OSError, ValueError, TypeError) as error:  # no tokenizer files in the model directory
        logger.info("no tokenizer at %s (%s): its vocabulary is checked by size only", path, type(error).__name__)
        return None
    return tokenizer_identity(tokenizer)


def group_vocabulary(
    vocab_sizes: Mapping[str, int],
    tokenizers: Mapping[str, TokenizerIdentity | None],
    group_tokenizer: TokenizerIdentity | None,
) -> int:
    """The number of real tokens of a group (the ``vocab_limit`` of every row), or refuse.

    ``vocab_sizes``: model name -> embedding rows; ``tokenizers``: model name -> the identity of
    the tokenizer in the model's directory (None: none there); ``group_tokenizer``: the group's
    tokenizer (None: a token-ids-only group). See the module doc for what is checked.
    """
    known = {name: identity for name, identity in tokenizers.items() if identity is not None}
    reference = group_tokenizer or next(iter(known.values()), None)
    differing = sorted(name for name, identity in known.items() if identity != reference)
    if differing:
        raise VocabularyMismatchError(
            f"models {differing} ship a tokenizer that differs from the group's (token -> id map or special "
            f"tokens): one vocabulary is needed to verify one model's tokens against another")
    if reference is None:
        if len(set(vocab_sizes.values())) > 1:
            raise VocabularyMismatchError(
                f"models' vocabularies differ ({dict(vocab_sizes)}) and no tokenizer says which ids are real "
                f"tokens; give the group a tokenizer")
        return min(vocab_sizes.values())
    short = {name: rows for name, rows in vocab_sizes.items() if rows < reference.size}
    if short:
        raise VocabularyMismatchError(
            f"models {sorted(short)} have fewer embedding rows ({short}) than the tokenizer's "
            f"{reference.size} tokens: they cannot give the law over every token")
    return reference.size
