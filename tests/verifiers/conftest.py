"""Fixtures shared by the verifier tests (helpers live in :mod:`tests.verifiers.tiny_models`)."""

from __future__ import annotations

import pytest
import torch

from tests.verifiers.tiny_models import model_pair


@pytest.fixture(autouse=True, scope="session")
def _single_torch_thread():
    """The machine's cores are shared; the tiny tensors here gain nothing from threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def tiny_pair():
    """A factory ``tiny_pair(vocab, seed, **kwargs) -> (draft_fn, target_fn)`` of tiny
    context-dependent models (see :func:`tests.verifiers.tiny_models.model_pair`)."""
    return model_pair
