"""Every served architecture equals transformers' own model; everything else is refused at load.

Tiny random models of each allow-listed family (:data:`actors.model.architectures.FAMILIES`) are built
from their config classes (nothing downloaded), saved with the suite's small tokenizer and loaded
by a :class:`actors.worker.model_worker.ModelWorker` in-process. For each:

* the worker's rows (a prompt longer than any sliding window, two draft chains in one row, a
  session continuing after the second chain is accepted, a second session in the same forwards)
  equal the model's own full forward (float32, ``ATOL``);
* greedy decoding through the worker equals ``model.generate(do_sample=False)``;
* through the production coordinator in this process, with two perturbed copies as draft and
  ensemble member: greedy ``sd`` (block, token, greedy block) and ``multi_draft`` equal ``ar``,
  greedy ``se`` equals the plain ensemble, whose tokens are the argmax of the weighted ensemble of
  the two models' full-forward logits, and sampled ``sd`` follows the model's law (chi-square).

Through the real coordinator (Ray): a Qwen2 pair padded differently past the tokenizer, and
Gemma 2 (eager, sliding, soft-capped) with a perturbed draft: ``ar``, ``sd`` (and
``multi_draft``) give the target's greedy output; sampled ``sd`` on Gemma 2 follows the target's
law (chi-square). Refused configs are checked for their error text.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers

from actors.model.architectures import FAMILIES, UnsupportedModelError, resolve_architecture
from actors.messages import OpenSession, RowSampling, WorkItem
from actors.worker.model_worker import ModelWorker
from cluster.config import ModelSpec
from tests.conftest import _build_tokenizer
from verifiers.machines.needs import Sample

ATOL = 1e-4  # float32: cached, batched attention vs one full forward differ by rounding only
WINDOW = 8  # sliding window of the tiny models: every prompt here is longer
CONTEXT = 128
GREEDY_TOKENS = 12
CHAIN = WINDOW + 2  # draft chain length
SOFTCAP_ATTENTION, SOFTCAP_FINAL = 2.0, 3.0  # small caps, so that capping changes the logits here
PROMPT_TEXT = "def main(argv=None):\n    parser = argparse.ArgumentParser(description='tool')\n"


def _common(vocab_size: int, eos: int) -> dict:
    """Sizes shared by every tiny config (the few families that name them differently map below)."""
    return dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                initializer_range=0.2, tie_word_embeddings=False,
                bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)


def _gpt2(common: dict) -> transformers.PretrainedConfig:
    return transformers.GPT2Config(vocab_size=common["vocab_size"], n_embd=32, n_layer=2, n_head=4,
                                   n_positions=CONTEXT, initializer_range=0.2, bos_token_id=common["eos_token_id"],
                                   eos_token_id=common["eos_token_id"])


def _gpt_neox(common: dict) -> transformers.PretrainedConfig:
    keep = {k: common[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "max_position_embeddings", "initializer_range",
                                   "tie_word_embeddings", "bos_token_id", "eos_token_id")}
    return transformers.GPTNeoXConfig(**keep, rotary_pct=0.5)


def _opt(common: dict) -> transformers.PretrainedConfig:
    return transformers.OPTConfig(vocab_size=common["vocab_size"], hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=CONTEXT, init_std=0.2,
                                  word_embed_proj_dim=32, bos_token_id=common["eos_token_id"],
                                  eos_token_id=common["eos_token_id"], pad_token_id=common["eos_token_id"])


def _moe(common: dict) -> dict:
    return dict(common, num_local_experts=4, num_experts_per_tok=2)


#: name -> config builder over the common sizes. Sliding models get WINDOW, shorter than the prompts.
CONFIGS = {
    "llama": lambda c: transformers.LlamaConfig(**c),
    "qwen2-sliding": lambda c: transformers.Qwen2Config(**c, use_sliding_window=True, sliding_window=WINDOW,
                                                        max_window_layers=1),
    "qwen3": lambda c: transformers.Qwen3Config(**c, head_dim=8),
    "mistral-sliding": lambda c: transformers.MistralConfig(**c, sliding_window=WINDOW),
    "mixtral": lambda c: transformers.MixtralConfig(**_moe(c), sliding_window=None),
    "qwen3_moe": lambda c: transformers.Qwen3MoeConfig(**dict(c, num_experts=4, num_experts_per_tok=2,
                                                              moe_intermediate_size=32), head_dim=8),
    "phi3-sliding": lambda c: transformers.Phi3Config(**c, sliding_window=WINDOW),
    "starcoder2-sliding": lambda c: transformers.Starcoder2Config(**c, sliding_window=WINDOW),
    "gemma": lambda c: transformers.GemmaConfig(**c, head_dim=8),
    "gemma3-sliding": lambda c: transformers.Gemma3TextConfig(
        **c, head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=None),
    "gemma2-sliding-softcap": lambda c: transformers.Gemma2Config(
        **c, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=SOFTCAP_ATTENTION,
        final_logit_softcapping=SOFTCAP_FINAL),
    "gemma3-softcap": lambda c: transformers.Gemma3TextConfig(
        **c, head_dim=8, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"],
        attn_logit_softcapping=SOFTCAP_ATTENTION, final_logit_softcapping=SOFTCAP_FINAL),
    "cohere": lambda c: transformers.CohereConfig(**c, logit_scale=0.5),
    "granite": lambda c: transformers.GraniteConfig(**c, logits_scaling=4.0, embedding_multiplier=2.0,
                                                    residual_multiplier=0.5, attention_multiplier=0.3),
    "cohere2-sliding": lambda c: transformers.Cohere2Config(
        **c, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5),
    "granitemoe": lambda c: transformers.GraniteMoeConfig(**_moe(c), logits_scaling=4.0, embedding_multiplier=2.0,
                                                          residual_multiplier=0.5, attention_multiplier=0.3),
    "olmo2": lambda c: transformers.Olmo2Config(**c),
    "olmo3-sliding": lambda c: transformers.Olmo3Config(
        **c, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "qwen2_moe-sliding": lambda c: transformers.Qwen2MoeConfig(
        **dict(c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32), use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1),
    "smollm3-sliding": lambda c: transformers.SmolLM3Config(
        **c, use_sliding_window=True, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "ministral-sliding": lambda c: transformers.MinistralConfig(
        **c, head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "phi": lambda c: transformers.PhiConfig(**{k: v for k, v in c.items() if k != "num_key_value_heads"},
                                            partial_rotary_factor=0.5),
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "opt": _opt,
}

#: Families of the allow-list and the cases that cover them (every family must be covered).
COVERED = {"llama": "llama", "qwen2": "qwen2-sliding", "qwen3": "qwen3", "mistral": "mistral-sliding",
           "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "phi3": "phi3-sliding",
           "starcoder2": "starcoder2-sliding", "gemma": "gemma", "gemma3_text": "gemma3-sliding",
           "gpt2": "gpt2", "gpt_neox": "gpt_neox", "opt": "opt", "gemma2": "gemma2-sliding-softcap",
           "cohere": "cohere", "granite": "granite", "cohere2": "cohere2-sliding", "granitemoe": "granitemoe",
           "olmo2": "olmo2", "olmo3": "olmo3-sliding", "qwen2_moe": "qwen2_moe-sliding",
           "smollm3": "smollm3-sliding", "ministral": "ministral-sliding", "phi": "phi"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return _build_tokenizer(tmp_path_factory.mktemp("arch_tokenizer"))


class _Checkpoints:
    """Tiny checkpoints built on first use and shared by every test of the module."""

    def __init__(self, root: pathlib.Path, tokenizer):
        self.root, self.tokenizer, self.paths = root, tokenizer, {}

    def __getitem__(self, name: str) -> pathlib.Path:
        if name not in self.paths:
            eos = self.tokenizer.eos_token_id
            config = CONFIGS[name](_common(len(self.tokenizer), eos))
            torch.manual_seed(sum(map(ord, name)))
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
            self.paths[name] = self.root / name
            model.save_pretrained(self.paths[name])
            self.tokenizer.save_pretrained(self.paths[name])
        return self.paths[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield _Checkpoints(tmp_path_factory.mktemp("arch_checkpoints"), tokenizer)
    torch.set_num_threads(threads)


def _worker(path: pathlib.Path) -> ModelWorker:
    spec = ModelSpec(name=path.name, path=str(path), role="target", num_gpus=0, num_cpus=0.25, torch_threads=1,
                     resources={})
    return ModelWorker(spec, idle_timeout_s=600, max_sessions=4)


@torch.inference_mode()
def _full_logits(model, context: list[int]) -> torch.Tensor:
    """transformers' own forward of the whole context, no cache: ``[len(context), V]``."""
    return model(torch.tensor([context])).logits[0].float()


