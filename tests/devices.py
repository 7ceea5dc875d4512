"""The devices a device-parametrized test runs on: ``cpu`` always, ``cuda`` where torch sees one
(skipped with the reason otherwise). Tests that take the :func:`device` fixture are marked
``device``; ``make gpu-check`` runs them on CUDA (``python -m benchmarks.gpu_check``)."""

from __future__ import annotations

import pytest
import torch

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device of :data:`DEVICES` in turn."""
    return request.param
