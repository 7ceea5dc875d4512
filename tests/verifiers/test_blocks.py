"""verifiers/blocks.py: the verification steps both executors of needs run (the reference
executor and the serving engine). Many requests' blocks in one call give each the tokens of its
block verified alone; the result row becomes the Verified both executors return; a call that
cannot be shared is refused by name. (The exactness of the output law through these functions is
proven by the enumeration tests of the reference executor, which drive them.)"""

from __future__ import annotations

import pytest
import torch

from verifiers.blocks import block_inputs, block_key, verified_row, verify_blocks
from verifiers.registry import get_verifier
from verifiers.randomness import TorchRandomSource
from verifiers.sampling import token_logprob

VOCAB = 7


def _block(seed: int, num_drafts: int, gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random block: draft tokens [K, gamma] drawn from their rows, draft rows [K, gamma, V],
    target rows [K, gamma+1, V] (float64)."""
    generator = torch.Generator().manual_seed(seed)
    draft_probs = torch.rand(num_drafts, gamma, VOCAB, generator=generator, dtype=torch.float64) + 0.05
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    target_probs = torch.rand(num_drafts, gamma + 1, VOCAB, generator=generator, dtype=torch.float64) + 0.05
    target_probs /= target_probs.sum(-1, keepdim=True)
    tokens = torch.multinomial(draft_probs.reshape(-1, VOCAB), 1, generator=generator).reshape(num_drafts, gamma)
    return tokens, draft_probs, target_probs


def _source(seed: int) -> TorchRandomSource:
    return TorchRandomSource(torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("method", ["token", "block"])
def test_blocks_verified_together_get_the_tokens_each_gets_alone(method):
    spec = get_verifier(method)
    blocks = [block_inputs(spec, *_block(seed, 1, 4)) for seed in range(5)]
    keys = {block_key(method, spec, inputs) for inputs in blocks}
    assert keys == {(method, 4)}
    together = verify_blocks(spec, blocks, [_source(100 + b) for b in range(5)])
    for b, inputs in enumerate(blocks):
        alone = verify_blocks(spec, [inputs], [_source(100 + b)])
        assert verified_row(spec, inputs, together, b, 2) == verified_row(spec, inputs, alone, 0, 2)


def test_verified_row_takes_logprobs_from_the_chosen_draft_of_a_multi_draft_rule():
    spec = get_verifier("spectr")
    tokens, draft_probs, target_probs = _block(7, 3, 3)
    inputs = block_inputs(spec, tokens, draft_probs, target_probs)
    assert inputs[0].shape == (1, 3, 3) and block_key("spectr", spec, inputs) is None
    for seed in range(20):
        result = verify_blocks(spec, [inputs], [_source(seed)])
        verified = verified_row(spec, inputs, result, 0, 1)
        chosen = verified.draft_index
        assert chosen is not None and verified.num_accepted == len(verified.emitted) - 1
        assert verified.emitted[:-1] == tokens[chosen, : verified.num_accepted].tolist()
        assert verified.logprobs == [token_logprob(target_probs[chosen, j], t, 1) for j, t in enumerate(verified.emitted)]
    assert verified_row(spec, inputs, result, 0).logprobs is None


def test_a_call_that_cannot_be_shared_is_refused():
    block = get_verifier("block")
    inputs = block_inputs(block, *_block(1, 1, 2))
    with pytest.raises(ValueError, match="one source per block"):
        verify_blocks(block, [inputs, inputs], [_source(0)])
    with pytest.raises(ValueError, match="one source per block"):
        verify_blocks(block, [], [])
    spectr = get_verifier("spectr")
    multi = block_inputs(spectr, *_block(2, 2, 2))
    with pytest.raises(ValueError, match="stateless single-draft"):
        verify_blocks(spectr, [multi, multi], [_source(0), _source(1)])
