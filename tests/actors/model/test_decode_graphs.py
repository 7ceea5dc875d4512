"""``engine.cuda_graphs``: the fixed-shape decode forward a CUDA graph records has the eager law.

:class:`actors.model.decode_graphs.FixedDecode` (attention over every column of the slot under a
mask, the column a device tensor) runs on every device: its logits and the keys/values it writes
equal the eager one-row forward's step after step. Where CUDA is present, the recorded graphs'
replays equal the eager forward too (one graph for every slot). On CPU the switch is ignored with a
warning naming the model, and the forward is the eager one.
"""

from __future__ import annotations

import logging

import pytest
import torch

from actors.model.batch import linear_row
from actors.model.decode_graphs import FixedDecode
from cluster.config import parse_app_args
from tests.actors.model.test_devices import _backend, gqa_llama
from tests.devices import DEVICES

#: The fixed-shape forward reads more (masked) columns: the same products, summed over zeros too.
ATOL = 1e-5
VOCAB = 512


def _decode_steps(backend, steps: int = 5, slots: int = 2) -> list[tuple[int, list[torch.Tensor]]]:
    """Prefill ``slots`` prompts, then ``steps`` one-token decode rows per slot -> (slot, each step's logits)."""
    done = []
    for index in range(slots):
        prompt = [3 + index, 17, 42, 99, 7 + index]
        slot = backend.allocate()
        backend.forward([linear_row(slot, 0, prompt, 0, [len(prompt) - 1])])
        logits = []
        for step in range(steps):
            column = len(prompt) + step
            logits.append(backend.forward([linear_row(slot, column, [11 * step + index + 2], column, [0])])[0])
        done.append((slot, logits))
    return done


@pytest.mark.device
@pytest.mark.parametrize("device", DEVICES)
def test_the_fixed_shape_decode_has_the_eager_logits_and_writes(device, monkeypatch):
    eager = _backend(gqa_llama(device=device, vocab=VOCAB), device)
    fixed = _backend(gqa_llama(device=device, vocab=VOCAB), device)
    body, eager_run = FixedDecode(fixed), fixed._forward_run

    def run(self, row):
        if not FixedDecode.covers(row):  # the prompt: eager
            return eager_run(row)
        body.set_inputs(row)
        return body.compute()

    monkeypatch.setattr(fixed, "_forward_run", run.__get__(fixed))
    for (slot, expected), (other_slot, got) in zip(_decode_steps(eager), _decode_steps(fixed)):
        assert slot == other_slot
        for want, have in zip(expected, got):
            torch.testing.assert_close(have, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(fixed.cache.read_columns(slot, range(10)), eager.cache.read_columns(slot, range(10)),
                                   atol=ATOL, rtol=0)


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_recorded_cuda_graphs_replay_the_eager_logits():
    device = "cuda"
    eager = _backend(gqa_llama(device=device, vocab=VOCAB), device)
    model = gqa_llama(device=device, vocab=VOCAB)
    from actors.model.backends import SlotBackend

    graphed = SlotBackend(model, device, 128, max_slots=4, scratch_columns=16, name="gqa-llama", cuda_graphs=True)
    assert graphed.decode_graphs is not None
    for (_, expected), (_, got) in zip(_decode_steps(eager), _decode_steps(graphed)):
        for want, have in zip(expected, got):
            torch.testing.assert_close(have, want, atol=ATOL, rtol=0)
    assert graphed.decode_graphs.graph is not None  # one graph for every slot, replayed for the later steps


def test_cuda_graphs_on_a_cpu_are_ignored_with_a_warning(caplog):
    from actors.model.backends import SlotBackend

    model = gqa_llama(vocab=VOCAB)
    with caplog.at_level(logging.WARNING, logger="actors.model.decode_graphs"):
        backend = SlotBackend(model, "cpu", 128, max_slots=4, scratch_columns=16, name="gqa-llama", cuda_graphs=True)
    assert backend.decode_graphs is None
    assert any("gqa-llama" in r.getMessage() and "CUDA graphs need a CUDA device" in r.getMessage() for r in caplog.records)
    eager = _backend(gqa_llama(vocab=VOCAB), "cpu")
    for (_, expected), (_, got) in zip(_decode_steps(eager), _decode_steps(backend)):
        for want, have in zip(expected, got):
            torch.testing.assert_close(have, want, atol=0, rtol=0)


def test_a_graph_that_cannot_be_recorded_is_logged_and_the_decode_runs_eagerly(caplog):
    """Recording fails (here: no CUDA at all, so the capture itself raises): an error log naming the
    model, the same logits from the eager forward, and no further attempt."""
    from actors.model.decode_graphs import DecodeGraphs

    backend = _backend(gqa_llama(vocab=VOCAB), "cpu")
    backend.decode_graphs = DecodeGraphs(backend)  # what engine.cuda_graphs builds on a GPU
    eager = _backend(gqa_llama(vocab=VOCAB), "cpu")
    with caplog.at_level(logging.ERROR, logger="actors.model.decode_graphs"):
        for (_, expected), (_, got) in zip(_decode_steps(eager), _decode_steps(backend)):
            for want, have in zip(expected, got):
                torch.testing.assert_close(have, want, atol=0, rtol=0)
    assert backend.decode_graphs.failed and backend.decode_graphs.graph is None
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.ERROR] == ["gqa-llama"]
    assert backend.lean_failures.total == 0


def test_the_switch_reaches_every_model_worker_and_is_off_by_default(tiny_checkpoints):
    args = {"models": {"target": {"path": str(tiny_checkpoints["target"]), "role": "target"}}, "defaults": {"strategy": "ar"}}
    assert not any(spec.cuda_graphs for spec in parse_app_args(args).freeze().models)
    frozen = parse_app_args({**args, "engine": {"cuda_graphs": True}}).freeze()
    assert all(spec.cuda_graphs for spec in frozen.models)
