"""The verification rules on every device (``tests/devices.py``: cpu, and cuda where present).

The rows live on the device and each rule's tensor work runs there; the exact enumeration's
scripted choices (:func:`verifiers.reference.exact.exact_law`) are made on the host and handed back
on the rows' device (:class:`OnDevice`), as a device's own random source would hand them. Laws
are exact (float64): token, block and greedy block on the paper's two-token example (10/9, 11/9,
12/9 accepted tokens), SpecTr and sequential GBV lossless at one position with two drafts, and a
32,000-token vocabulary verified whole.
"""

from __future__ import annotations

from collections.abc import Hashable
from fractions import Fraction

import pytest
import torch

from tests.devices import DEVICES
from tests.verifiers.tiny_models import expected_value_law
from verifiers.multi_draft.sequential_gbv import verify_sequential_gbv
from verifiers.multi_draft.spectr import verify_spectr
from verifiers.randomness import TorchRandomSource
from verifiers.reference.exact import exact_law
from verifiers.single_draft import verify_block, verify_greedy_block, verify_token

pytestmark = [pytest.mark.device, pytest.mark.parametrize("device", DEVICES)]

SINGLE = {"token": verify_token, "block": verify_block, "greedy_block": verify_greedy_block}
TARGET_ROW = [1 / 3, 2 / 3]  # the paper's two-token example (test_single_draft.py)
DRAFT_ROW = [2 / 3, 1 / 3]


class OnDevice:
    """A random source whose draws land on the device of the probabilities they were drawn from."""

    def __init__(self, source):
        self.source = source

    def bernoulli(self, prob: torch.Tensor) -> torch.Tensor:
        return self.source.bernoulli(prob.cpu() if isinstance(prob, torch.Tensor) else prob).to(_device_of(prob))

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        return self.source.categorical(probs.cpu()).to(probs.device)


def _device_of(value) -> torch.device:
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")


@pytest.mark.parametrize(("method", "expected"),
                         [("token", Fraction(10, 9)), ("block", Fraction(11, 9)), ("greedy_block", Fraction(12, 9))])
def test_single_draft_rules_accept_their_exact_expectation_on_the_device(device, method, expected):
    draft_row = torch.tensor(DRAFT_ROW, dtype=torch.float64, device=device)
    target_row = torch.tensor(TARGET_ROW, dtype=torch.float64, device=device)
    gamma = 2

    def procedure(scripted) -> int:
        source = OnDevice(scripted)
        draft = torch.stack([source.categorical(draft_row) for _ in range(gamma)])  # [gamma]
        result = SINGLE[method](draft[None], draft_row.expand(1, gamma, -1), target_row.expand(1, gamma + 1, -1),
                                generator=source)
        assert result.num_accepted.device.type == torch.device(device).type
        return int(result.num_accepted[0])

    assert expected_value_law(exact_law(procedure), float) == pytest.approx(float(expected), abs=1e-12)


@pytest.mark.parametrize("verify", [verify_spectr, verify_sequential_gbv], ids=["spectr", "sequential_gbv"])
def test_multi_draft_rules_emit_the_target_law_on_the_device(device, verify):
    """gamma = 1, two drafts from (0.7, 0.3) against the target (0.4, 0.6): the first emitted
    token's exact law is the target's."""
    draft_row = torch.tensor([0.7, 0.3], dtype=torch.float64, device=device)
    target_row = torch.tensor([0.4, 0.6], dtype=torch.float64, device=device)

    def procedure(scripted) -> Hashable:
        source = OnDevice(scripted)
        tokens = source.categorical(draft_row.expand(2, -1))[:, None]  # [K, gamma]
        result = verify(tokens[None], draft_row.expand(2, 1, -1)[None], target_row.expand(2, 2, -1)[None],
                        generator=source)
        return tuple(result.emitted(0))[0]

    law = exact_law(procedure)
    assert law[0] == pytest.approx(0.4, abs=1e-12) and law[1] == pytest.approx(0.6, abs=1e-12)


@pytest.mark.parametrize("method", sorted(SINGLE))
def test_a_real_vocabulary_is_verified_whole_on_the_device(device, method):
    """V = 32,000, gamma 4: draft rows equal to the target rows accept the whole block, and the bonus
    token is one the target row can emit."""
    vocab, gamma = 32_000, 4
    generator = torch.Generator().manual_seed(7)
    rows = torch.rand(1, gamma + 1, vocab, generator=generator, dtype=torch.float64)
    rows[..., ::3] = 0.0  # a third of the vocabulary out of the target's support
    rows = (rows / rows.sum(-1, keepdim=True)).to(device)  # [1, gamma + 1, V]
    source = OnDevice(TorchRandomSource(torch.Generator().manual_seed(11)))
    draft = source.categorical(rows[:, :gamma])  # [1, gamma]
    result = SINGLE[method](draft, rows[:, :gamma], rows, generator=source)
    emitted = list(result.emitted(0))
    assert int(result.num_accepted[0]) == gamma and emitted[:gamma] == draft[0].tolist()
    assert len(emitted) == gamma + 1 and emitted[-1] % 3 != 0