def _run(worker: ModelWorker, *items: WorkItem):
    outcomes, payloads = worker.run_step(list(items))
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
    return outcomes, payloads


def _prompt(tokenizer) -> list[int]:
    ids = tokenizer(PROMPT_TEXT)["input_ids"]
    assert len(ids) > 2 * WINDOW
    return ids


def test_every_family_is_covered():
    assert set(COVERED) <= set(FAMILIES) and set(COVERED.values()) <= set(CONFIGS)
    missing = set(FAMILIES) - set(COVERED)
    assert not missing, f"allow-listed families without a test model: {sorted(missing)}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rows_and_greedy_equal_transformers(name, checkpoints, tokenizer):
    _check_rows_and_greedy(checkpoints[name], tokenizer)


def _check_rows_and_greedy(path: pathlib.Path, tokenizer) -> None:
    worker = _worker(path)
    model = worker.backend.model
    prompt = _prompt(tokenizer)
    short = prompt[: WINDOW + 5]
    try:
        sampling = RowSampling(temperature=1.0)
        # Chains longer than the window: a chain's columns are not its positions (docs/design.md, "The KV cache").
        items = [WorkItem("chains", Sample(path.name, (), CHAIN, num_drafts=2, return_logits=True),
                          open=OpenSession(tuple(prompt), sampling, {"sample": 1})),
                 WorkItem("short", Sample(path.name, (), 4, return_logits=True),
                          open=OpenSession(tuple(short), sampling, {"sample": 2}))]
        _, payloads = _run(worker, *items)
        drafts = payloads[0].tokens.tolist()  # [K=2, CHAIN]
        for k in range(2):
            expected = _full_logits(model, prompt + drafts[k])[len(prompt) - 1: len(prompt) + CHAIN - 1]  # [CHAIN, V]
            torch.testing.assert_close(payloads[0].logits[k], expected, atol=ATOL, rtol=0)
        tokens = payloads[1].tokens[0].tolist()
        expected = _full_logits(model, short + tokens)[len(short) - 1: len(short) + 3]
        torch.testing.assert_close(payloads[1].logits[0], expected, atol=ATOL, rtol=0)
        # Accept the second chain's first three tokens (its keys move next to the prefix), go on.
        accepted = drafts[1][: WINDOW + 1]
        _, payloads = _run(worker, WorkItem("chains", Sample(path.name, tuple(accepted), 4, return_logits=True)))
        context = prompt + accepted
        tokens = payloads[0].tokens[0].tolist()
        expected = _full_logits(model, context + tokens)[len(context) - 1: len(context) + 3]
        torch.testing.assert_close(payloads[0].logits[0], expected, atol=ATOL, rtol=0)
        # Greedy through the worker equals transformers' generate.
        greedy = _run(worker, WorkItem("greedy", Sample(path.name, (), GREEDY_TOKENS),
                                       open=OpenSession(tuple(prompt), RowSampling(temperature=0.0), {"sample": 3})))
        reference = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY_TOKENS,
                                   min_new_tokens=0, eos_token_id=None, pad_token_id=tokenizer.eos_token_id)
        assert greedy[0][0].value.tokens[0].tolist() == reference[0, len(prompt):].tolist()
    finally:
        for session in ("chains", "short", "greedy"):
            worker.release(session)


