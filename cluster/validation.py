"""Checks every field of a request before any model work, the same way for HTTP and gRPC.

Both protocols build an :class:`actors.api.GenerationRequest` (types and simple ranges checked
by its pydantic schema); :func:`check_generation_request` then checks what the schema lets
through but the decoding code cannot take:

- non-finite numbers (``NaN``, ``inf``; JSON ``1e400`` parses as ``inf``): ``temperature``,
  ``top_p``, the penalties (also bounded: ``presence_penalty`` / ``frequency_penalty`` to
  [-2, 2], ``repetition_penalty`` to (0, 10]), ``logit_bias`` values (also bounded to
  [-100, 100]), ``speculation.mu``, ``speculation.weights``;
- positive temperatures below :data:`MIN_POSITIVE_TEMPERATURE` (``logits / 1e-320``
  overflows; use 0 for greedy decoding), and a contrastive strength ``mu`` above
  :data:`MAX_MU` (``expert - 1e308 * amateur`` overflows);
- integers beyond int64 (HTTP JSON has no limit; seeds must fit a torch generator), and
  negative ones among the token ids of ``prompt_ids`` and ``logit_bias``;
- sizes: prompt length (``limits.max_prompt_chars``), number and length of stop strings,
  lengths of the ``weights`` / ``gammas`` / ``members`` lists and of names;
- ``speculation.gammas`` in [1, MAX_GAMMA] and ``weights`` in [0, 1] even when the strategy
  does not use them.

Whether the strategy, method, members, weights sum and block lengths fit the deployment is
checked next by :func:`actors.coordination.plan.resolve_plan` (also before any work), and the prompt's
token ids and length against the models' vocabulary and context by the coordinator before it
opens any session. Every failure raises :class:`actors.api.InvalidRequestError` naming the
field with its ``GenerationRequest`` path (``sampling.temperature``); the protocols rename it
(HTTP ``temperature``, gRPC ``sampling.temperature``).

This is the one place these values are checked: the protocols parse their own shapes (JSON
types, ``logit_bias`` keys as decimal strings, proto presence) and leave every value to it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from actors.api import MAX_GAMMA, GenerationRequest, InvalidRequestError, SamplingParams, SpeculationParams

INT64_MAX = 2**63 - 1
#: Smallest positive temperature (0 means greedy).
MIN_POSITIVE_TEMPERATURE = 1e-6
#: Largest contrastive strength ``speculation.mu``.
MAX_MU = 1000.0
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
#: Longest ``weights`` / ``gammas`` / ``members`` list.
MAX_LIST_ITEMS = 64
#: Largest absolute ``presence_penalty`` / ``frequency_penalty`` (OpenAI's range).
MAX_PENALTY = 2.0
#: Largest ``repetition_penalty`` (must be > 0; 1 disables it).
MAX_REPETITION_PENALTY = 10.0
#: Most ``logit_bias`` entries, and the bound of their values.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
#: Longest model, member, strategy or method name.
MAX_NAME_CHARS = 128
#: A client-chosen request id (gRPC ``request_id``): used in logs and session names.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequestError(field, f"must be a finite number (got {value})")
    return value


def _int64(field: str, value: int, low: int = 0) -> int:
    if not low <= value <= INT64_MAX:
        raise InvalidRequestError(field, f"must be in [{low}, {INT64_MAX}] (got {shortened(value)})")
    return value


def shortened(value: object, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _list_size(field: str, values: Sequence | None) -> None:
    if values is not None and len(values) > MAX_LIST_ITEMS:
        raise InvalidRequestError(field, f"at most {MAX_LIST_ITEMS} items (got {len(values)})")


def _name(field: str, value: str | None) -> None:
    if value is not None and len(value) > MAX_NAME_CHARS:
        raise InvalidRequestError(field, f"at most {MAX_NAME_CHARS} characters (got {len(value)})")


def check_request_id(field: str, value: str) -> str:
    """A client-chosen request id: 1-128 characters of ``A-Z a-z 0-9 . _ : -``."""
    if not REQUEST_ID_PATTERN.fullmatch(value):
        raise InvalidRequestError(field, "must be 1-128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'")
    return value


def check_generation_request(request: GenerationRequest, max_prompt_chars: int) -> GenerationRequest:
    """Raise :class:`InvalidRequestError` unless every field of ``request`` is usable (see the
    module docstring); returns ``request``."""
    _check_prompt(request, max_prompt_chars)
    _check_sampling(request.sampling)
    _check_penalties(request.sampling)
    _check_logit_bias(request.sampling)
    _check_stop(request.sampling)
    _check_structured(request.sampling)
    _check_speculation(request.speculation)
    return request


def _check_structured(sampling: SamplingParams) -> None:
    """The constraint's grammar alone (no tokenizer, no model work): invalid schemas, regexes and
    grammars, unsupported keywords and grammars over the engine's limits answer 400 here."""
    structured = sampling.structured
    if structured is None:
        return
    from verifiers.grammar import GrammarError, compile_constraint

    if sampling.min_tokens:
        raise InvalidRequestError("min_tokens", "cannot be combined with a structured-output constraint (the grammar "
                                  "decides where the output may end)")
    try:
        compile_constraint(structured.kind, structured.spec, None)
    except GrammarError as error:
        raise InvalidRequestError(structured.field, str(error)) from None


