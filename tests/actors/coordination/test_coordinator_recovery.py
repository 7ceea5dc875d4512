"""A model worker that dies mid-request is restarted; the requests it held end with a
retryable error, the others are unaffected, and the group serves again (fake workers through
Ray: see tests/actors/fake_models.py; a slow forward keeps requests in flight)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from cluster.serving.bringup import start_model_group
from tests.actors.fake_models import CO_LOCATED, SlowFunctionModelWorker, fake_group_config
from tests.actors.coordination.test_coordinator_reference import _request, _tokens, run_requests

RECOVERY_LIMIT_S = 60.0


@pytest.fixture(scope="module")
def slow_group(ray_session):
    group = start_model_group(fake_group_config(), worker_cls=SlowFunctionModelWorker)
    yield group
    group.shutdown()


def _kill(worker) -> None:
    """SIGKILL the worker's process (a crash, not a clean exit): Ray restarts the actor."""
    os.kill(ray.get(worker.info.remote()).pid, signal.SIGKILL)


def _serve_again(group, deadline_s: float) -> float:
    """Seconds until a request completes again."""
    started = time.monotonic()
    while True:
        (chunks,) = run_requests(group, [_request(99, {"strategy": "sd", "method": "block", "gamma": 3}, max_tokens=8)])
        if chunks[-1].error is None:
            return time.monotonic() - started
        assert chunks[-1].retryable, chunks[-1].error
        assert time.monotonic() - started < deadline_s, "the group did not recover"
        time.sleep(0.5)


@pytest.mark.parametrize("victims", [["target"], ["target", "draft", "partner", "partner2"]], ids=["target", "all"])
def test_killed_workers_fail_their_requests_retryably_and_the_group_recovers(slow_group, victims):
    speculation = {"strategy": "sd", "method": "block", "gamma": 3}
    requests = [_request(seed, speculation, max_tokens=40) for seed in range(8)]
    # An ensemble of two models the first case does not kill: it must not notice.
    bystander = _request(50, {"strategy": "ensemble", "members": ["partner", "partner2"]}, max_tokens=40)
    requests.append(bystander)

    async def run_and_kill():
        from tests.actors.coordination.test_coordinator_reference import _collect

        tasks = [asyncio.create_task(_collect(slow_group.coordinator, r)) for r in requests]
        await asyncio.sleep(0.3)
        for name in victims:
            _kill(slow_group.workers[name])
        return await asyncio.gather(*tasks)

    results = asyncio.run(run_and_kill())
    finals = [chunks[-1] for chunks in results]
    failed = [f for f in finals if f.error is not None]
    assert failed, "no request was in flight when the worker died"
    if "partner" not in victims:
        assert finals[-1].error is None and len(_tokens(results[-1])) == 40
    assert all(f.retryable and "unavailable" in f.error for f in failed), [f.error for f in failed]
    recovery_s = _serve_again(slow_group, RECOVERY_LIMIT_S)
    print(f"recovered in {recovery_s:.1f} s; {len(failed)} of {len(finals)} requests failed retryably")
    assert recovery_s < RECOVERY_LIMIT_S
    # A request after recovery is exact again (same tokens as before any failure).
    (again,) = run_requests(slow_group, [requests[0]])
    (fresh,) = run_requests(slow_group, [requests[0]])
    assert _tokens(again) == _tokens(fresh)


def test_a_draft_killed_mid_burst_fails_the_request_retryably_and_the_next_burst_links_again(slow_group):
    """One request alone runs in bursts whose draft calls go over the direct peer link
    (actors/worker/peer_link.py). Its draft dies mid-burst: the request ends retryably, the restarted
    draft serves the next bursts over a new link, and their tokens are exact again."""
    speculation = {"strategy": "sd", "method": "block", "gamma": 3}
    request = _request(7, speculation, max_tokens=60)
    (expected,) = run_requests(slow_group, [request])
    draft = slow_group.workers["draft"]
    assert ray.get(draft.engine_stats.remote())["peer_link_calls"] > 0

    async def run_and_kill():
        from tests.actors.coordination.test_coordinator_reference import _collect

        task = asyncio.create_task(_collect(slow_group.coordinator, request))
        await asyncio.sleep(0.3)
        _kill(draft)
        return await task

    chunks = asyncio.run(run_and_kill())
    assert chunks[-1].error is not None and chunks[-1].retryable, chunks[-1].error
    assert _serve_again(slow_group, RECOVERY_LIMIT_S) < RECOVERY_LIMIT_S
    (again,) = run_requests(slow_group, [request])
    assert _tokens(again) == _tokens(expected)
    assert ray.get(draft.engine_stats.remote())["peer_link_calls"] > 0  # the restarted draft's own link


