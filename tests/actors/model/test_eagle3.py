"""EAGLE-3 heads (actors/model/eagle3.py): the published format, the chain law, exactness.

* A head saved in the published format (config keys, ``midlayer.*`` tensor names, ``d2t``/``t2d``)
  loads back to the same rows, sharing the target's embeddings; a head for another target
  (hidden size, vocabulary, layers) or not an EAGLE-3 head is refused at load naming both.
* The rows are over the target vocabulary: zero probability outside the draft vocabulary's image
  under ``d2t``; the cached chain (prefill + extend) equals the recomputed one.
* Exact enumeration (float64, TV < 1e-9): a tiny Llama's EAGLE-3 head, fed the target's aux states
  of the committed tokens and its own features along the chain, as the draft of the Llama through
  the reference decode loop (the state machine the engine drives) emits the Llama's law under
  token, block and greedy block verification, and SpecTr over two sampled chains; the verifier
  handed the head's rows as the target's emits the head's law instead (the negative control).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from actors.model.eagle3 import (
    Eagle3Config,
    Eagle3Error,
    Eagle3Head,
    default_aux_layers,
    load_head,
    save_head,
    target_aux_states,
)
from tests.verifiers.tiny_models import causal_lm_fn, target_law
from verifiers.machines.speculative import SpeculativeMachine
from verifiers.randomness import split_sources
from verifiers.reference.exact import exact_law, total_variation
from verifiers.reference.executor import LocalExecutor, layout_sources, run_machine

EXACT_TOLERANCE = 1e-9
SINGLE_DRAFT = ["token", "block", "greedy_block"]
VOCAB, DRAFT_VOCAB, AUX = 16, 8, (0, 1, 3)
#: Target ids of the draft vocabulary (d2t holds their offsets from the draft ids).
DRAFT_IDS = (0, 2, 3, 5, 7, 8, 11, 13)
LAW_TOP_K, LAW_TOKENS, LAW_GAMMA = 2, 3, 2
PROMPT = (3, 7)


def _tiny_llama(seed: int = 11):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _tiny_config(**changes) -> Eagle3Config:
    fields = dict(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  rope_theta=10000.0, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=64,
                  aux_layers=AUX, max_position_embeddings=64)
    return Eagle3Config(**{**fields, **changes})


def _tiny_head(target, seed: int = 5) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(_tiny_config(), target.get_input_embeddings())
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if parameter.dim() == 2 and not name.startswith("embed_tokens"):
                parameter.normal_(0.0, 0.3)
        head.d2t.copy_(torch.tensor(DRAFT_IDS) - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()
        head.t2d[list(DRAFT_IDS)] = True
    return head.eval()


@pytest.fixture(scope="module")
def pair():
    target = _tiny_llama()
    return target, _tiny_head(target)


@pytest.fixture(scope="module")
def fns(pair):
    """(head_fn, target_fn) shared by the module's tests (their rows cached once)."""
    target, head = pair
    return _head_fn(target, head), causal_lm_fn(target)


