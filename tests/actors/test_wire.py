"""actors/wire.py: tensors cross pickling as numpy arrays and come back equal."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from actors.messages import CallTiming, ItemOutcome
from verifiers.machines.needs import MemberBlock, PreDrafted, Sampled
from actors.wire import pickle_through_wire, to_wire


def _round_trip_out_of_band(value):
    """Pickle with protocol 5 and out-of-band buffers, read back from read-only memory, as Ray's
    zero-copy deserialization hands them over."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    read_only = [memoryview(bytes(buffer.raw())) for buffer in buffers]
    return pickle.loads(data, buffers=read_only), len(buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool])
def test_a_sampled_payload_comes_back_equal_through_out_of_band_buffers(dtype):
    logits = (torch.randn(2, 3, 7) * 5).to(dtype)
    sampled = Sampled(torch.tensor([[1, 2, 3], [4, 5, 6]]), logits)
    back, buffers = _round_trip_out_of_band(sampled)
    assert buffers == 2  # both tensors travelled as numpy buffers, not through torch's storage pickling
    assert isinstance(back, Sampled) and back.logprobs is None
    assert back.tokens.dtype == torch.int64 and torch.equal(back.tokens, sampled.tokens)
    assert back.logits.dtype == dtype and torch.equal(back.logits, logits)
    back.logits.add_(1) if dtype != torch.bool else back.logits.logical_not_()  # writable: copied off the read-only buffer
    assert not torch.equal(back.logits, logits)


def test_every_wired_type_and_an_outcome_holding_a_bare_tensor_round_trip():
    values = [
        PreDrafted([3, 1], torch.tensor([[1, 2], [3, 4]]), torch.randn(2, 2, 5)),
        MemberBlock(queued_logits=torch.randn(2, 5), tokens=torch.tensor([4]), token_logits=torch.randn(1, 5)),
        ItemOutcome(value=torch.randn(9), timing=CallTiming(forward_s=0.5, forward_calls=2), prompt_logits=torch.randn(3, 9)),
        ItemOutcome(error="boom", retryable=True),
    ]
    for value in values:
        back = pickle.loads(pickle.dumps(value))
        assert type(back) is type(value)
        for name in vars(value) if not hasattr(value, "__dataclass_fields__") else value.__dataclass_fields__:
            mine, theirs = getattr(value, name), getattr(back, name)
            if isinstance(mine, torch.Tensor):
                assert torch.equal(mine, theirs) and mine.dtype == theirs.dtype
            else:
                assert mine == theirs


def test_tensors_numpy_cannot_hold_keep_torchs_pickling():
    bf16 = torch.randn(3).to(torch.bfloat16)
    grad = torch.randn(3, requires_grad=True)
    meta = torch.empty(3, device="meta")
    for tensor in (bf16, grad, meta):
        assert to_wire(tensor) is tensor
    back = pickle.loads(pickle.dumps(Sampled(torch.tensor([[1]]), bf16)))
    assert back.logits.dtype == torch.bfloat16 and torch.equal(back.logits, bf16)
    assert to_wire(np.zeros(2)) is not None and isinstance(to_wire(np.zeros(2)), np.ndarray)  # arrays stay arrays


def test_only_dataclasses_are_registered():
    with pytest.raises(TypeError):
        pickle_through_wire(dict)
