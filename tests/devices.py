"""The devices a device-parametrized test runs on: ``cpu`` always, ``cuda`` where torch sees one
(skipped with the reason otherwise). A module of such tests sets
``pytestmark = [pytest.mark.device, pytest.mark.parametrize("device", DEVICES)]``;
``make gpu-check`` runs the ``device`` tests on CUDA (``python -m benchmarks.gpu_check``)."""

from __future__ import annotations

import pytest
import torch

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
]