# ---------------------------------------------------------------------------------------- refusals

def _config(name: str, **changes) -> transformers.PretrainedConfig:
    config = CONFIGS[name](_common(320, 0))
    for key, value in changes.items():
        setattr(config, key, value)
    return config


REFUSED = {
    "unknown model type": (lambda: transformers.BloomConfig(vocab_size=320, hidden_size=32, n_layer=2, n_head=4),
                           "ALiBi position bias"),
    "unlisted model type": (lambda: transformers.FalconConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=4, alibi=False),
                            "model type 'falcon' is not among the architectures served exactly"),
    "encoder-decoder": (lambda: transformers.T5Config(vocab_size=320, d_model=32, num_layers=2, num_heads=4),
                        "encoder-decoder"),
    "cross-attention": (lambda: _config("gpt2", add_cross_attention=True), "cross-attention"),
    "chunked attention": (lambda: _config("llama", attention_chunk_size=16), "chunked attention"),
    "dynamic rope": (lambda: _config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                               "rope_theta": 10000.0}), "rope_type='dynamic'"),
    "longrope": (lambda: _config("phi3-sliding", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                                   "short_factor": [1.0] * 2, "long_factor": [2.0] * 2}),
                 "rope_type='longrope'"),
    "unknown layer type": (lambda: _config("qwen2-sliding", layer_types=["full_attention", "chunked_attention"]),
                           "attention layer types ['chunked_attention']"),
    "head transform on a plain family": (lambda: _config("llama", logit_scale=0.5), "final logit transform"),
    "attention soft-cap on a family without it": (lambda: _config("mistral-sliding", attn_logit_softcapping=50.0),
                                                  "attention soft-capping"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_configs_are_refused_naming_feature_and_model(case):
    build, feature = REFUSED[case]
    with pytest.raises(UnsupportedModelError) as error:
        resolve_architecture(build(), "/models/tiny")
    assert feature in str(error.value) and "'/models/tiny'" in str(error.value)


def test_refused_at_load_before_weights(tmp_path):
    """``SlotBackend.load`` refuses from the config alone (no weights are in the directory)."""
    from actors.model.backends import SlotBackend

    _config("llama", attention_chunk_size=16).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=f"model '{tmp_path}' is refused: chunked attention"):
        SlotBackend.load(str(tmp_path))