def _check_prompt(request: GenerationRequest, max_prompt_chars: int) -> None:
    if request.prompt is not None and len(request.prompt) > max_prompt_chars:
        raise InvalidRequestError("prompt", f"at most {max_prompt_chars} characters (got {len(request.prompt)})")
    if request.prompt_ids is not None:
        if len(request.prompt_ids) > max_prompt_chars:
            raise InvalidRequestError("prompt_ids", f"at most {max_prompt_chars} token ids (got {len(request.prompt_ids)})")
        for token_id in request.prompt_ids:
            _int64("prompt_ids", token_id)


def _check_sampling(sampling: SamplingParams) -> None:
    temperature = _finite("sampling.temperature", sampling.temperature)
    if 0 < temperature < MIN_POSITIVE_TEMPERATURE:
        raise InvalidRequestError(
            "sampling.temperature",
            f"must be 0 (greedy) or at least {MIN_POSITIVE_TEMPERATURE} (got {temperature})",
        )
    _finite("sampling.top_p", sampling.top_p)
    _int64("sampling.top_k", sampling.top_k)
    _int64("sampling.max_tokens", sampling.max_tokens)
    if sampling.max_tokens == 0 and sampling.prompt_logprobs is None:
        raise InvalidRequestError(
            "sampling.max_tokens", "0 only scores the prompt: it needs prompt log-probabilities (echo with logprobs, "
            "or prompt_logprobs); otherwise at least 1"
        )
    if sampling.seed is not None:
        _int64("sampling.seed", sampling.seed)
    _check_vllm_extensions(sampling)


def _check_vllm_extensions(sampling: SamplingParams) -> None:
    """``min_p`` in [0, 1], ``min_tokens`` in [0, max_tokens], ``truncate_prompt_tokens`` >= 1."""
    if not (math.isfinite(sampling.min_p) and 0.0 <= sampling.min_p <= 1.0):
        raise InvalidRequestError("sampling.min_p", f"must be a number in [0, 1] (got {shortened(sampling.min_p)})")
    _int64("sampling.min_tokens", sampling.min_tokens)
    if sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequestError(
            "sampling.min_tokens", f"must be at most max_tokens ({sampling.max_tokens}), got {sampling.min_tokens}"
        )
    if sampling.truncate_prompt_tokens is not None:
        _int64("sampling.truncate_prompt_tokens", sampling.truncate_prompt_tokens, low=1)


def _check_penalties(sampling: SamplingParams) -> None:
    """``presence_penalty`` / ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` in (0, 10]."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidRequestError(
                f"sampling.{name}", f"must be a finite number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (got {shortened(value)})"
            )
    value = sampling.repetition_penalty
    if not (math.isfinite(value) and 0.0 < value <= MAX_REPETITION_PENALTY):
        raise InvalidRequestError(
            "sampling.repetition_penalty", f"must be a finite number in (0, {MAX_REPETITION_PENALTY:g}] (got {shortened(value)})"
        )


def _check_logit_bias(sampling: SamplingParams) -> None:
    """At most :data:`MAX_LOGIT_BIAS_ENTRIES` entries, token ids in [0, int64], values finite in
    [-100, 100] (whether the ids exist in the vocabulary is the coordinator's check)."""
    logit_bias = sampling.logit_bias
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError("sampling.logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries (got {len(logit_bias)})")
    for token_id, bias in logit_bias.items():
        if not 0 <= token_id <= INT64_MAX:
            raise InvalidRequestError("sampling.logit_bias", f"token ids must be in [0, {INT64_MAX}] (got {shortened(token_id)})")
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            raise InvalidRequestError(
                "sampling.logit_bias", f"values must be finite numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (got {bias})"
            )


def _check_stop(sampling: SamplingParams) -> None:
    if len(sampling.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings (got {len(sampling.stop)})")
    for stop in sampling.stop:
        if not stop:
            raise InvalidRequestError("sampling.stop", "stop strings must not be empty")
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidRequestError("sampling.stop", f"a stop string has at most {MAX_STOP_CHARS} characters")


def _check_speculation(speculation: SpeculationParams) -> None:
    _name("speculation.method", speculation.method)
    _name("speculation.proposer", speculation.proposer)
    if speculation.mu is not None and not (math.isfinite(speculation.mu) and 0.0 <= speculation.mu <= MAX_MU):
        raise InvalidRequestError("speculation.mu", f"must be a finite number in [0, {MAX_MU:g}] (got {speculation.mu})")
    _list_size("speculation.weights", speculation.weights)
    for weight in speculation.weights or ():
        if not (math.isfinite(weight) and 0.0 <= weight <= 1.0):
            raise InvalidRequestError("speculation.weights", f"each weight must be a finite number in [0, 1] (got {weight})")
    _list_size("speculation.gammas", speculation.gammas)
    for gamma in speculation.gammas or ():
        if not 1 <= gamma <= MAX_GAMMA:
            raise InvalidRequestError("speculation.gammas", f"each must be in [1, {MAX_GAMMA}] (got {shortened(gamma)})")
    _list_size("speculation.members", speculation.members)
    for member in speculation.members or ():
        if not member:
            raise InvalidRequestError("speculation.members", "member names must not be empty")
        _name("speculation.members", member)


__all__ = [
    "INT64_MAX",
    "MAX_LIST_ITEMS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_MU",
    "MAX_NAME_CHARS",
    "MAX_PENALTY",
    "MAX_REPETITION_PENALTY",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MIN_POSITIVE_TEMPERATURE",
    "REQUEST_ID_PATTERN",
    "check_generation_request",
    "check_request_id",
    "shortened",
]
