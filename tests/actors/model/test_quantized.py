"""A weight-only quantized copy of a model (actors/model/quantized.py) as a draft.

* Each quantized linear computes the float linear within its quantization error bound
  (half a step per weight, bfloat16 rounding inside the kernel).
* Every linear of the copy is quantized; the embedded target's copies give rows close to its own;
  loaded through ``SlotBackend.load(quantization=...)`` a copy's slot-cache forward equals its
  own full forward.
* Exact enumeration (float64, TV < 1e-9): a tiny Llama's quantized copy as the draft of the float
  model, through the reference decode loop (the state machine the engine drives), emits the
  float model's law under token, block and greedy block verification (and SpecTr over two
  drafts); handed the draft's rows as the target's, the same harness finds the draft's law
  instead (the negative control).
* The engine (production Coordinator and ModelWorkers in this process, no Ray): a deployment
  whose draft is an int8 copy of its target generates, and greedy sd (token, block, greedy block)
  and multi_draft equal ar, greedy se with the copy as its proposer equals the plain ensemble.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from actors.model.quantized import (
    INT4_GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    QuantizationError,
    W8A8Linear,
    check_quantization,
    linear_error_bound,
    quantize_linear,
    quantize_model,
)
from tests.verifiers.tiny_models import causal_lm_fn, speculative_law, target_law
from verifiers.reference.exact import total_variation

EXACT_TOLERANCE = 1e-9
SNIPPET = (
    "import os\nimport sys\n\n\ndef list_files(root):\n    \"\"\"Return the files under root, sorted.\"\"\"\n"
    "    result = []\n    for directory, _, names in os.walk(root):\n        for name in names:\n"
    "            result.append(os.path.join(directory, name))\n    return sorted(result)\n\n\n"
    "def main(argv=None):\n    for path in list_files(argv[0] if argv else '.'):\n        print(path)\n"
)
SINGLE_DRAFT = ["token", "block", "greedy_block"]


def _linear(out_features: int, in_features: int, *, bias: bool, dtype: torch.dtype = torch.float32,
            seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)


KINDS = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(48, 64, False), (37, 96, True), (300, 128, False)])
@pytest.mark.parametrize("rows", [1, 16])
def test_quantized_linear_is_within_its_error_bound(quantization, out_features, in_features, bias, rows):
    linear = _linear(out_features, in_features, bias=bias, seed=out_features)
    module = quantize_linear(linear, quantization)
    assert type(module) is KINDS[quantization]
    inputs = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))  # [rows, in]
    with torch.no_grad():
        expected = F.linear(inputs.double(), linear.weight.double(),
                            None if linear.bias is None else linear.bias.double())  # [rows, out]
        got = module(inputs)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    error = (got.double() - expected).abs()
    bound = linear_error_bound(inputs, module, linear.weight.detach())
    assert (error <= bound).all(), float((error - bound).max())
    # And close in norm: int8 ~ 1/127 of a row's range per weight, int4 ~ 1/15 of a group's; w8a8 the
    # int8 weights and ~1/255 of a row's range per activation.
    assert float(error.norm() / expected.norm()) < {"int8": 0.01, "int4": 0.12, "w8a8": 0.02}[quantization]


def test_w8a8_quantizes_each_row_on_its_own_grid():
    """Rows 1000x apart in size: each gives what it gives in any other batch and alone (its own grid,
    whatever its neighbours), so a draft's rows do not depend on the rows batched with them."""
    linear = _linear(32, 64, bias=True)
    module = quantize_linear(linear, "w8a8")
    inputs = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)) * torch.tensor([[1000.0], [1.0], [-3.0]])  # [3, in]
    with torch.no_grad():
        together, expected = module(inputs), F.linear(inputs, linear.weight, linear.bias)  # [3, out]
        assert torch.equal(together[1:], module(inputs[1:]))
        assert torch.equal(together[::2], module(inputs[::2]))
        for row in range(3):
            alone = module(inputs[row : row + 1])  # [1, out]
            assert torch.equal(alone[0], together[row]), row
            assert float((alone[0] - expected[row]).norm() / expected[row].norm()) < 0.02, row


def test_quantized_linear_keeps_leading_dims_and_dtype():
    linear = _linear(32, 64, bias=True, dtype=torch.bfloat16)
    for quantization in ("int8", "int4", "w8a8"):
        module = quantize_linear(linear, quantization)
        inputs = torch.randn(2, 3, 64, dtype=torch.bfloat16)  # [B, L, in]
        with torch.no_grad():
            out = module(inputs)
        assert out.shape == (2, 3, 32) and out.dtype == torch.bfloat16
        assert torch.allclose(out.float(), linear(inputs).float(), atol=0.1, rtol=0.1)