# ------------------------------------------------------------------------------------ vocabularies
# (the check itself: tests/actors/test_vocabulary.py)

PADDED_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory, tokenizer) -> dict[str, pathlib.Path]:
    """A Qwen2 target and a perturbed draft whose embedding tables are padded differently past
    the tokenizer (both with a sliding-window layer)."""
    import copy

    real, eos = len(tokenizer), tokenizer.eos_token_id
    torch.manual_seed(7)
    config = CONFIGS["qwen2-sliding"](dict(_common(real + 64, eos)))
    target = transformers.AutoModelForCausalLM.from_config(config).eval()
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.1 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    draft.resize_token_embeddings(real + 32)
    root = tmp_path_factory.mktemp("padded_pair")
    paths = {}
    for name, model in (("target", target), ("draft", draft)):
        paths[name] = root / name
        model.save_pretrained(paths[name])
        tokenizer.save_pretrained(paths[name])
    return paths


def test_padded_vocabulary_pair_serves_the_target_law(ray_session, padded_pair, tokenizer):
    """Through the real coordinator: ar, sd and multi_draft at temperature 0 give the argmax of
    the target's logits over the tokenizer's real tokens, step by step (full forwards)."""
    import asyncio

    from actors.request_schema import GenerationRequest
    from cluster.serving.bringup import start_model_group

    args = {"models": {"target": {"path": str(padded_pair["target"]), "role": "target"},
                       "draft": {"path": str(padded_pair["draft"]), "role": "draft"}},
            "defaults": {"strategy": "sd", "method": "block", "gamma": 4},
            "resources": {"cpus_per_model": 0.25, "torch_threads": 1},
            "limits": {"max_concurrent_requests": 8, "session_idle_timeout_s": 120}}
    cases = {"ar": {"strategy": "ar"}, "sd": {"strategy": "sd", "method": "block", "gamma": 4},
             "multi_draft": {"strategy": "multi_draft", "method": "spectr", "gamma": 3, "num_drafts": 2}}
    group = start_model_group(args)
    try:
        async def run(name, speculation):
            request = GenerationRequest(request_id=name, prompt=PROMPT_TEXT, speculation=speculation,
                                        sampling={"temperature": 0, "max_tokens": PADDED_MAX_TOKENS, "ignore_eos": True})
            stream = group.coordinator.generate.options(num_returns="streaming").remote(request)
            return [t for chunk in [await ref async for ref in stream] for t in chunk.token_ids]

        async def run_all():
            return await asyncio.gather(*(run(name, spec) for name, spec in cases.items()))

        outputs = dict(zip(cases, asyncio.run(run_all())))
    finally:
        group.shutdown()
    target = transformers.AutoModelForCausalLM.from_pretrained(padded_pair["target"]).eval()
    served_tokenizer = transformers.AutoTokenizer.from_pretrained(padded_pair["target"])  # the coordinator's
    context = served_tokenizer(PROMPT_TEXT)["input_ids"]
    for _ in range(PADDED_MAX_TOKENS):
        context.append(int(_full_logits(target, context)[-1, : len(tokenizer)].argmax()))
    expected = context[-PADDED_MAX_TOKENS:]
    assert outputs == {name: expected for name in cases}


