"""A request's final chunk reaches its stream even when its statistics cannot be computed, and
the scheduler goes on serving the other requests (in process: the production Coordinator and
WorkerEngines over the fake models, no Ray)."""

from __future__ import annotations


from actors.request_schema import GenerationRequest
from actors.coordination import request_stats, scheduler
from actors.coordination.coordinator import Coordinator
from benchmarks.served.runners import LocalActorHandle
from tests.actors.fake_models import FunctionModelWorker, fake_group_config, run_in_process


def _request(request_id: str, seed: int) -> GenerationRequest:
    return GenerationRequest(request_id=request_id, prompt_ids=[1, 2, 3],
                             speculation={"strategy": "sd", "method": "block", "gamma": 3},
                             sampling={"max_tokens": 10, "seed": seed, "temperature": 1.0, "ignore_eos": True})


def _serve(requests: list[GenerationRequest], **engine) -> list[list]:
    config = fake_group_config(overlap=False, **engine)
    coordinator = Coordinator({m.name: LocalActorHandle(FunctionModelWorker(m, 60.0)) for m in config.models}, config,
                              export_to_ray=False)

    return run_in_process(coordinator, requests, timeout_s=120)


def test_a_request_whose_stats_fail_still_gets_its_output_and_the_others_theirs(monkeypatch):
    reference = _serve([_request("a", 1), _request("b", 2)])
    computed = request_stats.request_stats

    def stats_failing_for_a(request):
        if request.request_id == "a":
            raise RuntimeError("stats broke")
        return computed(request)

    monkeypatch.setattr(request_stats, "request_stats", stats_failing_for_a)
    broken_a, fine_b = _serve([_request("a", 1), _request("b", 2)])
    assert broken_a[-1].finished and broken_a[-1].error is None and broken_a[-1].stats is None
    assert [t for c in broken_a for t in c.token_ids] == [t for c in reference[0] for t in c.token_ids]
    assert len([t for c in broken_a for t in c.token_ids]) == 10
    assert fine_b[-1].stats is not None and fine_b[-1].error is None
    assert [t for c in fine_b for t in c.token_ids] == [t for c in reference[1] for t in c.token_ids]


def test_a_failing_step_still_ends_every_stream_when_stats_fail_too(monkeypatch):
    """The step raises and the failure path's stats raise as well: each stream still ends with an
    error chunk (before, the second exception escaped the scheduler's loop and the streams hung)."""
    monkeypatch.setattr(request_stats, "request_stats", lambda request: (_ for _ in ()).throw(RuntimeError("stats broke")))
    monkeypatch.setattr(scheduler.Scheduler, "_step", _raising_step)
    chunks = _serve([_request("a", 1)], burst_ms=0)[0]  # a lone request would run in bursts, not steps
    assert chunks[-1].finished and chunks[-1].finish_reason == "error" and "internal error" in chunks[-1].error


async def _raising_step(self, cohort):
    raise RuntimeError("step broke")
