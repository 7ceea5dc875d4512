"""The lean decoder forward has the model's own law: its logits equal transformers' own forward.

For every family the lean path covers (:data:`actors.model.lean_decoder.LEAN_FAMILIES`), the tiny
random models of the architecture matrix (``test_architectures.CONFIGS``: grouped key/value
heads, Qwen2's q/k/v biases and sliding layers, Qwen3's per-head norms, Mistral's window) run
through a :class:`actors.model.backends.SlotBackend` on the lean path: a prompt longer than the
window with a second session in the same forward, then two draft chains in one row; every kept
position's float32 logits equal the model's own full forward of that context (``ATOL``) and the
model's own decoder over the same cache (the backend with ``lean_forward=False``); the same in
bfloat16 (``ATOL_BF16``, the GEMMs in oneDNN's layout where the CPU has bf16 kernels). Families the
path does not cover run their own decoder; a variant the path does not reproduce is caught by
the load-time check and runs its own decoder, with a warning naming the model.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from actors.model.backends import SlotBackend
from actors.model.batch import RowWork, RunAttend, chains_row, linear_row
from actors.model.device_health import LEAN_FAILURES_IN_A_ROW
from actors.model.lean_decoder import LEAN_FAMILIES, ONEDNN_DTYPES, _rms_norm
from tests.actors.model.test_architectures import CONFIGS, WINDOW, _common

ATOL = 1e-4  # float32: cached, batched attention vs one full forward differ by rounding only
#: bfloat16: four units in the last place of a logit in [2, 4), two in [4, 8) (these models'
#: logits reach ~5; the model's own decoder over the cache already differs from its full forward
#: by up to 0.033, a bf16 rounding carried through the layers).
ATOL_BF16 = 2 ** -4
#: bfloat16, lean against the model's own decoder over the same cache: one unit in the last place
#: of a logit in [2, 4) (measured: equal, or 0.0005 apart).
ATOL_BF16_OWN = 2 ** -6
VOCAB = 96
LEAN_CASES = {"llama": "llama", "mistral": "mistral-sliding", "qwen2": "qwen2-sliding", "qwen3": "qwen3"}
OWN_DECODER_CASES = ["gpt2", "gemma2-sliding-softcap", "phi"]


def _model(case: str) -> transformers.PreTrainedModel:
    torch.manual_seed(sum(map(ord, case)))
    config = CONFIGS[case](_common(VOCAB, eos=0))
    config._attn_implementation = "eager" if case.startswith("gemma2") else "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _backend(model, lean_forward: bool) -> SlotBackend:
    return SlotBackend(model, "cpu", 64, max_slots=4, scratch_columns=16, name=type(model).__name__,
                       lean_forward=lean_forward)


@torch.inference_mode()
def _full_logits(model, context: list[int]) -> torch.Tensor:
    """transformers' own forward of the whole context, no cache: ``[len(context), V]``."""
    return model(torch.tensor([context])).logits[0].float()


def _rows_against_full_forward(backend: SlotBackend, model, atol: float = ATOL) -> list[torch.Tensor]:
    """Prefill two sessions in one forward, then two chains in one row; check every kept position
    against the model's full forward; return every logits tensor (to compare two backends)."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (length,), generator=generator).tolist() for length in (2 * WINDOW + 3, 7)]
    slots = [backend.allocate() for _ in prompts]
    prefill = backend.forward([linear_row(slot, 0, prompt, 0, range(len(prompt))) for slot, prompt in zip(slots, prompts)])
    for prompt, logits in zip(prompts, prefill):
        torch.testing.assert_close(logits, _full_logits(model, prompt), atol=atol, rtol=0)
    chains = [torch.randint(1, VOCAB, (4,), generator=generator).tolist() for _ in range(2)]
    prompt = prompts[0]
    (chain_logits,) = backend.forward([chains_row(slots[0], len(prompt), chains, len(prompt), range(8))])
    for k, chain in enumerate(chains):
        expected = _full_logits(model, prompt + chain)[len(prompt):]  # [4, V]
        torch.testing.assert_close(chain_logits[4 * k: 4 * (k + 1)], expected, atol=atol, rtol=0)
    token = int(torch.randint(1, VOCAB, (1,), generator=generator))  # one row of one token: a decode step
    (step_logits,) = backend.forward([linear_row(slots[1], len(prompts[1]), [token], len(prompts[1]), [0])])
    torch.testing.assert_close(step_logits, _full_logits(model, prompts[1] + [token])[-1:], atol=atol, rtol=0)
    for slot in slots:
        backend.free(slot)
    return [*prefill, chain_logits, step_logits]


def test_every_lean_family_is_tested():
    assert set(LEAN_CASES) == set(LEAN_FAMILIES)


@pytest.mark.parametrize("family", sorted(LEAN_CASES))
def test_lean_logits_equal_transformers(family):
    model = _model(LEAN_CASES[family])  # the same weights twice: a backend sets its model's attention
    reference = _rows_against_full_forward(_backend(_model(LEAN_CASES[family]), lean_forward=False), model)
    lean = _backend(model, lean_forward=True)
    assert lean.lean is not None, f"{family} should run the lean decoder"
    assert lean.forward_path == f"the lean decoder ({family})"
    for got, own in zip(_rows_against_full_forward(lean, model), reference):
        torch.testing.assert_close(got, own, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", sorted(LEAN_CASES))
def test_lean_bfloat16_logits_equal_transformers(family):
    """In bfloat16 the lean path (its GEMMs in oneDNN's layout where the CPU has bf16 kernels, the
    norms rounded as the model's own, attention as sdpa's kernel) gives the model's own decoder's logits over
    the same cache and its full forward's, to bf16 rounding; a decode row alone included."""
    model = _model(LEAN_CASES[family]).to(torch.bfloat16)
    reference = _rows_against_full_forward(_backend(_model(LEAN_CASES[family]).to(torch.bfloat16), lean_forward=False),
                                           model, ATOL_BF16)
    lean = _backend(model, lean_forward=True)
    assert lean.lean is not None, f"{family} should run the lean decoder in bfloat16"
    assert lean.lean.onednn == (torch.bfloat16 in ONEDNN_DTYPES)
    for got, own in zip(_rows_against_full_forward(lean, model, ATOL_BF16), reference):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, own, atol=ATOL_BF16_OWN, rtol=0)