def test_int4_falls_back_to_int8_where_the_inputs_are_not_whole_groups():
    linear = _linear(32, INT4_GROUP_SIZE + 8, bias=False)
    assert type(quantize_linear(linear, "int4")) is Int8Linear


def test_int4_pads_its_output_rows_to_the_kernels_multiple():
    linear = _linear(5, 64, bias=False)
    module = quantize_linear(linear, "int4")
    assert module.weight_int4.shape[0] == 16
    with torch.no_grad():
        assert module(torch.randn(4, 64)).shape == (4, 5)


def test_bad_quantizations_are_refused_naming_the_field():
    with pytest.raises(QuantizationError, match=r"quantization: unknown quantization 'int3'.*'int8', 'int4', 'w8a8'"):
        check_quantization("int3")
    with pytest.raises(QuantizationError, match="float64"):
        check_quantization("int8", torch.float64)
    check_quantization(None, torch.float64)  # unset: nothing to check


# ---------------------------------------------------------------------------------- tiny models
def _tiny_llama(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _quantized_copy(model, quantization: str):
    import copy

    clone = copy.deepcopy(model)
    quantize_model(clone, quantization)
    return clone


def test_every_linear_of_the_copy_is_quantized():
    copy = _quantized_copy(_tiny_llama(256, seed=3), "int4")
    assert not any(type(module) is torch.nn.Linear for module in copy.modules())
    assert sum(type(module) is Int4Linear for module in copy.modules()) == 2 * 7 + 1  # 7 per layer, the head
    assert type(copy.get_input_embeddings()) is torch.nn.Embedding


@pytest.fixture(scope="module")
def embedded_target():
    from transformers import AutoModelForCausalLM

    from models import embedded_model_path

    return AutoModelForCausalLM.from_pretrained(embedded_model_path("target"), dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


@pytest.mark.parametrize(("quantization", "max_mean_tv"), [("int8", 0.01), ("int4", 0.05)])
def test_the_quantized_copy_gives_rows_close_to_the_embedded_target(embedded_target, quantization, max_mean_tv):
    """The embedded target (a trained model) and its copy over the tokens of a Python snippet:
    measured mean total variation 0.003 (int8) and 0.02 (int4)."""
    from transformers import AutoTokenizer

    from models import embedded_model_path

    copy = _quantized_copy(embedded_target, quantization)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("target"))
    ids = torch.tensor([tokenizer(SNIPPET)["input_ids"][:64]])  # [1, L]
    with torch.no_grad():
        expected = embedded_target(ids).logits.double().softmax(-1)  # [1, L, V]
        got = copy(ids).logits.double().softmax(-1)
    tv = 0.5 * (expected - got).abs().sum(-1)  # [1, L]
    assert 0.0 < float(tv.mean()) < max_mean_tv, float(tv.mean())
    assert float((expected.argmax(-1) == got.argmax(-1)).double().mean()) >= 0.9


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("quantized") / "target"
    _tiny_llama(96, seed=5).save_pretrained(path)
    return path


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
def test_slot_backend_loads_a_quantized_copy_and_its_cache_forward_is_its_own(tiny_checkpoint, quantization):
    from actors.model.backends import SlotBackend
    from actors.model.batch import linear_row

    backend = SlotBackend.load(str(tiny_checkpoint), dtype="float32", max_slots=2, scratch_columns=8,
                               quantization=quantization)
    assert backend.lean is not None and f"weight-only {quantization}" in backend.forward_path  # the lean decoder
    assert backend.lm_head is backend.model.get_output_embeddings() and type(backend.lm_head) is not torch.nn.Linear
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    slot = backend.allocate()
    prefill = backend.forward([linear_row(slot, 0, tokens[:9], 0, list(range(9)))])[0]  # [9, V]
    step = backend.forward([linear_row(slot, 9, tokens[9:], 9, [0, 1, 2])])[0]  # [3, V]
    with torch.no_grad():  # the model's own decoder over its quantized linears: the same products, packed
        full = backend.model(torch.tensor([tokens])).logits[0].float()  # [12, V]
    assert torch.allclose(torch.cat([prefill, step]), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
def test_a_copy_of_a_loaded_model_is_built_from_its_weights_and_leaves_it_alone(tiny_checkpoint, quantization):
    """Loaded after its target in one process (a draft sharing its target's worker), the copy reads
    no checkpoint: the target's model object, its own quantized GEMMs in the lean decoder; its rows
    are those of a copy loaded alone, and the target's rows do not change."""
    from actors.model import backends
    from actors.model.backends import SlotBackend
    from actors.model.batch import linear_row

    backends._LOADED_MODELS.clear()  # what earlier tests loaded
    alone = SlotBackend.load(str(tiny_checkpoint), dtype="float32", max_slots=2, scratch_columns=8,
                             quantization=quantization)
    target = SlotBackend.load(str(tiny_checkpoint), dtype="float32", max_slots=2, scratch_columns=8)
    tokens = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(2)).tolist()

    def rows(backend):
        slot = backend.allocate()
        try:
            return backend.forward([linear_row(slot, 0, tokens, 0, list(range(len(tokens))))])[0]  # [L, V]
        finally:
            backend.free(slot)

    before = rows(target)
    copy = SlotBackend.load(str(tiny_checkpoint), dtype="float32", max_slots=2, scratch_columns=8,
                            quantization=quantization)
    assert copy.model is target.model and copy.lean is not None and copy.lean is not target.lean
    assert alone.model is not target.model
    assert f"weight-only {quantization}" in copy.forward_path
    assert torch.equal(rows(target), before)
    assert torch.allclose(rows(copy), rows(alone), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(rows(copy), before, atol=1e-4, rtol=1e-4)  # quantized: not the target's rows


def test_a_w8a8_copy_of_a_bf16_model_computes_and_caches_in_float32(tmp_path):
    """fbgemm's kernel takes and gives float32: a w8a8 copy of a bfloat16 model runs its lean decoder
    and holds its KV cache in float32 (no conversion around each GEMM); the target stays bf16, the
    int4 copy too; the copy's cache forward equals its own one-shot forward."""
    from actors.model import backends
    from actors.model.backends import SlotBackend
    from actors.model.batch import linear_row

    backends._LOADED_MODELS.clear()
    path = tmp_path / "bf16"
    _tiny_llama(96, seed=6).to(torch.bfloat16).save_pretrained(path)
    options = dict(dtype="bfloat16", max_slots=2, scratch_columns=8)
    target = SlotBackend.load(str(path), **options)
    copy = SlotBackend.load(str(path), quantization="w8a8", **options)
    int4 = SlotBackend.load(str(path), quantization="int4", **options)
    assert copy.model is target.model and copy.lean is not None and copy.lean.dtype == torch.float32
    assert copy.kv_dtype == copy.cache.dtype == torch.float32
    assert target.kv_dtype == target.cache.dtype == int4.kv_dtype == torch.bfloat16
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3)).tolist()

    def rows(backend, splits):
        slot, out, start = backend.allocate(), [], 0
        for end in splits:
            out.append(backend.forward([linear_row(slot, start, tokens[start:end], start, list(range(end - start)))])[0])
            start = end
        backend.free(slot)
        return torch.cat(out)  # [12, V]

    stepwise, whole = rows(copy, (9, 10, 12)), rows(copy, (12,))
    assert torch.allclose(stepwise, whole, atol=1e-5, rtol=1e-5)  # the same rows, row 9 alone too: per-row grids
    expected = rows(target, (12,)).double().softmax(-1)
    assert float(0.5 * (stepwise.double().softmax(-1) - expected).abs().sum(-1).max()) < 0.1  # near the target's (0.05 measured)


