"""The model and forward paths on every device (``tests/devices.py``: cpu, and cuda where present).

A tiny random Llama built here (no download) with grouped-query attention (2 key/value heads for 4
query heads) and a real vocabulary size (32,000) runs through a
:class:`actors.model.backends.SlotBackend` on the device: the lean decoder's logits equal
transformers' own full forward of each context (two prompts in one forward, two draft chains in
one row, a one-row decode) and the model's own decoder over the same cache; a rejected draft's
columns are rewritten (KV rollback) and the next logits equal a fresh forward of the kept context.
On CPU the lean path's attention is two batched matmuls; on CUDA it is sdpa with grouped heads read
in place, which is what these tests reach there.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from actors.model.backends import SlotBackend
from actors.model.batch import chains_row, linear_row
from tests.devices import DEVICES

pytestmark = [pytest.mark.device, pytest.mark.parametrize("device", DEVICES)]

VOCAB = 32_000
#: float32: cached, batched attention vs one full forward differ by rounding only (test_lean_decoder's ATOL).
ATOL = 1e-4
#: bfloat16 against the full forward: test_lean_decoder's ATOL_BF16.
ATOL_BF16 = 2 ** -4


def gqa_llama(dtype: torch.dtype = torch.float32, device: str = "cpu", vocab: int = VOCAB) -> transformers.PreTrainedModel:
    """A random 2-layer Llama with 4 query heads over 2 key/value heads and ``vocab`` tokens, on ``device``."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=0, bos_token_id=1,
        pad_token_id=0, tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def _backend(model, device: str, lean_forward: bool = True) -> SlotBackend:
    return SlotBackend(model, device, 128, max_slots=4, scratch_columns=16, name="gqa-llama", lean_forward=lean_forward)


@torch.inference_mode()
def _full_logits(model, context: list[int]) -> torch.Tensor:
    """transformers' own forward of the whole context, no cache: ``[len(context), V]`` float32."""
    return model(torch.tensor([context], device=model.device)).logits[0].float()


def _prompts(count_lengths: tuple[int, ...] = (19, 7), seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (length,), generator=generator).tolist() for length in count_lengths]


def _served_logits(backend: SlotBackend, model, atol: float) -> list[torch.Tensor]:
    """Two prompts in one forward, two chains in one row, a one-row decode: each checked against the
    full forward on the device; returns every logits tensor (to compare two backends)."""
    prompts = _prompts()
    slots = [backend.allocate() for _ in prompts]
    prefill = backend.forward([linear_row(slot, 0, prompt, 0, range(len(prompt))) for slot, prompt in zip(slots, prompts)])
    for prompt, logits in zip(prompts, prefill):
        assert logits.device.type == torch.device(backend.device).type and logits.shape == (len(prompt), VOCAB)
        torch.testing.assert_close(logits, _full_logits(model, prompt), atol=atol, rtol=0)
    chains = _prompts((4, 4), seed=5)
    prompt = prompts[0]
    (chain_logits,) = backend.forward([chains_row(slots[0], len(prompt), chains, len(prompt), range(8))])
    for k, chain in enumerate(chains):
        expected = _full_logits(model, prompt + chain)[len(prompt):]  # [4, V]
        torch.testing.assert_close(chain_logits[4 * k: 4 * (k + 1)], expected, atol=atol, rtol=0)
    token = 123
    (step_logits,) = backend.forward([linear_row(slots[1], len(prompts[1]), [token], len(prompts[1]), [0])])
    torch.testing.assert_close(step_logits, _full_logits(model, prompts[1] + [token])[-1:], atol=atol, rtol=0)
    for slot in slots:
        backend.free(slot)
    return [*prefill, chain_logits, step_logits]


def test_the_lean_forward_equals_transformers_with_grouped_heads_and_a_real_vocabulary(device):
    model = gqa_llama(device=device)
    lean = _backend(model, device)
    assert lean.forward_path == "the lean decoder (llama)" and lean.grouped_attention
    served = _served_logits(lean, model, ATOL)
    model = gqa_llama(device=device)  # the same weights again (a backend takes its model's attention over)
    own = _backend(model, device, lean_forward=False)
    for got, expected in zip(served, _served_logits(own, model, ATOL)):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_the_lean_forward_in_bfloat16_equals_transformers_to_bf16_rounding(device):
    model = gqa_llama(torch.bfloat16, device)
    backend = _backend(model, device)
    assert backend.forward_path == "the lean decoder (llama)"  # its load-time check passed on the device
    _served_logits(backend, model, ATOL_BF16)


def test_a_rejected_draft_is_rolled_back_and_the_next_logits_equal_a_fresh_forward(device):
    """Draft tokens fed at the columns after the prompt, the last two rejected: the correction is fed
    at the first rejected column (its keys/values overwrite the draft's) and every later logits row
    equals the full forward of the kept context; the rejected tokens leave no trace."""
    model = gqa_llama(device=device)
    backend = _backend(model, device)
    (prompt,) = _prompts((11,))
    slot = backend.allocate()
    backend.forward([linear_row(slot, 0, prompt, 0, [len(prompt) - 1])])
    draft = [7, 8, 9, 10]
    backend.forward([linear_row(slot, len(prompt), draft, len(prompt), range(len(draft)))])
    kept = prompt + draft[:2]
    correction = [4242, 55]
    (logits,) = backend.forward([linear_row(slot, len(kept), correction, len(kept), range(len(correction)))])
    torch.testing.assert_close(logits, _full_logits(model, kept + correction)[len(kept):], atol=ATOL, rtol=0)