def test_bfloat16_norm_rounds_as_the_model_own():
    """The lean RMSNorm in bfloat16 equals the model's own module bit for bit (normalized in
    float32, rounded, then times the weight), with and without a weight."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-6)
    norm.weight.data = 1 + 0.1 * torch.randn(64)
    norm = norm.to(torch.bfloat16)
    hidden = (3 * torch.randn(2, 5, 64)).to(torch.bfloat16)
    assert torch.equal(_rms_norm(hidden, norm.weight, 1e-6), norm(hidden))
    norm.weight.data.fill_(1)
    assert torch.equal(_rms_norm(hidden, None, 1e-6), norm(hidden))


@pytest.mark.parametrize("case", OWN_DECODER_CASES)
def test_other_families_run_their_own_decoder(case):
    model = _model(case)
    backend = _backend(model, lean_forward=True)
    assert backend.lean is None and backend.forward_path.startswith("its own decoder (")
    _rows_against_full_forward(backend, model)


def test_a_variant_the_lean_path_does_not_reproduce_runs_its_own_decoder(caplog):
    """A Llama whose first norm scales by (1 + weight), as Gemma's does: the load-time check sees the
    difference and the backend runs the model's own decoder, whose law the rows then follow."""
    model = _model("llama")
    norm = model.get_decoder().layers[0].input_layernorm
    original = norm.forward
    norm.forward = lambda hidden: original(hidden) * (1.0 + norm.weight) / norm.weight
    with caplog.at_level(logging.WARNING, logger="actors.model.lean_decoder"):
        backend = _backend(model, lean_forward=True)
    assert backend.lean is None and "differed" in backend.forward_path
    assert any("LlamaForCausalLM" in record.getMessage() and "differ" in record.getMessage()
               for record in caplog.records)
    _rows_against_full_forward(backend, model)


def test_a_failing_lean_forward_falls_back_to_the_model_own_decoder(caplog):
    """A lean forward that raises mid-step (its cause cannot be produced by a served model here, so
    the lean decoder is replaced by one that raises): the same step is served by the model's own
    decoder, with a warning naming the model, and so is every later step."""
    model = _model("llama")
    backend = _backend(model, lean_forward=True)

    def failing(*args, **kwargs):
        raise RuntimeError("unsupported shape")

    backend.lean = failing
    with caplog.at_level(logging.WARNING, logger="actors.model.backends"):
        _rows_against_full_forward(backend, model)
    assert backend.lean is None
    assert any("LlamaForCausalLM" in record.getMessage() and "unsupported shape" in record.getMessage()
               for record in caplog.records)


ONE_ROW_CASES = [family for family, case in sorted(LEAN_CASES.items()) if "sliding" not in case]


