"""Failures stay with their request: run many requests' work in one call, and when that call
raises, each request's alone.

The worker engine batches the work of a step's requests (one forward over every row, one draw
call over every sampling row, one verifier call per rule and block length). A batched call that
raises must not fail every request in it, only those whose own work fails:
:func:`batched_then_alone` is the one place that runs a batched call and falls back to one call
per request. A broken device's error (:func:`actors.model.device_health.is_device_broken`) is no
request's: it raises through as a ``DeviceBrokenError``, to the worker, which restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from actors.model.device_health import raise_if_device_broken

logger = logging.getLogger(__name__)

Key = TypeVar("Key")


def batched_then_alone(
    keys: Sequence[Key],
    batched: Callable[[list[Key]], Sequence[Any]],
    alone: Callable[[Key], Any],
    use: Callable[[Key, Any], None],
    fail: Callable[[Key, Exception], None],
    what: str = "a batched call",
) -> None:
    """Run ``batched`` once over every key (its results aligned with ``keys``) and ``use`` each
    key's result; if ``batched`` raises, run ``alone`` for each key instead. A key whose own call,
    or the use of its result, raises is handed to ``fail`` with the error, and the other keys go
    on. A single key is not run again (its call alone is the call that failed). ``what`` names
    the batched call in the warning logged when it falls back."""
    keys = list(keys)
    if not keys:
        return
    try:
        results: Sequence[Any] | None = batched(keys)
    except Exception as error:  # noqa: BLE001 - find the keys that fail, below
        raise_if_device_broken(error, what)
        if len(keys) == 1:
            fail(keys[0], error)
            return
        logger.warning("%s over %d requests failed (%s: %s); running each alone", what, len(keys),
                       type(error).__name__, error)
        results = None
    for index, key in enumerate(keys):
        try:
            use(key, alone(key) if results is None else results[index])
        except Exception as error:  # noqa: BLE001 - reported to the one request
            raise_if_device_broken(error, what)
            fail(key, error)
