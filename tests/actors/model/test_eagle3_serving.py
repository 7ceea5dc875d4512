"""An EAGLE-3 head served as a draft model (:mod:`actors.model.eagle3_serving`).

The law: the rows the served head samples from are :meth:`actors.model.eagle3.Eagle3Head.chain_logits`'
(``test_the_served_rows_are_the_chain_law``, through the real engines of the target and the head),
and the law of those rows under every rule that takes a draft is the target's, by exact
enumeration with a negative control (``tests/actors/model/test_eagle3.py``). End to end: the
production coordinator and workers in this process serve the embedded target with its shipped
head; greedy sd under every single-draft rule and multi_draft equal ar, and a seeded sampled
request is reproducible.
"""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch

from actors.messages import OpenSession, RowSampling, WorkItem
from actors.model.eagle3 import Eagle3Error, save_head
from actors.model.eagle3_serving import hosting, is_eagle3_checkpoint
from cluster.config import ConfigError, parse_app_args
from tests.actors.model.test_eagle3 import (EXACT_TOLERANCE, LAW_TOKENS, LAW_TOP_K, SINGLE_DRAFT, _eagle_law, _head_fn,
                                            _tiny_head, _tiny_llama)
from tests.actors.model.test_eagle3 import PROMPT as EAGLE_PROMPT
from tests.verifiers.tiny_models import target_law
from verifiers.reference.exact import total_variation
from verifiers.machines.needs import NextLogits, Sample