@pytest.mark.parametrize("family", ONE_ROW_CASES)
def test_a_row_alone_takes_the_one_row_forward_with_the_batched_logits(family, monkeypatch):
    """A forward of one causal row (a prefill, a decode token, a verification block, kept positions
    in and out of order, a draft's chained tokens past an uncommitted prefix) takes the one-row
    path (no batch built) and gives the batched path's
    logits and cache: the same weights on a backend with the path off, row for row, within
    float32 rounding, and the model's own full forward (``ATOL``)."""
    fast, batched = _backend(_model(LEAN_CASES[family]), True), _backend(_model(LEAN_CASES[family]), True)
    batched.one_row_forward = False
    taken = []
    original = SlotBackend._forward_run
    monkeypatch.setattr(SlotBackend, "_forward_run", lambda self, row: taken.append(len(row)) or original(self, row))
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(1, VOCAB, (11,), generator=generator).tolist()
    # (tokens, keep, chained): a chained token is a draft's next one, its row's prefix ending
    # before the chain's earlier tokens (fed, not committed: columns between prefix and token)
    steps = [(context, range(11), False), ([7], [0], False), ([3, 9, 4, 1, 2], [4, 0, 2], False),
             ([5, 6], [0, 1], False), ([8], [0], False), ([4], [0], True), ([6], [0], True), ([2, 3], [1], False)]
    slots = {backend: backend.allocate() for backend in (fast, batched)}
    done: list[int] = []
    committed = 0
    for tokens, keep, chained in steps:
        committed = committed if chained else len(done)
        start = len(done)
        attend = RunAttend([committed] * len(tokens), range(start + 1, start + len(tokens) + 1))
        (got,), (expected,) = (
            backend.forward([RowWork(slots[backend], committed, tuple(tokens), tuple(range(start, start + len(tokens))),
                                     tuple(range(start, start + len(tokens))), attend, tuple(keep))])
            for backend in (fast, batched))
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        full = _full_logits(fast.model, done + list(tokens))[len(done):]  # [L, V]
        torch.testing.assert_close(got, full[list(keep)], atol=ATOL, rtol=0)
        done += list(tokens)
    assert taken == [len(tokens) for tokens, _, _ in steps]
    length = len(done)
    torch.testing.assert_close(fast.cache.read_columns(slots[fast], range(length)),
                               batched.cache.read_columns(slots[batched], range(length)), atol=1e-6, rtol=0)


def test_a_failing_one_row_forward_is_counted_served_batched_and_tried_again(caplog, monkeypatch):
    """A one-row forward that raises (its cause cannot be produced here, so the path is replaced by
    one that raises): the same row is served by the batched path with the exact logits, with a
    warning naming the model, and counted; the next row alone tries the one-row path again; only
    ``LEAN_FAILURES_IN_A_ROW`` failures in a row drop the one-row path for good (an error log); the
    batched lean path goes on."""
    model = _model("llama")
    backend = _backend(model, lean_forward=True)
    calls = []

    def failing(self, row):
        calls.append(row)
        raise RuntimeError("unsupported shape")

    monkeypatch.setattr(SlotBackend, "_forward_run", failing)
    with caplog.at_level(logging.WARNING, logger="actors.model.backends"):
        _rows_against_full_forward(backend, model)
    assert len(calls) == 1 and backend.one_row_forward is True and backend.lean is not None
    assert backend.lean_failures.total == 1
    assert any("LlamaForCausalLM" in record.getMessage() and "one-row forward" in record.getMessage()
               for record in caplog.records)
    for _ in range(LEAN_FAILURES_IN_A_ROW - 1):
        _rows_against_full_forward(backend, model)
    assert len(calls) == LEAN_FAILURES_IN_A_ROW and backend.lean is not None and backend.one_row_forward is False
    assert backend.lean_failures.total == LEAN_FAILURES_IN_A_ROW
    assert any(record.levelno == logging.ERROR and "in a row" in record.getMessage() for record in caplog.records)
    _rows_against_full_forward(backend, model)  # every forward batched from now on: the same logits
    assert len(calls) == LEAN_FAILURES_IN_A_ROW


def test_a_failing_batched_lean_forward_is_counted_and_tried_again_until_it_fails_in_a_row(caplog, monkeypatch):
    """A lean decoder call that raises (replaced by one that raises: its cause cannot be produced
    here): that forward runs the model's own decoder with the exact logits and is counted; the lean
    decoder is tried again, and dropped only after ``LEAN_FAILURES_IN_A_ROW`` failures in a row."""
    model = _model("llama")
    backend = _backend(model, lean_forward=True)
    backend.one_row_forward = False  # every forward through the lean decoder call
    failures = iter([True, False, *[True] * LEAN_FAILURES_IN_A_ROW])
    lean_call = type(backend.lean).__call__

    def flaky(self, *args):
        if next(failures, False):
            raise RuntimeError("kernel refused")
        return lean_call(self, *args)

    monkeypatch.setattr(type(backend.lean), "__call__", flaky)
    with caplog.at_level(logging.WARNING, logger="actors.model.backends"):
        _rows_against_full_forward(backend, model)  # 3 forwards: failed, lean, failed
        assert backend.lean is not None and backend.lean_failures.total == 2
        _rows_against_full_forward(backend, model)  # failed twice more in a row: dropped
    assert backend.lean is None and backend.lean_failures.total == 1 + LEAN_FAILURES_IN_A_ROW
    assert backend.forward_path == "its own decoder (the lean decoder failed: RuntimeError)"