# ------------------------------------------------------------- speculation on a soft-capped model

LAW_REQUESTS = 240  # sampled sd requests of LAW_TOKENS tokens each
LAW_TOKENS, LAW_TOP_K = 2, 3
CHI_SQUARE_SIGNIFICANCE = 1e-3  # fixed seeds: deterministic


@pytest.fixture(scope="module")
def gemma2_group(ray_session, checkpoints, tmp_path_factory, tokenizer):
    """A model group over the tiny Gemma 2 (eager, sliding, both soft-caps) and a perturbed draft."""
    from cluster.serving.bringup import start_model_group

    target_path = checkpoints["gemma2-sliding-softcap"]
    draft = transformers.AutoModelForCausalLM.from_pretrained(target_path, attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    draft_path = tmp_path_factory.mktemp("gemma2_draft")
    draft.save_pretrained(draft_path)
    tokenizer.save_pretrained(draft_path)
    group = start_model_group({
        "models": {"target": {"path": str(target_path), "role": "target"},
                   "draft": {"path": str(draft_path), "role": "draft"}},
        "defaults": {"strategy": "sd", "method": "block", "gamma": 3},
        "resources": {"cpus_per_model": 0.25, "torch_threads": 1},
        "limits": {"max_concurrent_requests": 32, "max_queued_requests": 512, "session_idle_timeout_s": 120}})
    yield group, transformers.AutoTokenizer.from_pretrained(target_path)
    group.shutdown()


def _generate(group, requests) -> list[list[int]]:
    import asyncio

    async def one(request):
        stream = group.coordinator.generate.options(num_returns="streaming").remote(request)
        chunks = [await ref async for ref in stream]
        assert chunks[-1].error is None, chunks[-1].error
        return [t for chunk in chunks for t in chunk.token_ids]

    async def run_all():
        return await asyncio.gather(*(one(request) for request in requests))

    return asyncio.run(run_all())


def test_speculation_on_gemma2_equals_its_greedy_output(gemma2_group, checkpoints):
    from actors.request_schema import GenerationRequest

    group, served_tokenizer = gemma2_group
    cases = {"ar": {"strategy": "ar"}, "sd-block": {"strategy": "sd", "method": "block", "gamma": 4},
             "sd-token": {"strategy": "sd", "method": "token", "gamma": 3}}
    outputs = _generate(group, [
        GenerationRequest(request_id=name, prompt=PROMPT_TEXT, speculation=speculation,
                          sampling={"temperature": 0, "max_tokens": PADDED_MAX_TOKENS, "ignore_eos": True})
        for name, speculation in cases.items()])
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["gemma2-sliding-softcap"],
                                                              attn_implementation="eager").eval()
    prompt = served_tokenizer(PROMPT_TEXT)["input_ids"]
    reference = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=PADDED_MAX_TOKENS,
                               min_new_tokens=0, eos_token_id=None, pad_token_id=served_tokenizer.eos_token_id)
    assert outputs == [reference[0, len(prompt):].tolist()] * len(cases)


