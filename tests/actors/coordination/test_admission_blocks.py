"""Admission by KV blocks (actors.coordination.admission) on stand-in requests: who is admitted
while blocks last, who is preempted when running requests outgrow the pool, and what a
preempted request that leaves the waiting line releases."""

from __future__ import annotations

from types import SimpleNamespace

from actors.coordination.admission import Admission
from actors.coordination.cohorts import Cohort
from actors.messages import KVPool

POOL = KVPool(blocks=60, block_size=16, reserve=32)  # a 10-token request: ceil(42 / 16) + 1 = 4 blocks


def _request(name: str, started: float, tokens: int = 10, generated: int = 0) -> SimpleNamespace:
    return SimpleNamespace(session_id=name, started=started, prompt_ids=[1] * tokens,
                           output=SimpleNamespace(token_ids=[2] * generated), opens={}, opened={"target"},
                           preempted=0, cancelled=False, finished=False)


def _admission(released: list[str]) -> tuple[Admission, Cohort]:
    cohort = Cohort(0)
    admission = Admission([cohort], policy=None, results=None, metrics=None,
                          release=lambda request: released.append(request.session_id), max_running=16,
                          max_waiting=16, request_timeout_s=60.0, pre_drafting=0, max_tokens_per_step=None)
    admission.kv_pools = {"target": POOL}
    return admission, cohort


def test_blocks_for_counts_the_reserve_and_a_block_for_the_step():
    assert POOL.blocks_for(10) == 4 and POOL.blocks_for(90) == 9


def test_requests_wait_while_their_blocks_do_not_fit_and_the_newest_is_preempted():
    released: list[str] = []
    admission, cohort = _admission(released)
    cohort.running = [_request(f"r{i}", started=i) for i in range(15)]  # 60 blocks of 60
    admission.waiting.append(_request("late", started=99))
    assert not admission.can_admit()  # 64 blocks
    for request in cohort.running:
        request.output.token_ids = [2] * 16  # 26 tokens: 5 blocks each, 75 > 60
    admission.preempt(cohort)
    assert [r.session_id for r in admission.waiting][:3] == ["r12", "r13", "r14"]  # newest first back in line
    assert len(cohort.running) == 12 and admission.preemptions == 3 and admission.waiting[0].preempted == 1
    assert admission.blocks_fit(cohort.running)
    admission.waiting[0].cancelled = True  # a preempted request that leaves releases its sessions
    admission.drop_left(cohort)
    assert released == ["r12"]


def test_a_lone_request_always_runs():
    admission, cohort = _admission([])
    admission.waiting.append(_request("huge", started=0, tokens=10_000))
    assert admission.can_admit()
    cohort.running = [admission.waiting.popleft()]
    admission.preempt(cohort)
    assert len(cohort.running) == 1