def _aux(target, tokens: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return target_aux_states(target, torch.tensor([tokens]), AUX)[0]  # [n, 3H]


def _head_fn(target, head):
    """(committed, chain) -> float64 target-vocabulary logits ``[V]`` of the head."""

    @functools.lru_cache(maxsize=None)
    def logits(committed: tuple[int, ...], chain: tuple[int, ...]) -> torch.Tensor:
        aux = _aux(target, committed)[:-1]  # [n-1, 3H]: the target has run over all but the last
        return head.chain_logits(torch.tensor(committed), aux, torch.tensor(chain, dtype=torch.long)).double()

    return logits


class _Eagle3Executor(LocalExecutor):
    """The reference executor whose draft rows are the head's: the committed context (the draft's
    own context, which the machine extends by the committed tokens before each block) and the
    chain drafted after it."""

    def __init__(self, head_fn, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_fn = head_fn

    def _logits(self, model: str, context: tuple[int, ...]) -> torch.Tensor:
        if model != "draft":
            return super()._logits(model, context)
        committed = self.contexts["draft"]
        assert context[: len(committed)] == committed
        return self.head_fn(committed, context[len(committed):])


def _eagle_law(head_fn, target_fn, length: int, *, method: str, num_drafts: int = 1, as_target=None):
    """Exact law of the reference speculative loop with the head as its draft (``as_target``: the
    function the verifier is handed as the target's rows)."""

    def procedure(source):
        draft_source, verify_source = split_sources(source, 2)
        machine = SpeculativeMachine("draft", "target", method=method, gamma=LAW_GAMMA, num_drafts=num_drafts,
                                     max_new_tokens=length)
        executor = _Eagle3Executor(head_fn, {"draft": lambda c: None, "target": as_target or target_fn}, PROMPT,
                                   layout_sources(machine.streams(), [draft_source, verify_source]),
                                   temperature=1.0, top_k=LAW_TOP_K, top_p=1.0)
        return tuple(run_machine(machine, executor)[:length])

    return exact_law(procedure)


# ---------------------------------------------------------------------------------- format
def test_a_saved_head_loads_back_to_the_same_rows_sharing_the_targets_embeddings(pair, tmp_path):
    target, head = pair
    save_head(head, tmp_path / "head", dtype=torch.float32)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(name.startswith("embed_tokens") for name in names)
    loaded = load_head(tmp_path / "head", target)
    assert loaded.embed_tokens is target.get_input_embeddings()
    committed, chain = torch.tensor([3, 7, 1, 4]), torch.tensor([2, 5])
    aux = _aux(target, (3, 7, 1, 4))[:-1]
    assert torch.equal(loaded.chain_logits(committed, aux, chain), head.chain_logits(committed, aux, chain))


@pytest.mark.parametrize(("change", "message"), [
    ({"target_hidden_size": 32}, "target_hidden_size 32 does not match target t's hidden_size 64"),
    ({"vocab_size": 32}, "vocab_size 32 does not match target t's vocab_size 16"),
    ({"aux_layers": (0, 1, 4)}, r"eagle_aux_hidden_state_layer_ids \[0, 1, 4\] are not three of target t's 4 layers"),
])
def test_a_head_for_another_target_is_refused_naming_both(pair, tmp_path, change, message):
    target, _ = pair
    torch.manual_seed(0)
    config = _tiny_config(**change)
    head = Eagle3Head(config)
    save_head(head, tmp_path / "other", with_embeddings=True)
    with pytest.raises(Eagle3Error, match=f"eagle3 head h: {message}"):
        load_head(tmp_path / "other", target, head_name="h", target_name="t")


def test_a_checkpoint_that_is_no_eagle3_head_is_refused(pair, tmp_path):
    target, head = pair
    save_head(head, tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(Eagle3Error, match=r"architectures \['LlamaForCausalLM'\] is not an EAGLE-3 head"):
        load_head(tmp_path / "plain", target)
    with pytest.raises(Eagle3Error, match="no config.json"):
        load_head(tmp_path / "missing", target)


def test_aux_layers_top_level_or_under_eagle_config_default_vllms():
    assert default_aux_layers(32) == (2, 16, 29)
    config = _tiny_config().to_dict()
    layers = config.pop("eagle_aux_hidden_state_layer_ids")
    assert Eagle3Config.from_dict(config, 32).aux_layers == (2, 16, 29)
    nested = config | {"eagle_config": {"eagle_aux_hidden_state_layer_ids": layers}}  # EAGLE's own spelling
    assert Eagle3Config.from_dict(nested, 32).aux_layers == AUX


# ---------------------------------------------------------------------------------- chain law
def test_rows_give_zero_probability_outside_the_draft_vocabulary(fns):
    logits = fns[0]((3, 7, 1), (2,))  # [V]
    probs = torch.softmax(logits, -1)
    outside = [t for t in range(VOCAB) if t not in DRAFT_IDS]
    assert torch.all(probs[outside] == 0) and torch.all(probs[list(DRAFT_IDS)] > 0)


def test_the_cached_chain_equals_the_recomputed_one(pair):
    target, head = pair
    committed = torch.tensor([3, 7, 1, 4, 9])
    aux = _aux(target, tuple(committed.tolist()))[:-1]
    with torch.no_grad():
        prenorm, cache = head.prefill(committed, aux)
        rows = [head.target_logits(prenorm)]
        for k, token in enumerate([2, 5, 8]):
            out, cache = head.extend(torch.tensor([token]), prenorm[None], committed.shape[0] + k, cache)
            prenorm = out[0]
            rows.append(head.target_logits(prenorm))
    for k in range(4):
        expected = head.chain_logits(committed, aux, torch.tensor([2, 5, 8][:k], dtype=torch.long))
        assert torch.allclose(rows[k], expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- exact law
@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_the_eagle3_head_as_draft_is_exact(fns, method):
    head_fn, target_fn = fns
    law = _eagle_law(head_fn, target_fn, LAW_TOKENS, method=method)
    assert total_variation(law, target_law(target_fn, PROMPT, LAW_TOKENS, top_k=LAW_TOP_K)) < EXACT_TOLERANCE


@pytest.mark.slow
def test_two_sampled_chains_are_exact_under_multi_draft_verification(fns):
    """SpecTr K-SEQ over K = 2 chains the head samples independently: the target's law."""
    head_fn, target_fn = fns
    law = _eagle_law(head_fn, target_fn, 2, method="spectr", num_drafts=2)
    assert total_variation(law, target_law(target_fn, PROMPT, 2, top_k=LAW_TOP_K)) < EXACT_TOLERANCE


@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_negative_control_the_verifier_handed_the_heads_rows_as_the_targets(fns, method):
    """The harness sees a wrong law: verifying against the head's own rows (from the whole context
    as committed) emits the head's law, which is measurably not the target's."""
    head_fn, target_fn = fns
    as_target = functools.lru_cache(maxsize=None)(lambda context: head_fn(context, ()))
    law = _eagle_law(head_fn, target_fn, LAW_TOKENS, method=method, as_target=as_target)
    assert total_variation(law, target_law(as_target, PROMPT, LAW_TOKENS, top_k=LAW_TOP_K)) < EXACT_TOLERANCE
    assert total_variation(law, target_law(target_fn, PROMPT, LAW_TOKENS, top_k=LAW_TOP_K)) > 1e-4


# ---------------------------------------------------------------------------------- shipped head
def test_the_shipped_head_serves_the_embedded_target_and_refuses_another():
    """``models/embedded/eagle3`` loads for the embedded target (sharing its embeddings, rows over
    its vocabulary, top-1 agreeing with the target often) and is refused for partner2, whose
    hidden size differs, naming both."""
    from transformers import AutoModelForCausalLM

    from models import EMBEDDED_ROOT

    target = AutoModelForCausalLM.from_pretrained(EMBEDDED_ROOT / "target", dtype=torch.float32).eval()
    head = load_head(EMBEDDED_ROOT / "eagle3", target, head_name="embedded:eagle3")
    assert head.config.aux_layers == (1, 3, 5) and head.config.draft_vocab_size == 2048
    tokens = torch.tensor([[0] + list(range(40, 120))])  # [1, 81]
    with torch.no_grad():
        aux = target_aux_states(target, tokens, head.config.aux_layers)[0]  # [81, 3H]
        expected = target(tokens).logits[0].argmax(-1)  # [81]
        prenorm, _ = head.layer(tokens[:, 1:], head.fc(aux[None, :-1]), torch.arange(1, 81)[None])  # [1, 80, H]
        got = head.target_logits(prenorm[0]).argmax(-1)  # [80]: the token after position j = 1 .. 80
    assert float((got == expected[1:]).float().mean()) > 0.3
    wide = load_head(EMBEDDED_ROOT / "eagle3", target, dtype=torch.float64)  # its own copy of the embeddings
    assert wide.embed_tokens.weight.dtype == torch.float64 and target.get_input_embeddings().weight.dtype == torch.float32
    partner2 = AutoModelForCausalLM.from_pretrained(EMBEDDED_ROOT / "partner2", dtype=torch.float32)
    with pytest.raises(Eagle3Error, match="target_hidden_size 384 does not match target embedded:partner2's hidden_size 192"):
        load_head(EMBEDDED_ROOT / "eagle3", partner2, head_name="embedded:eagle3", target_name="embedded:partner2")