def test_sampled_speculation_on_gemma2_follows_the_soft_capped_law(gemma2_group, checkpoints):
    """Sampled sd (temperature 1, top-k 3) through the coordinator: the joint law of the first
    two tokens is the target's, computed from its soft-capped full-forward logits."""
    from actors.request_schema import GenerationRequest
    from tests.verifiers.tiny_models import chi_square_pvalue

    group, served_tokenizer = gemma2_group
    samples = _generate(group, [
        GenerationRequest(request_id=f"law{i}", prompt=PROMPT_TEXT,
                          speculation={"strategy": "sd", "method": "block", "gamma": 3},
                          sampling={"temperature": 1.0, "top_k": LAW_TOP_K, "max_tokens": LAW_TOKENS,
                                    "ignore_eos": True, "seed": 1000 + i})
        for i in range(LAW_REQUESTS)])
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["gemma2-sliding-softcap"],
                                                              attn_implementation="eager").eval()
    prompt = served_tokenizer(PROMPT_TEXT)["input_ids"]

    def top_k_law(context):  # token -> probability under temperature 1, top-k
        values, tokens = _full_logits(model, context)[-1].double().topk(LAW_TOP_K)
        return dict(zip(tokens.tolist(), torch.softmax(values, -1).tolist()))

    law = {(first, second): p * q for first, p in top_k_law(prompt).items()
           for second, q in top_k_law(prompt + [first]).items()}
    assert chi_square_pvalue([tuple(sample) for sample in samples], law) > CHI_SQUARE_SIGNIFICANCE


def test_a_model_loaded_with_another_attention_is_refused(checkpoints):
    """Eager attention with the engine's bool masks would add them as 0/1: never served."""
    from actors.model.backends import SlotBackend

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["llama"], attn_implementation="eager")
    with pytest.raises(UnsupportedModelError, match="attn_implementation='eager'; this architecture is served with 'sdpa'"):
        SlotBackend(model, "cpu", max_slots=1)


# ------------------------------------------------------- every strategy, every family (in-process)

STRATEGY_TOKENS = 10  # greedy tokens per strategy (the prompt is longer than every window)
GREEDY_STRATEGIES = {
    "sd-block": {"strategy": "sd", "method": "block", "gamma": 3},
    "sd-token": {"strategy": "sd", "method": "token", "gamma": 3},
    "sd-greedy_block": {"strategy": "sd", "method": "greedy_block", "gamma": 3},
    "multi_draft": {"strategy": "multi_draft", "method": "spectr", "gamma": 2, "num_drafts": 2},
}
ENSEMBLE = {"ensemble": "weighted", "members": ["target", "partner"], "weights": [0.6, 0.4]}