def test_a_co_located_worker_that_dies_takes_its_models_and_the_group_recovers(ray_session):
    """Target and draft hosted by one worker (resources.placement): killing it fails every request
    on either model retryably (sessions on both are gone), a bystander ensemble on the members'
    own workers finishes, and after the restart the group serves the same tokens as before."""
    group = start_model_group(fake_group_config(placement=CO_LOCATED), worker_cls=SlowFunctionModelWorker)
    try:
        assert group.workers["target"].host_id == group.workers["draft"].host_id
        speculation = {"strategy": "sd", "method": "block", "gamma": 3}
        requests = [_request(seed, speculation, max_tokens=40) for seed in range(4)]
        requests.append(_request(8, {"strategy": "ar"}, max_tokens=40))
        bystander = _request(50, {"strategy": "ensemble", "members": ["partner", "partner2"]}, max_tokens=40)
        (before,) = run_requests(group, [requests[0]])

        async def run_and_kill():
            from tests.actors.coordination.test_coordinator_reference import _collect

            tasks = [asyncio.create_task(_collect(group.coordinator, r)) for r in [*requests, bystander]]
            await asyncio.sleep(0.3)
            _kill(group.workers["draft"])  # the host of target and draft
            return await asyncio.gather(*tasks)

        results = asyncio.run(run_and_kill())
        finals = [chunks[-1] for chunks in results]
        assert all(f.error is not None and f.retryable and "unavailable" in f.error for f in finals[:-1]), finals
        assert finals[-1].error is None and len(_tokens(results[-1])) == 40
        assert _serve_again(group, RECOVERY_LIMIT_S) < RECOVERY_LIMIT_S
        (again,) = run_requests(group, [requests[0]])
        assert _tokens(again) == _tokens(before)
    finally:
        group.shutdown()


def test_a_request_past_its_timeout_ends_and_frees_its_sessions(ray_session):
    """limits.request_timeout_s bounds every request: a slow one ends with a timed-out error
    (HTTP 504) and its sessions are freed; a short one on the same group completes."""
    group = start_model_group(fake_group_config(request_timeout_s=1.0), worker_cls=SlowFunctionModelWorker)
    try:
        slow, quick = run_requests(group, [_request(1, {"strategy": "ar"}, max_tokens=60),
                                           _request(2, {"strategy": "ar"}, max_tokens=4)])
        assert slow[-1].timed_out and "request_timeout_s=1" in slow[-1].error
        assert quick[-1].error is None and len(_tokens(quick)) == 4
        deadline = time.monotonic() + 10
        while any(ray.get(w.num_sessions.remote()) for w in group.workers.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(ray.get(w.num_sessions.remote()) for w in group.workers.values())
    finally:
        group.shutdown()


def test_the_request_that_started_the_step_loops_leaves_without_failing_the_others(ray_session):
    """The ingress cancels a request's ``generate`` when its client goes away, and Ray cancels the
    tasks that call submitted too (``ray.cancel`` is recursive). The step loops start inside the
    first request's call: their worker calls must not count as its children, or that client
    leaving would cancel every request's step."""
    group = start_model_group(fake_group_config(), worker_cls=SlowFunctionModelWorker)
    speculation = {"strategy": "sd", "method": "block", "gamma": 3}
    try:
        async def first_leaves_while_others_run():
            from tests.actors.coordination.test_coordinator_reference import _collect

            first = group.coordinator.generate.options(num_returns="streaming").remote(_request(1, speculation, max_tokens=60))
            async for ref in first:  # this request started the loops; it is running
                await ref
                break
            others = [asyncio.create_task(_collect(group.coordinator, _request(seed, speculation, max_tokens=24)))
                      for seed in range(2, 6)]
            await asyncio.sleep(0.3)
            ray.cancel(first)  # what the ingress does when its client goes away
            return await asyncio.gather(*others)

        results = asyncio.run(first_leaves_while_others_run())
    finally:
        group.shutdown()
    assert [len(_tokens(chunks)) for chunks in results] == [24, 24, 24, 24]
