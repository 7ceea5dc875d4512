"""Verification rules by name: the one place that maps a method name to its function.

Callers (the reference loop, the coordinator, benchmarks) never branch on method names; they
ask :func:`get_verifier` for a :class:`VerifierSpec` and call ``spec.verify``.

Entries name the module and function that implement them and are imported on first use, so
a rule whose module is not present yet (or fails to import) does not break the others.
Shapes of the two families:

* single-draft (``multi_draft=False``): ``draft_tokens [B, gamma]``, ``draft_probs
  [B, gamma, V]``, ``target_probs [B, gamma+1, V]``;
* multi-draft (``multi_draft=True``): ``draft_tokens [B, K, gamma]``, ``draft_probs
  [B, K, gamma, V]``, ``target_probs [B, K, gamma+1, V]``; the result carries ``draft_index``.

Both take ``*, generator, state=None`` and return :class:`verifiers.types.VerifyResult`.
``stateful=True`` rules return a ``state`` that must be passed back on the next call for the
same request.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from verifiers.types import VerifyResult

MethodName = Literal["token", "block", "greedy_block", "spectr", "spectr_gbv", "sequential_gbv"]


@dataclass(frozen=True)
class VerifierSpec:
    """A verification rule: its name, function and calling convention."""

    name: str
    verify: Callable[..., VerifyResult]
    multi_draft: bool
    stateful: bool


@dataclass(frozen=True)
class _Entry:
    module: str
    function: str
    multi_draft: bool
    stateful: bool


_ENTRIES: dict[str, _Entry] = {
    "token": _Entry("verifiers.single_draft", "verify_token", multi_draft=False, stateful=False),
    "block": _Entry("verifiers.single_draft", "verify_block", multi_draft=False, stateful=False),
    "greedy_block": _Entry(
        "verifiers.single_draft", "verify_greedy_block", multi_draft=False, stateful=True
    ),
    "spectr": _Entry("verifiers.multi_draft.spectr", "verify_spectr", multi_draft=True, stateful=False),
    "spectr_gbv": _Entry(
        "verifiers.multi_draft.spectr_gbv", "verify_spectr_gbv", multi_draft=True, stateful=True
    ),
    "sequential_gbv": _Entry(
        "verifiers.multi_draft.sequential_gbv", "verify_sequential_gbv", multi_draft=True, stateful=True
    ),
}

assert set(_ENTRIES) == set(get_args(MethodName)), "MethodName and the registry disagree"


class UnknownVerifierError(ValueError):
    """No verification rule has this name."""


class VerifierUnavailableError(RuntimeError):
    """The rule is registered but its implementation cannot be imported."""


def verifier_names() -> list[str]:
    """Every registered method name (whether or not its module is importable)."""
    return list(_ENTRIES)


def get_verifier(name: str) -> VerifierSpec:
    """The :class:`VerifierSpec` of ``name``; raises :class:`UnknownVerifierError` listing the
    valid names, or :class:`VerifierUnavailableError` if its module is missing."""
    entry = _ENTRIES.get(name)
    if entry is None:
        raise UnknownVerifierError(
            f"unknown verification method {name!r}; valid methods: {', '.join(_ENTRIES)}"
        )
    try:
        module = importlib.import_module(entry.module)
        verify = getattr(module, entry.function)
    except (ImportError, AttributeError) as error:
        raise VerifierUnavailableError(
            f"verification method {name!r} is registered but {entry.module}.{entry.function} "
            f"cannot be loaded: {error}"
        ) from error
    return VerifierSpec(name=name, verify=verify, multi_draft=entry.multi_draft, stateful=entry.stateful)


def available_verifiers() -> list[VerifierSpec]:
    """Specs of every registered rule whose implementation loads, in registry order."""
    specs = []
    for name in _ENTRIES:
        try:
            specs.append(get_verifier(name))
        except VerifierUnavailableError:
            continue
    return specs