def test_a_quantized_copy_on_a_gpu_or_in_float64_is_refused(tiny_checkpoint):
    from actors.model.backends import SlotBackend

    with pytest.raises(QuantizationError, match="float64"):
        quantize_model(_tiny_llama(32, seed=0).double(), "int8")
    with pytest.raises(QuantizationError, match="unknown quantization 'fp8'"):
        SlotBackend.load(str(tiny_checkpoint), dtype="float32", max_slots=1, quantization="fp8")


# ---------------------------------------------------------------------------------- exact law
#: Exact enumeration over a real model: top-k 2 keeps the choice tree small (2 tokens per row).
LAW_TOP_K, LAW_TOKENS, LAW_GAMMA = 2, 3, 2
PROMPT = (3, 7)


@pytest.fixture(scope="module")
def exact_pair():
    """(float rows, int4 rows, int8 rows, w8a8 rows) of one tiny Llama, as the reference loop's model functions."""
    model = _tiny_llama(16, seed=11)
    return causal_lm_fn(model), *(causal_lm_fn(_quantized_copy(model, kind)) for kind in ("int4", "int8", "w8a8"))


@pytest.mark.parametrize("quantization", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_the_quantized_copy_as_draft_is_exact(exact_pair, quantization, method):
    target_fn, *copies = exact_pair
    draft_fn = copies[("int4", "int8", "w8a8").index(quantization)]
    law = speculative_law(draft_fn, target_fn, PROMPT, LAW_TOKENS, gamma=LAW_GAMMA, method=method, top_k=LAW_TOP_K)
    assert total_variation(law, target_law(target_fn, PROMPT, LAW_TOKENS, top_k=LAW_TOP_K)) < EXACT_TOLERANCE


def test_two_quantized_drafts_are_exact_under_multi_draft_verification(exact_pair):
    """Multi-draft (SpecTr K-SEQ, K = 2 i.i.d. drafts of the int8 copy): the float model's law."""
    target_fn, _, int8_fn, _ = exact_pair
    law = speculative_law(int8_fn, target_fn, PROMPT, 2, gamma=LAW_GAMMA, method="spectr", num_drafts=2, top_k=LAW_TOP_K)
    assert total_variation(law, target_law(target_fn, PROMPT, 2, top_k=LAW_TOP_K)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_negative_control_the_verifier_handed_the_drafts_rows_as_the_targets(exact_pair, method):
    """The harness sees a wrong law: verifying against the int4 copy's own rows emits its law,
    which is measurably not the model's."""
    target_fn, int4_fn, _, _ = exact_pair
    law = speculative_law(int4_fn, int4_fn, PROMPT, LAW_TOKENS, gamma=LAW_GAMMA, method=method, top_k=LAW_TOP_K)
    expected = target_law(target_fn, PROMPT, LAW_TOKENS, top_k=LAW_TOP_K)
    assert total_variation(law, target_law(int4_fn, PROMPT, LAW_TOKENS, top_k=LAW_TOP_K)) < EXACT_TOLERANCE
    assert total_variation(law, expected) > 1e-4


# ---------------------------------------------------------------------------------- the engine
def test_a_deployment_with_a_quantized_self_draft_generates(tiny_checkpoints):
    """No Ray: the production Coordinator and ModelWorkers in this process over the tiny target, its
    int8 copy as the draft and a partner. Greedy sd / multi_draft equal ar; greedy se with the copy
    as its proposer equals the plain ensemble; sampled sd generates the tokens asked for."""
    from actors.request_schema import GenerationRequest
    from benchmarks.served.runners import LocalRunner
    from cluster.config import parse_app_args

    target = str(tiny_checkpoints["target"])
    runner = LocalRunner(parse_app_args({
        "models": {"target": {"path": target, "role": "target"},
                   "draft": {"path": target, "role": "draft", "quantization": "int8"},
                   "partner": {"path": str(tiny_checkpoints["partner"]), "role": "member"}},
        "defaults": {"strategy": "sd", "method": "block", "gamma": 4, "members": ["target", "partner"],
                     "proposers": {"se": "draft"}},
        "resources": {"torch_threads": 1},
        "engine": {"goodput_gamma": False}}), temperature=1.0)
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    cases = {"ar": {"strategy": "ar"},
             **{f"sd-{method}": {"strategy": "sd", "method": method, "gamma": 3} for method in SINGLE_DRAFT},
             "multi_draft": {"strategy": "multi_draft", "method": "spectr", "gamma": 3, "num_drafts": 2},
             "ensemble": {"strategy": "ensemble"}, "se": {"strategy": "se", "method": "block", "proposer": "draft"}}
    requests = [GenerationRequest(request_id=case, prompt="def main(", speculation=speculation, sampling=greedy)
                for case, speculation in cases.items()]
    requests.append(GenerationRequest(request_id="sampled", prompt="def main(", speculation={"strategy": "sd"},
                                      sampling={"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, "seed": 1}))

    async def one(request):
        chunks = [chunk async for chunk in runner.coordinator.generate(request)]
        assert chunks[-1].error is None, chunks[-1].error
        return [t for chunk in chunks for t in chunk.token_ids], chunks[-1].stats

    async def run_all():
        import asyncio

        return await asyncio.gather(*(one(request) for request in requests))

    try:
        results = dict(zip([r.request_id for r in requests], runner.loop.run_until_complete(run_all())))
        infos = {name: handle._instance.info() for name, handle in runner.workers.items()}
    finally:
        runner.close()
    assert "weight-only int8" in infos["draft"].forward_path
    assert infos["draft"].tokenizer == infos["target"].tokenizer
    for case in ("sd-token", "sd-block", "sd-greedy_block", "multi_draft"):
        assert results[case][0] == results["ar"][0], case
        assert results[case][1].model_calls.get("draft", 0) > 0, case
    assert results["se"][0] == results["ensemble"][0]
    assert results["se"][1].proposer == "draft"
    tokens, stats = results["sampled"]
    assert len(tokens) == 12 and stats.block_efficiency > 1.0