PROMPT = (3, 7, 1, 4, 9)
HEAD = str(pathlib.Path(__file__).resolve().parents[3] / "models" / "embedded" / "eagle3")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target model, head, directory holding ``target`` and ``head`` checkpoints)."""
    root = tmp_path_factory.mktemp("eagle3-serving")
    target = _tiny_llama()
    head = _tiny_head(target)
    target.save_pretrained(root / "target")
    save_head(head, root / "head", dtype=torch.float32)
    return target, head, root


def _workers(models: dict) -> dict:
    """ModelWorkers of ``models`` (the args' form) loaded in this process, heads after their target."""
    from actors.worker.model_worker import ModelWorker

    loaded: dict = {}
    with hosting(loaded):
        for spec in sorted(parse_app_args({"models": models}).freeze().models, key=lambda s: is_eagle3_checkpoint(s.path)):
            loaded[spec.name] = ModelWorker(spec, max_sessions=4)
    return loaded


def _check_rows(head_fn, committed: tuple[int, ...], sampled) -> None:
    """Each draft's rows ``[n, V]`` are the chain law after ``committed`` and the draft's first tokens."""
    for tokens, logits in zip(sampled.tokens.tolist(), sampled.logits):
        for i, row in enumerate(logits):
            expected = head_fn(committed, tuple(tokens[:i])).float()  # [V]
            assert torch.equal(torch.isinf(row), torch.isinf(expected))
            finite = ~torch.isinf(expected)
            torch.testing.assert_close(row[finite], expected[finite], rtol=0, atol=1e-4)


def test_the_served_rows_are_the_chain_law(tiny):
    """Through the engines: the first Sample (the target has run nothing: its states are computed),
    then one after the target ran the committed tokens (read from its slot: nothing recomputed)."""
    target, head, root = tiny
    workers = _workers({"target": {"path": str(root / "target"), "role": "target"},
                        "draft": {"path": str(root / "head"), "role": "draft"}})
    draft, verifier = workers["draft"].engine, workers["target"].engine
    backend = draft.backend
    head_fn = _head_fn(target, backend.head)
    spec = OpenSession(PROMPT, RowSampling(temperature=1.0), seeds={"sample": 1, "verify": 2})
    outcomes, payloads = draft.run_step([WorkItem("s", Sample("draft", (), 3, num_drafts=2, return_logits=True), open=spec)])
    assert outcomes[0].error is None, outcomes[0].error
    _check_rows(head_fn, PROMPT, payloads[0])
    assert backend.recomputed_positions == len(PROMPT) - 1
    first, second = payloads[0].tokens[0, :2].tolist()
    for append, opened in (((), spec), ((first,), None)):  # the target runs the prompt, then the first token
        outcome = verifier.run_step([WorkItem("s", NextLogits("target", append), open=opened)])[0][0]
        assert outcome.error is None, outcome.error
    outcomes, payloads = draft.run_step([WorkItem("s", Sample("draft", (first, second), 3, return_logits=True))])
    assert outcomes[0].error is None, outcomes[0].error
    _check_rows(head_fn, PROMPT + (first, second), payloads[0])
    assert backend.recomputed_positions == len(PROMPT) - 1  # read from the target's slot


def _served_fn(workers):
    """(committed, chain) -> the served head's float64 logits ``[V]``: the target's engine runs the
    committed tokens (a session of its own), the head's backend the committed tokens and the chain
    (a linear row, then one chain row per drafted token, as a Sample feeds them)."""
    import types

    from actors.model.batch import RowWork, RunAttend, linear_row

    verifier, backend = workers["target"].engine, workers["draft"].engine.backend
    calls = iter(range(10**9))

    @functools.lru_cache(maxsize=None)
    def logits(committed: tuple[int, ...], chain: tuple[int, ...]) -> torch.Tensor:
        session_id, n = f"law-{next(calls)}", len(committed)
        spec = OpenSession(committed, RowSampling(temperature=1.0))
        assert verifier.run_step([WorkItem(session_id, NextLogits("target", ()), open=spec)])[0][0].error is None
        slot = backend.allocate()
        session = types.SimpleNamespace(context=list(committed), session_id=session_id)
        sessions, backend.sessions = backend.sessions, types.SimpleNamespace(at_slot=lambda _: session)
        try:
            rows = backend.forward([linear_row(slot, 0, committed, 0, keep=[n - 1])])[0]
            for j, token in enumerate(chain):
                rows = backend.forward([RowWork(slot, n, (token,), (n + j,), (n + j,), RunAttend([n], [n + j + 1]), (0,))])[0]
        finally:
            backend.sessions = sessions
            backend.free(slot)
            verifier.run_step([], [session_id])
        return rows[0].double()

    return logits


@pytest.fixture(scope="module")
def served(tiny):
    """(served head_fn, target_fn) of the tiny pair."""
    from tests.verifiers.tiny_models import causal_lm_fn

    target, _, root = tiny
    workers = _workers({"target": {"path": str(root / "target"), "role": "target"},
                        "draft": {"path": str(root / "head"), "role": "draft"}})
    return _served_fn(workers), causal_lm_fn(target)


@pytest.mark.parametrize("method", SINGLE_DRAFT)
def test_the_served_head_as_draft_is_exact(served, method):
    """Exact enumeration (TV < 1e-9) of the speculative loop over the served head's rows."""
    head_fn, target_fn = served
    law = _eagle_law(head_fn, target_fn, LAW_TOKENS, method=method)
    assert total_variation(law, target_law(target_fn, EAGLE_PROMPT, LAW_TOKENS, top_k=LAW_TOP_K)) < EXACT_TOLERANCE


def test_negative_control_the_verifier_handed_the_served_heads_rows_as_the_targets(served):
    head_fn, target_fn = served
    as_target = functools.lru_cache(maxsize=None)(lambda context: head_fn(context, ()))
    law = _eagle_law(head_fn, target_fn, LAW_TOKENS, method="token", as_target=as_target)
    assert total_variation(law, target_law(target_fn, EAGLE_PROMPT, LAW_TOKENS, top_k=LAW_TOP_K)) > 1e-4


def test_a_head_without_its_target_in_the_worker_is_refused_naming_the_field(tiny):
    from actors.worker.model_worker import ModelWorker

    _, _, root = tiny
    spec = parse_app_args({"models": {"target": {"path": str(root / "target"), "role": "target"},
                                      "draft": {"path": str(root / "head"), "role": "draft"}}}).freeze().models[1]
    with pytest.raises(Eagle3Error, match=r"models\.draft.*resources\.placement"):
        ModelWorker(spec, max_sessions=2)


def test_a_head_for_another_target_is_refused_at_load_naming_both(tiny):
    _, _, root = tiny
    with pytest.raises(Eagle3Error, match=r"models\.draft .*eagle3.*models\.target "):
        _workers({"target": {"path": str(root / "target"), "role": "target"}, "draft": {"path": HEAD, "role": "draft"}})


#: Total variation of a quantized tiny head's rows from the float head's (random weights of
#: std 0.3 at width 64: int4's groups of 32 move them most; measured 0.01 and 0.29).
MAX_QUANTIZED_TV = {"int8": 0.05, "int4": 0.5}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_head_serves_rows_near_the_float_heads_law(tiny, quantization):
    """``quantization`` on a head: its GEMMs weight-only int8 / int4 (the law stays the target's:
    verification takes any rows, and the enumeration above covers whatever rows the head gives);
    its rows stay near the float head's."""
    target, _, root = tiny
    workers = _workers({"target": {"path": str(root / "target"), "role": "target"},
                        "draft": {"path": str(root / "head"), "role": "draft", "quantization": quantization}})
    draft = workers["draft"].engine
    assert f"weight-only {quantization}" in draft.backend.forward_path
    spec = OpenSession(PROMPT, RowSampling(temperature=1.0), seeds={"sample": 1})
    sampled = draft.run_step([WorkItem("s", Sample("draft", (), 2, return_logits=True), open=spec)])[1][0]
    head_fn = _head_fn(target, draft.backend.head)
    for i, row in enumerate(sampled.logits[0]):
        expected = torch.softmax(head_fn(PROMPT, tuple(sampled.tokens[0, :i].tolist())), -1)
        assert 0.5 * (torch.softmax(row.double(), -1) - expected).abs().sum() < MAX_QUANTIZED_TV[quantization]


def test_placement_puts_a_head_in_its_targets_worker(tiny):
    """auto moves the head to its target's worker (even with a GPU per model); a placement set by
    hand that parts them is refused naming resources.placement."""
    from cluster.config.placement import resolve_placement

    _, _, root = tiny
    models = {"target": {"path": str(root / "target"), "role": "target"},
              "draft": {"path": str(root / "head"), "role": "draft"}}
    config = parse_app_args({"models": models}).freeze()
    assert resolve_placement(config, gpus=2).workers == (("target", "draft"),)
    assert resolve_placement(config, gpus=0).workers == (("target", "draft"),)
    separate = parse_app_args({"models": models, "resources": {"placement": "separate"}}).freeze()
    with pytest.raises(ConfigError, match=r"resources\.placement: models\.draft is an EAGLE-3 head"):
        resolve_placement(separate, gpus=0)


# ---------------------------------------------------------------------------------- the engine
def test_a_deployment_with_the_shipped_head_generates_exactly():
    """No Ray: the production Coordinator and ModelWorkers in this process over the embedded target and
    its shipped EAGLE-3 head. Greedy sd (every single-draft rule) and multi_draft equal ar; a seeded
    sampled request gives the same tokens twice; the target's states are recomputed only for prompts."""
    from actors.request_schema import GenerationRequest
    from benchmarks.served.runners import LocalRunner

    runner = LocalRunner(parse_app_args({
        "models": {"target": {"path": "embedded:target", "role": "target"}, "draft": {"path": "embedded:eagle3", "role": "draft"}},
        "defaults": {"strategy": "sd", "method": "block", "gamma": 4},
        "resources": {"torch_threads": 1}, "engine": {"goodput_gamma": False}}), temperature=1.0)
    greedy = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    cases = {"ar": {"strategy": "ar"},
             **{f"sd-{method}": {"strategy": "sd", "method": method, "gamma": 4} for method in SINGLE_DRAFT},
             "multi_draft": {"strategy": "multi_draft", "method": "spectr", "gamma": 3, "num_drafts": 2}}
    requests = [GenerationRequest(request_id=case, prompt="def main(", speculation=speculation, sampling=greedy)
                for case, speculation in cases.items()]
    sampled = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True, "seed": 3}
    requests += [GenerationRequest(request_id=f"sampled-{i}", prompt="def main(", speculation={"strategy": "sd"},
                                   sampling=sampled) for i in range(2)]

    async def one(request):
        chunks = [chunk async for chunk in runner.coordinator.generate(request)]
        assert chunks[-1].error is None, chunks[-1].error
        return [t for chunk in chunks for t in chunk.token_ids], chunks[-1].stats

    try:
        results = {request.request_id: runner.loop.run_until_complete(one(request)) for request in requests}
        info = runner.workers["draft"]._instance.info()
        backend = runner.workers["draft"]._instance.backend
    finally:
        runner.close()
    assert "EAGLE-3 head" in info.forward_path and info.vocab_size == 4096
    for case in (*(f"sd-{method}" for method in SINGLE_DRAFT), "multi_draft"):
        assert results[case][0] == results["ar"][0], case
        assert results[case][1].model_calls.get("draft", 0) > 0, case
        assert results[case][1].block_efficiency > 1.0, case
    assert results["sampled-0"][0] == results["sampled-1"][0] and len(results["sampled-0"][0]) == 24
    prompt_tokens = 8  # "def main(" is fewer tokens: a bound on a prompt's positions
    assert backend.recomputed_positions <= prompt_tokens * len(requests)