def _perturbed_copy(path: pathlib.Path, root: pathlib.Path, seed: int, tokenizer) -> pathlib.Path:
    """The model at ``path`` with every weight moved by 0.3 of its standard deviation (a draft or
    an ensemble member that agrees with it often, not always)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=resolve_architecture(transformers.AutoConfig.from_pretrained(path),
                                                       str(path)).attn_implementation).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    out = root / f"{path.name}-{seed}"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _local_group(paths: dict[str, pathlib.Path]):
    """The production Coordinator and ModelWorkers in this process (no Ray)."""
    from benchmarks.served.runners import LocalRunner
    from cluster.config import parse_app_args

    roles = {"target": "target", "draft": "draft", "partner": "member"}
    return LocalRunner(parse_app_args({
        "models": {name: {"path": str(path), "role": roles[name]} for name, path in paths.items()},
        "defaults": {"strategy": "ar"},
        "resources": {"torch_threads": 1},
        "limits": {"max_concurrent_requests": 32, "max_queued_requests": 512},
        "engine": {"goodput_gamma": False}}), temperature=1.0)


def _serve(runner, requests) -> list[list[int]]:
    import asyncio

    async def one(request):
        chunks = [chunk async for chunk in runner.coordinator.generate(request)]
        assert chunks[-1].error is None, chunks[-1].error
        return [t for chunk in chunks for t in chunk.token_ids]

    async def run_all():
        return await asyncio.gather(*(one(request) for request in requests))

    return runner.loop.run_until_complete(run_all())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_strategy_serves_the_family_exactly(name, checkpoints, tokenizer, tmp_path):
    """Through the real coordinator: greedy sd (block, token, greedy block) and multi_draft equal
    ar, which equals transformers' greedy output (test above); greedy se equals the plain
    ensemble, whose tokens are the argmax of the weighted ensemble of the two models' full-forward
    logits; sampled sd (temperature 1, top-k 3) follows the model's joint law of two tokens."""
    from actors.request_schema import GenerationRequest
    from tests.verifiers.tiny_models import chi_square_pvalue
    from verifiers.ensemble import make_ensemble

    target = checkpoints[name]
    paths = {"target": target, "draft": _perturbed_copy(target, tmp_path, 1, tokenizer),
             "partner": _perturbed_copy(target, tmp_path, 2, tokenizer)}
    prompt = _prompt(tokenizer)
    greedy = {"temperature": 0, "max_tokens": STRATEGY_TOKENS, "ignore_eos": True}
    cases = {"ar": {"strategy": "ar"}, **GREEDY_STRATEGIES, "ensemble": {"strategy": "ensemble", **ENSEMBLE},
             "se": {"strategy": "se", "method": "block", "gammas": [1, 3], **ENSEMBLE}}
    runner = _local_group(paths)
    try:
        outputs = dict(zip(cases, _serve(runner, [
            GenerationRequest(request_id=f"{name}-{case}", prompt_ids=prompt, speculation=speculation, sampling=greedy)
            for case, speculation in cases.items()])))
        samples = _serve(runner, [
            GenerationRequest(request_id=f"{name}-law{i}", prompt_ids=prompt,
                              speculation={"strategy": "sd", "method": "block", "gamma": 3},
                              sampling={"temperature": 1.0, "top_k": LAW_TOP_K, "max_tokens": LAW_TOKENS,
                                        "ignore_eos": True, "seed": 2000 + i})
            for i in range(LAW_REQUESTS)])
    finally:
        runner.close()
    for case in GREEDY_STRATEGIES:
        assert outputs[case] == outputs["ar"], case
    assert outputs["se"] == outputs["ensemble"]
    models = [_loaded(paths[member]) for member in ENSEMBLE["members"]]
    sequence = prompt + outputs["ensemble"]
    member_logits = torch.stack([_full_logits(model, sequence)[len(prompt) - 1: -1] for model in models])  # [2, n, V]
    ensemble = make_ensemble("weighted", 2, weights=ENSEMBLE["weights"], mu=0.0)
    assert ensemble.logits(member_logits.double()).argmax(-1).tolist() == outputs["ensemble"]
    model = models[0]

    def top_k_law(context):  # token -> probability under temperature 1, top-k
        values, tokens = _full_logits(model, context)[-1].double().topk(LAW_TOP_K)
        return dict(zip(tokens.tolist(), torch.softmax(values, -1).tolist()))

    law = {(first, second): p * q for first, p in top_k_law(prompt).items()
           for second, q in top_k_law(prompt + [first]).items()}
    assert chi_square_pvalue([tuple(sample) for sample in samples], law) > CHI_SQUARE_SIGNIFICANCE


def _loaded(path: pathlib.Path):
    config = transformers.AutoConfig.from_pretrained(path)
    attention = resolve_architecture(config, str(path)).attn_implementation
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention).eval()