def test_a_device_worker_loads_the_head_after_its_target_and_splits_the_kv_budget(tiny):
    """Listed first, the head still loads after its target; one KV budget sizes both models' slots."""
    from actors.model.eagle3_serving import Eagle3Backend
    from actors.worker.device_worker import DeviceWorker

    _, _, root = tiny
    specs = parse_app_args({"models": {"draft": {"path": str(root / "head"), "role": "draft"},
                                       "target": {"path": str(root / "target"), "role": "target"}}}).freeze().models
    worker = DeviceWorker(specs, max_sessions=4, kv_cache_memory=4 * 2**20)
    head, target = worker.models["draft"].backend, worker.models["target"].backend
    assert worker.names == ["draft", "target"] and isinstance(head, Eagle3Backend)
    assert head.max_slots == target.max_slots > 1 and target.cache.aux is not None
    assert target.cache.aux.shape[1] == 3 * 64  # three aux layers of the target's width


def test_a_ray_group_hosts_the_head_with_its_target_and_generates_as_ar(ray_session):
    """Through Ray (bring-up, placement auto): the head joins its target's DeviceWorker; greedy sd with
    it gives ar's tokens, a solo burst calling the hosted head in process included."""
    from actors.worker.device_worker import HostedModel
    from cluster.serving.bringup import start_model_group
    from tests.actors.coordination.test_coordinator_reference import _request, run_requests

    group = start_model_group({"models": {"target": {"path": "embedded:target", "role": "target"},
                                          "draft": {"path": "embedded:eagle3", "role": "draft"}},
                               "resources": {"cpus_per_model": 0.25, "torch_threads": 1}})
    try:
        assert isinstance(group.workers["draft"], HostedModel)
        requests = [_request(0, speculation, prompt=(264, 14, 199), max_tokens=16, temperature=0.0)
                    for speculation in ({"strategy": "ar"}, {"strategy": "sd", "method": "block", "gamma": 4})]
        ar, sd = ([t for chunk in chunks for t in chunk.token_ids] for chunks in run_requests(group, requests[:1])
                  + run_requests(group, requests[1:]))
        assert sd == ar and len(ar) == 16
    finally:
        group.shutdown()
